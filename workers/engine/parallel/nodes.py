"""A rank group spanning nodes (pods): where each rank lives, the leader's link to the other nodes' ranks,
and the process a non-leader node runs.

Layout (vLLM's names, the pod contract's values: docs/components.md): `--nnodes` nodes of `per_node =
size / nnodes` ranks each (size: tensor_parallel_size, or data_parallel_size for a DEP group); node
`--node-rank` k runs the global ranks k * per_node .. (k + 1) * per_node - 1. Node 0 is the leader: its rank 0 is the engine (scheduler, sampler, gRPC), and it
hosts the rendezvous, a TCPStore on `--master-addr:--master-port` (the address it resolves to is the only
one bound: the leader pod's own IP in a pod, 127.0.0.1 locally). Every rank's gloo listener binds its own
node's address (`--host` on other nodes).

Steps reach the leader's own ranks over pipes (workers/engine/parallel/launcher.py) and the other nodes'
ranks over one TCP connection each, which the rank opens to the leader's step port (published in the
store under STEP_PORT_KEY). On that connection the leader sends pickled plain data (the RankSpec, each
SchedulerOutput, None = stop) and the rank answers JSON only ("loaded" or its error), so the listening
side never unpickles what the network sends it. A DEP group's ranks (workers/engine/parallel/dp_engine.py)
answer in msgpack instead, through the explicit encoders of workers/engine/parallel/dp_wire.py (the link's
`encode` on the rank, `decode` on the leader). Both sides send an empty heartbeat frame every second:
a side that hears nothing for HEARTBEAT_TIMEOUT_S (or sees the connection close) takes the other for dead.
The leader's engine then fails (RankFailedError: unhealthy, exit 1); a rank whose leader is gone exits 1,
and so does its node process. Every wait is bounded, and its error names the address it waited for.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from k3serve.workers.engine.parallel.group import LOOPBACK, RendezvousError, _listen

log = logging.getLogger(__name__)

STEP_PORT_KEY = "k3serve/step-port"
_STOP = pickle.dumps(None, protocol=pickle.HIGHEST_PROTOCOL)  # the leader's stop, as RemoteRank.send frames it
HEARTBEAT_S = 1.0
SEND_TIMEOUT_S = 3.0
HEARTBEAT_TIMEOUT_S = float(os.environ.get("K3SERVE_NODE_HEARTBEAT_TIMEOUT_S", "5"))
# how long the leader waits for the other nodes' ranks to connect, and they for the leader (pods start apart)
RENDEZVOUS_TIMEOUT_S = float(os.environ.get("K3SERVE_RENDEZVOUS_TIMEOUT_S", "600"))


def resolve(addr: str, timeout_s: float) -> str:
    """addr's IP address, retrying for up to `timeout_s` (a new pod's DNS record can lag its start)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
        except socket.gaierror as e:
            if time.monotonic() >= deadline:
                raise RendezvousError(f"rendezvous: cannot resolve the group leader {addr!r} ({e.strerror})") from None
            time.sleep(0.5)


@dataclass(frozen=True)
class NodeLayout:
    """Where this process sits in its rank group."""

    size: int  # ranks in the group (tensor_parallel_size; data_parallel_size for a DEP group)
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    @property
    def local_ranks(self) -> list[int]:
        return self.ranks_of(self.node_rank)

    @property
    def remote_ranks(self) -> list[int]:
        return [r for node in range(self.nnodes) if node != self.node_rank for r in self.ranks_of(node)]

    @property
    def leader(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    @classmethod
    def from_args(cls, args) -> NodeLayout:
        """From EngineArgs-like args; ValueError (one line) for a layout no group can have."""
        size, what = group_size(args)
        nnodes = int(getattr(args, "nnodes", 1) or 1)
        node_rank = int(getattr(args, "node_rank", 0) or 0)
        problem = layout_problem(size, nnodes, node_rank, what)
        if problem:
            raise ValueError(problem)
        return cls(size, nnodes, node_rank, str(getattr(args, "master_addr", None) or LOOPBACK),
                   int(getattr(args, "master_port", 29500)))


def group_size(args) -> tuple[int, str]:
    """(ranks in the group, the field that sets it): data_parallel_size for a DEP group, else tensor_parallel_size."""
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    if dp > 1:
        return dp, "data_parallel_size"
    return int(getattr(args, "tensor_parallel_size", 1) or 1), "tensor_parallel_size"


def layout_problem(size: int, nnodes: int, node_rank: int, what: str = "tensor_parallel_size") -> str | None:
    if nnodes < 1:
        return f"nnodes must be >= 1 (got {nnodes})"
    if not 0 <= node_rank < nnodes:
        return f"node_rank {node_rank} is not in 0..{nnodes - 1} (nnodes={nnodes})"
    if nnodes > 1 and (size < nnodes or size % nnodes):
        return (f"{what}={size} does not split over nnodes={nnodes} "
                "(every node runs the same number of ranks)")
    return None


def _bound_waits(sock: socket.socket) -> None:
    """TCP keepalive probes after 5 s idle, every 1 s, 3 lost = dead: a peer cut off mid-frame (no FIN, no
    heartbeat can arrive while a frame is half read) still fails the read within about 8 s. A send that
    cannot proceed for SEND_TIMEOUT_S (a frozen peer's buffers full) fails instead of blocking."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Link:
    """One framed TCP connection (multiprocessing's Connection over a socket) with a heartbeat thread.
    Frames: b"" = heartbeat; anything else is a message. One reader thread (the caller)."""

    def __init__(self, sock: socket.socket, peer: str):
        sock.setblocking(True)
        _bound_waits(sock)
        self.conn = Connection(sock.detach())
        self.peer = peer
        self.lock = threading.Lock()
        self.closed = False
        self.last_heard = time.monotonic()
        self.buffered: list[bytes] = []
        threading.Thread(target=self._beat, name=f"k3serve-heartbeat-{peer}", daemon=True).start()

    def _beat(self) -> None:
        while not self.closed:
            try:
                self.send_bytes(b"")
            except (OSError, ValueError):
                self.closed = True
                return
            time.sleep(HEARTBEAT_S)

    def send_bytes(self, data: bytes) -> None:
        with self.lock:
            self.conn.send_bytes(data)

    def _read(self, timeout_s: float) -> bool:
        """Read frames for up to `timeout_s`; True once a message is buffered or the link is closed. Every
        frame already there is drained (heartbeats too, also behind a buffered message: last_heard is fresh)."""
        deadline = time.monotonic() + timeout_s
        while not self.closed:
            try:
                if not self.conn.poll(0.0 if self.buffered else max(0.0, deadline - time.monotonic())):
                    break
                frame = self.conn.recv_bytes()
            except (EOFError, OSError, ValueError):
                self.closed = True
                break
            self.last_heard = time.monotonic()
            if frame:
                self.buffered.append(frame)
        return bool(self.buffered) or self.closed

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def close(self) -> None:
        self.closed = True
        with self.lock:  # not under a send in flight (bounded by SEND_TIMEOUT_S)
            try:
                self.conn.close()
            except OSError:
                pass


class RemoteRank(_Link):
    """The leader's end of a rank on another node: stands in for both its Process and its Pipe in
    ParallelModelRunner.peers (launcher.py): send / poll / recv like a Connection, exitcode / join / kill
    like a Process. exitcode is None while the rank is heard from, else why it is taken for dead."""

    def __init__(self, sock: socket.socket, rank: int, peer: str, decode=None):
        super().__init__(sock, peer)
        self.rank = rank
        self.stopped = False  # the leader sent None (stop)
        self.decode = decode or _json_message  # frame bytes -> message (never unpickled)

    # the Connection side
    def send(self, obj) -> None:
        self.stopped = self.stopped or obj is None
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def poll(self, timeout_s: float = 0.0) -> bool:
        return self._read(timeout_s)

    def recv(self):
        while not self._read(3600.0):
            pass
        if self.buffered:
            return self.decode(self.buffered.pop(0))
        raise EOFError(f"rank {self.rank} at {self.peer} closed its connection")

    # the Process side
    @property
    def exitcode(self):
        if not self.closed:
            self._read(0.0)
        if self.closed:
            return 0 if self.stopped else f"lost: its node ({self.peer}) closed the connection"
        if self.silent_for() > HEARTBEAT_TIMEOUT_S:
            return f"lost: its node ({self.peer}) was silent for {self.silent_for():.1f} s"
        return None

    def join(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else 3600.0)
        while self.exitcode is None and time.monotonic() < deadline:  # closed, or silent too long
            self._read(min(0.2, max(0.0, deadline - time.monotonic())))
            self.buffered.clear()

    def kill(self) -> None:
        self.close()


def _json_message(frame: bytes) -> tuple:
    msg = json.loads(frame)
    return (str(msg[0]), msg[1])


def accept_remote_ranks(bind_host: str, nodes: NodeLayout, store, spec_for, deadline: float,
                        decode=None) -> list[RemoteRank]:
    """Leader: listen on bind_host (a free port, published in `store`), accept one connection per remote
    rank (each says which rank it is), send each its RankSpec (`spec_for(rank)`); bounded by `deadline`.
    `decode`: how the ranks' answers are read (JSON by default; a DEP group's: dp_wire.decode)."""
    server = _listen(bind_host, 0)
    store.set(STEP_PORT_KEY, str(server.getsockname()[1]))
    want = set(nodes.remote_ranks)
    got: dict[int, RemoteRank] = {}
    try:
        while want - set(got):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(want - set(got))
                raise RendezvousError(
                    f"rendezvous: ranks {missing} (of nodes "
                    f"{sorted({r // nodes.per_node for r in missing})}) never joined the group at "
                    f"{bind_host}:{nodes.master_port} (--master-addr {nodes.master_addr})")
            server.settimeout(min(left, 1.0))
            try:
                sock, addr = server.accept()
            except TimeoutError:
                continue
            sock.setblocking(True)
            first = Connection(os.dup(sock.fileno()))
            try:  # the hello frame: {"rank": R}, within 10 s
                if not first.poll(10.0):
                    raise ValueError("no hello")
                rank = int(json.loads(first.recv_bytes(1024))["rank"])
            except (OSError, EOFError, ValueError, KeyError, TypeError):
                first.close()
                sock.close()
                log.warning("rendezvous: dropped a connection from %s that did not name its rank", addr[0])
                continue
            first.close()
            if rank not in want or rank in got:
                sock.close()
                log.warning("rendezvous: dropped %s claiming rank %r (expected one of %s)", addr[0], rank,
                            sorted(want - set(got)))
                continue
            got[rank] = RemoteRank(sock, rank, f"{addr[0]}:{addr[1]}", decode)
            got[rank].send(spec_for(rank))
    except BaseException:
        for link in got.values():
            link.close()
        raise
    finally:
        server.close()
    return [got[r] for r in sorted(got)]


class LeaderLink(_Link):
    """A remote rank's end of its connection to the leader, as rank_main (launcher.py) uses its pipe:
    send(("loaded", None) | ("error", text)) goes as JSON; recv() returns the next pickled object and
    raises EOFError when the leader closed the connection or was silent for HEARTBEAT_TIMEOUT_S."""

    def __init__(self, sock: socket.socket, peer: str, notify=None):
        super().__init__(sock, peer)
        self.notify = notify  # the node process's pipe: told when this rank has loaded
        self.encode = None  # a DEP rank's: dp_wire.encode (set once its spec says so); None: JSON

    def send(self, msg) -> None:
        self.send_bytes(self.encode(msg) if self.encode else json.dumps([msg[0], msg[1]]).encode())
        if self.notify is not None and msg[0] == "loaded":  # what the node process waits for
            try:
                self.notify.send(msg[0])
            except OSError:
                pass

    def poll(self, timeout_s: float = 0.0) -> bool:
        """A message waiting (or the link closed: recv then raises), as Connection.poll: rank_main's wait
        for the next step while a P/D pull of this rank runs."""
        return self._read(timeout_s)

    def check(self) -> None:
        """EOFError if the leader is gone: the link closed, or silent for HEARTBEAT_TIMEOUT_S (heartbeats
        drained first). For a rank waiting in a collective (RankGroup.watch, dp_engine.py)."""
        self._read(0.0)
        if self.closed:
            raise EOFError(f"the group leader {self.peer} closed the connection")
        if self.silent_for() > HEARTBEAT_TIMEOUT_S:
            raise EOFError(f"the group leader {self.peer} was silent for {self.silent_for():.1f} s")

    def recv(self):
        """The leader's next message. Once the link has closed, what is still buffered was sent to a rank the
        leader has given up on (a node frozen, then thawed): only its stop (None) counts, else EOFError (the
        leader tells no lost rank to stop: launcher.stop_ranks, so a lost node exits 1)."""
        while True:
            if self._read(0.5) and self.closed:
                if _STOP in self.buffered:
                    self.buffered.clear()
                    return None
                self.buffered.clear()
            if self.buffered:
                return pickle.loads(self.buffered.pop(0))
            if self.closed:
                raise EOFError(f"the group leader {self.peer} closed the connection")
            if self.silent_for() > HEARTBEAT_TIMEOUT_S:
                raise EOFError(f"the group leader {self.peer} was silent for {self.silent_for():.1f} s")


def connect_to_leader(nodes: NodeLayout, rank: int, timeout_s: float, notify=None, source_host: str | None = None):
    """A remote rank: join the leader's store, then open its step connection (from `source_host`, this
    node's address, when given); returns (store, link)."""
    from k3serve.workers.engine.parallel.group import join_store

    leader_ip = resolve(nodes.master_addr, timeout_s)
    store = join_store(nodes.master_port, nodes.size, timeout_s, host=leader_ip)
    try:
        port = int(store.get(STEP_PORT_KEY))
    except RuntimeError as e:
        raise RendezvousError(f"rendezvous: the leader at {nodes.leader} never published its step port "
                              f"({str(e).splitlines()[0]})") from None
    try:
        sock = socket.create_connection((leader_ip, port), timeout=min(timeout_s, 30.0),
                                        source_address=(source_host, 0) if source_host else None)
    except OSError as e:
        raise RendezvousError(f"rendezvous: cannot reach the leader's step port {leader_ip}:{port} "
                              f"({e.strerror or e})") from None
    sock.settimeout(None)
    hello = Connection(os.dup(sock.fileno()))
    hello.send_bytes(json.dumps({"rank": rank}).encode())
    hello.close()
    return store, LeaderLink(sock, f"{leader_ip}:{port}", notify)


# The pod contract's placement variables (docs/components.md, operator/render_workers.py) -> EngineArgs fields
PLACEMENT_ENV = (("K3SERVE_NUM_NODES", "nnodes", int), ("K3SERVE_NODE_RANK", "node_rank", int),
                 ("K3SERVE_LEADER_ADDR", "master_addr", str))


def placement_from_env(args, environ=os.environ) -> str | None:
    """Fill --nnodes / --node-rank / --master-addr from the pod's K3SERVE_NUM_NODES / K3SERVE_NODE_RANK /
    K3SERVE_LEADER_ADDR where the flag was left at its default; a value that is not a number is the
    returned one-line problem (else None)."""
    from k3serve.workers.engine.api import EngineArgs

    defaults = EngineArgs(model="-")
    for var, field, kind in PLACEMENT_ENV:
        text = environ.get(var, "").strip()
        if not text or getattr(args, field) != getattr(defaults, field):
            continue
        try:
            setattr(args, field, kind(text))
        except ValueError:
            return f"{var}={text!r}: expected a whole number"
    return None
