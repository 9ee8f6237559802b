"""`k3serve worker --data-parallel-size 2 --enable-expert-parallel` (DEP) as a real process on the tiny checkpoint: one
gRPC endpoint serves greedy tokens equal to the single-rank offline engine's (float64) with the requests spread
over both ranks; the router's prefix index, fed by the worker's one merged KV-event stream, predicts exactly the
cached tokens the worker then reports for prompts extending the first two (b arrives while a runs, so the
spreading rule, asserted in tests/test_parallel_dp.py, puts them on different ranks); SIGKILL of rank 1 makes
the worker exit non-zero within 10 s, no rank process left."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx

from k3serve.common.block_hash import chain_hashes, model_fingerprint, root_hash
from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.proto.convert import sampling_to_proto
from k3serve.router.prefix_index import PrefixIndex
from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM
from tests._proc_tree import _alive, _children
from tests._workers import _wait_ready

BLOCK = 16
CACHE = ["--enable-prefix-caching", "--block-size", str(BLOCK), "--prefix-cache-retention-interval", str(BLOCK)]
A = [(7 * i + 3) % 500 for i in range(40)]
B = [(11 * i + 5) % 500 for i in range(37)]


def _generate(stub, rid, prompt, max_tokens=4, on_first=None):
    sp = sampling_to_proto(dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    resps = []
    for r in stub.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp),
                           timeout=120):
        resps.append(r)
        if on_first is not None and len(resps) == 1:
            on_first()
    return [t for r in resps for o in r.outputs for t in o.token_ids], resps[-1].cached_tokens


def test_dep_worker_serves_one_endpoint_merges_kv_events_and_dies_cleanly(tiny_model_dir):
    cmd = [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(tiny_model_dir), "--grpc-port", "0",
           "--metrics-port", "0", "--max-model-len", "256", "--num-threads", "1", "--log-level", "warning",
           "--data-parallel-size", "2", "--enable-expert-parallel", "--dtype", "float64", *CACHE]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    lines = []
    try:
        addr, murl = _wait_ready(proc, 180, lines)
        index, slot, lock = PrefixIndex(), None, threading.Lock()
        slot = index.add_worker("dep")
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.WorkerStub(ch)
            events = stub.SubscribeKvEvents(pb.KvEventsRequest(), timeout=120)

            def follow():
                try:
                    for msg in events:
                        with lock:
                            index.apply(slot, msg)
                except grpc.RpcError:  # the channel closes at the end of the test
                    pass

            threading.Thread(target=follow, daemon=True).start()
            with ThreadPoolExecutor(1) as pool:  # b arrives while a runs on rank 0: the leader sends it to rank 1
                b = []
                a = _generate(stub, "a", A, 24, on_first=lambda: b.append(pool.submit(_generate, stub, "b", B)))
                b = b[0].result()
            offline = LLM(str(tiny_model_dir), dtype="float64", max_model_len=256, enable_prefix_caching=True,
                          block_size=BLOCK, prefix_cache_retention_interval=BLOCK)
            sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            assert a[0] == offline.generate([A], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
                                            )[0].outputs[0].token_ids
            assert b[0] == offline.generate([B], sp)[0].outputs[0].token_ids
            load = stub.GetLoad(pb.LoadRequest(), timeout=10)
            settle = time.monotonic() + 10
            while time.monotonic() < settle:  # the index has every event the worker published
                with lock:
                    if index.last_sequence(slot) == load.kv_event_sequence and index.ready(slot):
                        break
                time.sleep(0.05)
            root = root_hash(model_fingerprint(str(tiny_model_dir)))
            for rid, prompt in (("a2", A[:35] + [1, 2, 3]), ("b2", B[:20] + [4, 5])):
                with lock:
                    predicted = index.predict(chain_hashes(root, prompt, BLOCK), len(prompt), BLOCK, [slot])[slot]
                toks, cached = _generate(stub, rid, prompt)
                assert predicted.usable == cached == len(prompt) // BLOCK * BLOCK - (BLOCK if len(prompt) % BLOCK
                                                                                     == 0 else 0) > 0
                assert toks == offline.generate([prompt], sp)[0].outputs[0].token_ids
            assert httpx.get(murl + "/health", timeout=5).status_code == 200
        ranks = _children(proc.pid)
        victims = [p for p in ranks if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]
        assert len(victims) == 1, victims  # the spawned DP rank 1
        os.kill(victims[0], signal.SIGKILL)
        t0 = time.monotonic()
        rc = proc.wait(timeout=10)
        assert rc != 0, "".join(lines)
        assert time.monotonic() - t0 < 10
        assert "data-parallel rank 1 exited" in "".join(lines)
        gone = time.monotonic() + 5
        while time.monotonic() < gone and [p for p in ranks if _alive(p)]:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dep_openai_server_with_the_official_client(tiny_model_dir):
    """`k3serve serve --data-parallel-size 2`: concurrent completions from the official `openai` client equal
    the offline single-rank engine's (float64, greedy); SIGTERM stops the server and its rank (exit 0)."""
    import openai

    cmd = [sys.executable, "-m", "k3serve.cli", "serve", str(tiny_model_dir), "--port", "0", "--served-model-name",
           "k3-tiny", "--max-model-len", "256", "--num-threads", "1", "--log-level", "warning", "--dtype", "float64",
           "--data-parallel-size", "2", "--enable-expert-parallel", *CACHE]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    lines, url = [], None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and url is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "k3serve serve did not start:\n" + "".join(lines)
        threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
        ranks = _children(proc.pid)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompts = ["Hello there, how are you today?", "The weather in Paris is", "1 2 3 4 5 6 7 8"]

        def complete(p):
            return client.completions.create(model="k3-tiny", prompt=p, max_tokens=6, temperature=0).choices[0].text

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(complete, prompts))
        offline = LLM(str(tiny_model_dir), dtype="float64", max_model_len=256)
        sp = SamplingParams(temperature=0.0, max_tokens=6)
        assert got == [o.outputs[0].text for o in offline.generate(prompts, sp)]
        assert "vllm:num_requests_running" in httpx.get(url + "/metrics", timeout=5).text
        proc.terminate()
        assert proc.wait(timeout=30) == 0, "".join(lines)
        gone = time.monotonic() + 5
        while time.monotonic() < gone and [p for p in ranks if _alive(p)]:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dep_worker_bad_layout_is_one_line(tiny_model_dir):
    """The engine's refusal (32 experts over 3 ranks) is one `k3serve: error:` line, exit 1, no traceback and no
    rank started; a layout the worker cannot serve (2 ranks over 3 nodes) is one line, exit 2."""
    base = [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(tiny_model_dir), "--grpc-port", "0",
            "--metrics-port", "0", "--enable-expert-parallel"]
    env = dict(os.environ, PYTHONSAFEPATH="1")
    for extra, code, text in ((["--data-parallel-size", "3"], 1, "k3serve: error: data_parallel_size=3: this layout "
                               "cannot run the model: routed experts (32) are not divisible over 3 expert-parallel "
                               "ranks"),
                              (["--data-parallel-size", "2", "--nnodes", "3"], 2,
                               "--data-parallel-size=2 does not split over --nnodes=3")):
        proc = subprocess.run(base + extra, capture_output=True, text=True, timeout=120, env=env)
        out = (proc.stdout + proc.stderr).strip()
        assert proc.returncode == code and text in out and len(out.splitlines()) == 1, out
