"""What a non-leader node runs: `k3serve worker --nnodes N --node-rank K` with K > 0 (the pod contract
renders the same command on every pod of a group; docs/components.md).

The node process serves no gRPC: it spawns its ranks (one process each, workers/engine/parallel/nodes.py
for the layout), each of which connects to the leader, gets its spec there, loads its shard and
executes the steps rank 0 sends (a TP group's RankSpec), or runs a whole DP rank's engine that answers the
DEP front's messages in dp_wire frames (a DEP group's RankArgs: workers/engine/parallel/dp_engine.py). The node process serves `/health` and `/ready` on `--metrics-port`
(200 while all its ranks live and have loaded, else 503) and `/metrics` (k3serve_node_ranks_ready) and exits when one of them exits: 0 when the
leader stopped the group, 1 otherwise (the leader gone or silent, a rank that failed), after stopping
the others. SIGTERM / SIGINT (a group's pods are stopped together) give the leader STOP_GRACE_S to stop
the group itself, so the leader sees no lost rank; then the ranks are killed; the exit status is 0.
"""

from __future__ import annotations

import dataclasses
import http.server
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time

from k3serve.workers.engine.parallel.nodes import RENDEZVOUS_TIMEOUT_S, NodeLayout, connect_to_leader

log = logging.getLogger(__name__)
PROG = "k3serve worker"
STOP_GRACE_S = 10.0  # after SIGTERM, how long the ranks wait for the leader to stop the group


def _exit_with_parent(parent: int) -> None:
    """A rank outlives no node process (SIGKILL of the node leaves no orphan rank behind)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def remote_rank_main(rank: int, nodes: NodeLayout, bind_host: str, notify, parent: int, log_level: str) -> None:
    """A rank on a non-leader node: connect to the leader, take its spec, then run as rank_main does (a
    tensor-parallel group's RankSpec) or as dp_rank_main does (a DEP group's RankArgs, answering in
    dp_wire frames)."""
    from k3serve.workers.engine.parallel.dp_engine import RankArgs, dp_rank_main
    from k3serve.workers.engine.parallel.launcher import rank_main

    logging.basicConfig(level=getattr(logging, str(log_level).upper(), logging.WARNING),
                        format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the node process stops its ranks (a pod's SIGTERM may
        signal.signal(sig, signal.SIG_IGN)     # reach its whole process group)
    try:
        _store, link = connect_to_leader(nodes, rank, RENDEZVOUS_TIMEOUT_S, notify, source_host=bind_host)
        spec = link.recv()
    except (OSError, EOFError, RuntimeError) as e:
        print(f"{PROG}: rank {rank}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    leader_ip = link.peer.rsplit(":", 1)[0]
    from k3serve.workers.engine.parallel.threads import override

    try:  # this node's own K3SERVE_RANK_THREADS (or --num-threads) wins over the leader's
        threads = override() or spec.num_threads
    except ValueError as e:
        print(f"{PROG}: rank {rank}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    if isinstance(spec, RankArgs):  # a DEP group (workers/engine/parallel/dp_engine.py)
        from k3serve.workers.engine.parallel import dp_wire

        link.encode = dp_wire.encode
        dp_rank_main(rank, dataclasses.replace(spec, host=bind_host, store_host=leader_ip, port=nodes.master_port,
                                               num_threads=threads), link)
    else:
        rank_main(rank, dataclasses.replace(spec, host=bind_host, store_host=leader_ip, port=nodes.master_port,
                                            ranks_per_host=nodes.per_node, num_threads=threads), link)


class _Health(http.server.BaseHTTPRequestHandler):
    state: dict = {}

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.split("?")[0] in ("/health", "/ready"):
            ok = self.state["ok"]()
            body = b'{"status":"ok"}' if ok else b'{"status":"unhealthy"}'
            self.send_response(200 if ok else 503)
            ctype = "application/json"
        elif self.path.split("?")[0] == "/metrics":  # k3serve/common/metrics_catalog.py, component "node"
            import prometheus_client

            body, ctype = prometheus_client.generate_latest(self.state["registry"]), prometheus_client.CONTENT_TYPE_LATEST
            self.send_response(200)
        else:
            body, ctype = b'{"error":"not found"}', "application/json"
            self.send_response(404)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):  # no access log
        pass


def run_node(args, msock) -> int:
    """The node process (node_rank > 0); `msock` is the bound metrics socket. Returns the exit status."""
    nodes = NodeLayout.from_args(args)
    if getattr(args, "num_threads", None):  # every rank of this node (workers/engine/parallel/threads.py)
        from k3serve.workers.engine.parallel.threads import ENV

        os.environ[ENV] = str(args.num_threads)
    ctx = mp.get_context("spawn")
    ranks = []
    for rank in nodes.local_ranks:
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=remote_rank_main, name=f"k3serve-rank-{rank}",
                           args=(rank, nodes, args.host, child_end, os.getpid(), args.log_level))
        proc.start()
        child_end.close()
        ranks.append((rank, proc, parent_end))
    loaded: set[int] = set()
    stop = threading.Event()

    def healthy() -> bool:
        return len(loaded) == len(ranks) and all(p.exitcode is None for _r, p, _c in ranks)

    import prometheus_client

    from k3serve.common.metrics_catalog import build

    registry = prometheus_client.CollectorRegistry()
    build(registry, "node")["k3serve_node_ranks_ready"].set_function(
        lambda: sum(1 for r, p, _c in ranks if r in loaded and p.exitcode is None))
    handler = type("Health", (_Health,), {"state": {"ok": healthy, "registry": registry}})
    server = http.server.ThreadingHTTPServer(msock.getsockname()[:2], handler, bind_and_activate=False)
    server.socket.close()
    server.socket = msock
    msock.listen(64)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="k3serve-node-health", daemon=True).start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    mhost, mport = msock.getsockname()[:2]
    announced = False
    status = 0
    stop_by = None  # after SIGTERM: when the ranks are stopped if the leader has not stopped them
    try:
        while True:
            if stop.is_set() and stop_by is None:
                stop_by = time.monotonic() + STOP_GRACE_S
            if stop_by is not None and time.monotonic() >= stop_by:
                break
            ready = multiprocessing.connection.wait([p.sentinel for _r, p, _c in ranks]
                                                    + [c for _r, _p, c in ranks if not c.closed], timeout=0.2)
            for rank, _proc, conn in ranks:
                if conn in ready:
                    try:
                        if conn.recv() == "loaded":
                            loaded.add(rank)
                    except (EOFError, OSError):
                        conn.close()
            if not announced and healthy():
                announced = True
                print(f"{PROG}: node {nodes.node_rank} of {nodes.nnodes} ready ranks={nodes.local_ranks} "
                      f"leader={nodes.leader} metrics=http://{mhost}:{mport}", flush=True)
            dead = [(r, p) for r, p, _c in ranks if p.exitcode is not None]
            if dead:
                rank, proc = dead[0]
                status = 0 if proc.exitcode == 0 or stop.is_set() else 1
                if status:
                    print(f"{PROG}: node {nodes.node_rank}: rank {rank} exited (status {proc.exitcode}); "
                          "stopping this node", flush=True)
                break
    finally:
        deadline = time.monotonic() + (0.0 if status or stop.is_set() else 5.0)
        for _r, proc, _c in ranks:  # the others exit 0 by themselves when the leader stopped the group
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()  # ranks ignore SIGTERM (remote_rank_main)
                proc.join(5.0)
        server.shutdown()
        server.server_close()
    return status
