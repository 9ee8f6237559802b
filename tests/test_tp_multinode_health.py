"""A tensor-parallel group over two "nodes" on 127.0.0.1 (the leader: the engine and rank 0; a `k3serve worker
--node-rank 1` process tree: rank 1) frozen MID-DECODE (SIGSTOP: no FIN, sockets open, a collective waiting on
the frozen side). The node links' silence fails the waiting collective (RankGroup.watch, set by
workers/engine/parallel/launcher.py), not gloo's 30 s timeout:

* the node frozen -> the serving leader exits non-zero within 10 s naming the lost rank; the node, thawed
  afterwards, finds its link closed with no stop in it and exits 1 with one line (no traceback);
* the leader frozen -> the node's rank fails its collective and the node process exits 1 within 10 s.

The leader's /metrics says what it runs: k3serve_parallel_layout{tp="2",nnodes="2",...} 1.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import grpc
import httpx
import pytest

from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.proto.convert import sampling_to_proto
from tests._engine_helpers import random_model_dir
from tests._workers import _cli, _free_port, _Proc


@pytest.fixture(scope="module")
def tp2_model(tmp_path_factory):
    return random_model_dir(tmp_path_factory.getbasetemp(), 23)  # TP2 without expert parallelism


def _start_group(model_dir):
    port = _free_port()
    common = ["--model", str(model_dir), "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port),
              "--metrics-port", "0", "--dtype", "float64", "--max-model-len", "512", "--skip-tokenizer-init",
              "--served-model-name", "m"]
    leader = _Proc(_cli(*common, "--node-rank", "0", "--grpc-port", "0"))
    node = _Proc(_cli(*common, "--node-rank", "1"))
    lm = leader.wait_line(r"ready grpc=(\S+) metrics=(\S+)")
    node.wait_line(r"node 1 of 2 ready ranks=\[1\]")
    return leader, lm.group(1), lm.group(2), node


def _decoding(grpc_addr: str) -> None:
    """Start a 400-token greedy request over gRPC in a thread; return once it has streamed 2 outputs."""
    sp = sampling_to_proto(dict(temperature=0.0, max_tokens=400, ignore_eos=True))
    seen = threading.Event()

    def run():
        with grpc.insecure_channel(grpc_addr) as ch:
            stream = pb_grpc.WorkerStub(ch).Generate(pb.GenerateRequest(
                request_id="long", prompt_token_ids=list(range(3, 40)), sampling_params=sp), timeout=120)
            try:
                for n, _out in enumerate(stream):
                    if n >= 1:
                        seen.set()
            except grpc.RpcError:  # the leader exits
                pass

    threading.Thread(target=run, daemon=True).start()
    assert seen.wait(60), "the request never streamed"


def _layouts(url: str) -> list[dict]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return [dict((k, int(v)) for k, v in re.findall(r'(tp|dp|ep|sp|nnodes)="(\d+)"', m.group(1)))
            for m in re.finditer(r"^k3serve_parallel_layout\{(.*)\} 1\.0$", text, re.M)]


def test_frozen_node_mid_decode_fails_the_leader_fast_and_the_thawed_node_exits_1(tp2_model):
    leader, grpc_addr, lurl, node = _start_group(tp2_model)
    try:
        assert _layouts(lurl) == [dict(tp=2, dp=1, ep=0, sp=0, nnodes=2)]
        _decoding(grpc_addr)
        t0 = time.monotonic()
        os.killpg(node.p.pid, signal.SIGSTOP)
        leader.p.wait(10)
        took = time.monotonic() - t0
        assert leader.p.returncode not in (None, 0) and took < 10, (took, leader.output())
        assert re.search(r"tensor-parallel rank 1 exited \(status lost: its node \(\S+\) was silent for",
                         leader.output()), leader.output()
        before = len(node.lines)
        os.killpg(node.p.pid, signal.SIGCONT)  # lost, not stopped: the leader told it nothing and closed the link
        assert node.p.wait(15) == 1, node.output()
        time.sleep(0.2)  # the reader thread drains the last lines
        after = node.lines[before:]
        assert "Traceback" not in "".join(after), node.output()
        assert len(after) <= 2 and "node 1: rank 1 exited (status 1); stopping this node" in after[-1], after
    finally:
        leader.kill_tree()
        node.kill_tree()


def test_frozen_leader_mid_decode_makes_the_node_exit_1(tp2_model):
    leader, grpc_addr, _lurl, node = _start_group(tp2_model)
    try:
        _decoding(grpc_addr)
        t0 = time.monotonic()
        os.killpg(leader.p.pid, signal.SIGSTOP)
        node.p.wait(10)
        took = time.monotonic() - t0
        assert node.p.returncode == 1 and took < 10, (took, node.output())
        out = node.output()
        # the rank waited in a collective (RankGroup.watch) or, if the leader froze between two steps, for the
        # next step (LeaderLink.recv): each says so in one line
        assert re.search(r"tensor-parallel rank 1(, between steps| failed: in a collective): the group leader "
                         r"\S+ was silent for", out), out
        assert "rank 1 exited (status 1); stopping this node" in out and "Traceback" not in out, out
    finally:
        leader.kill_tree()
        node.kill_tree()
