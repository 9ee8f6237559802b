"""KV events from a real `k3serve worker` process with prefix caching on (dense KDA retention): a
subscriber that watched the whole workload and one that joined afterwards (snapshot) hold the same
index; it names the prompt's blocks and snapshots by the hashes a router computes on its own
(k3serve/common/block_hash.py, docs/prefix-hash.md); and the repeated prompt was served from the cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest

from k3serve.common.block_hash import chain_hashes, model_fingerprint, root_hash
from k3serve.kv_events.index import KvEventIndex
from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.proto.convert import load_to_dict, sampling_to_proto

BLOCK, UNIT, MAX_LEN = 16, 8, 128


class Subscriber:
    def __init__(self, stub):
        self.index, self.error, self.lock = KvEventIndex(), None, threading.Lock()
        self.call = stub.SubscribeKvEvents(pb.KvEventsRequest(), timeout=120)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for msg in self.call:
                with self.lock:
                    self.index.apply(msg)
        except Exception as e:  # noqa: BLE001 - cancelled at the end, or a KvEventGap
            self.error = e

    def wait_for(self, seq, timeout=20.0):
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if self.index.last_sequence == seq and self.index.snapshot_complete:
                    return
            assert self.error is None, f"subscriber failed: {self.error!r}"
            assert time.monotonic() < deadline, f"subscriber stuck at {self.index.last_sequence}, worker at {seq}"
            time.sleep(0.02)

    def wait_snapshot(self, timeout=20.0):
        """Until the subscription is attached (its snapshot arrived): events after it are streamed."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if self.index.last_sequence is not None and self.index.snapshot_complete:
                    return
            assert self.error is None, f"subscriber failed: {self.error!r}"
            assert time.monotonic() < deadline, "no snapshot from the worker"
            time.sleep(0.02)

    def view(self):
        with self.lock:
            return {k: (e["num_tokens"], e["parent_hash"], e["group_kind"]) for k, e in self.index.entries.items()}


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    cmd = [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(tiny_model_dir), "--grpc-port", "0",
           "--metrics-port", "0", "--max-model-len", str(MAX_LEN), "--num-threads", "1", "--log-level", "warning",
           "--enable-prefix-caching", "--block-size", str(BLOCK), "--prefix-match-unit", str(UNIT),
           "--prefix-cache-retention-interval", "dense", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    lines, found = [], None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not found:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(r"ready grpc=(\S+)", line)
    if not found:
        proc.kill()
        pytest.fail("worker did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    channel = grpc.insecure_channel(found.group(1))
    yield pb_grpc.WorkerStub(channel)
    channel.close()
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_kv_events_of_a_caching_worker_process(worker, tiny_model_dir):
    stub = worker
    early = Subscriber(stub)
    early.wait_snapshot()  # attached before the workload: the worker numbers events only while someone listens
    prompt = [(7 * i + 3) % 300 for i in range(40)]
    sp = sampling_to_proto(dict(temperature=0.0, max_tokens=2, ignore_eos=True))

    def generate(rid):
        resps = list(stub.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp),
                                   timeout=60))
        assert resps[-1].finished
        return resps[-1].cached_tokens

    try:
        assert generate("first") == 0
        cached = generate("repeat")
        assert cached >= 32, cached  # the repeat was served from the prefix cache
        seq = load_to_dict(stub.GetLoad(pb.LoadRequest(), timeout=10))["kv_event_sequence"]
        assert seq > 0
        early.wait_for(seq)
        late = Subscriber(stub)  # a snapshot of the same cache
        late.wait_for(seq)
        view = early.view()
        assert view == late.view() and early.index.num_stored > 0
    finally:
        early.call.cancel()
    root = root_hash(model_fingerprint(str(tiny_model_dir)))
    units = chain_hashes(root, prompt, UNIT)  # what a router computes, without the worker
    mla = {h: n for (h, _g), (n, _p, kind) in view.items() if kind == "mla"}
    kda = {h: n for (h, _g), (n, _p, kind) in view.items() if kind == "kda"}
    for end in (16, 32):  # every full block of the prompt, keyed by the unit hash at its end
        assert units[end // UNIT - 1] in mla, end
    # dense retention: KDA snapshots at unit boundaries inside the prompt, each holding exactly that prefix
    prompt_snaps = {units.index(h) for h in kda if h in units}
    assert prompt_snaps and all(kda[units[j]] == (j + 1) * UNIT for j in prompt_snaps)
