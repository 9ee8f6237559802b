"""A seeded fuzz of the gateway (`k3serve router` in front of a real worker, started by `k3serve up`).

The generator and checks are test_fuzz_server.py's (the same malformed and odd OpenAI requests that
`k3serve serve` must survive); here they go through the router, which validates, renders and tokenizes
them itself and forwards the good ones over gRPC. No 5xx, no non-OpenAI error body, no dropped
connection, no SSE error event; the gateway and the worker serve afterwards. CI runs NUM_REQUESTS
(2,000) requests; `K3SERVE_FUZZ_REQUESTS=10000` runs the full set (the figures go in the report).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_fuzz_server as fz  # tests/ is on sys.path (conftest); reuse its generator and checks

NUM_REQUESTS = int(os.environ.get("K3SERVE_FUZZ_REQUESTS", "2000"))
BUDGET_S = float(os.environ.get("K3SERVE_FUZZ_BUDGET_S", "60"))
MIN_DONE = min(NUM_REQUESTS, 800)
SEED = int(os.environ.get("K3SERVE_FUZZ_SEED", "20261202"))


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz-up")
    cmd = [sys.executable, "-m", "k3serve.cli", "up", "--model", str(tiny_model_dir), "--workers", "1", "--port", "0",
           "--log-dir", str(logs), "--max-model-len", str(fz.MAX_LEN), "--served-model-name", fz.NAME,
           "--num-threads", "1", "--worker-arg=--max-num-seqs=16"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    port, lines = None, []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"API is at http://127\.0\.0\.1:(\d+)/v1", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        proc.kill()
        pytest.fail("k3serve up did not come up:\n" + "".join(lines))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    yield port, logs, proc
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_named_cases_through_the_gateway(gateway):
    port, _, _ = gateway
    client = fz.Client(port)
    for what, method, path, body, want in fz.NAMED:
        status, connection, ctype, data = client.send(method, path, None if body is None else json.dumps(body))
        assert status == want, (what, status, data[:300])
        assert fz.check(status, connection, ctype, data) is None, what
    fz._healthy(client)


def test_fuzz_gateway(gateway):
    port, logs, proc = gateway
    rng = random.Random(SEED)
    requests = [fz.make_request(rng) for _ in range(NUM_REQUESTS)]
    failures: list[str] = []
    done, statuses = [0], {}
    lock = threading.Lock()
    t0 = time.monotonic()
    deadline = t0 + BUDGET_S

    def worker(k: int) -> None:
        client = fz.Client(port)
        for i in range(k, len(requests), fz.CONNECTIONS):
            if time.monotonic() > deadline or len(failures) > 20:
                return
            method, path, body = requests[i]
            try:
                result = client.send(method, path, body)
                why = fz.check(*result)
                with lock:
                    statuses[result[0]] = statuses.get(result[0], 0) + 1
            except (http.client.HTTPException, OSError) as e:
                why = f"connection failed: {type(e).__name__}: {e}"
                client = fz.Client(port)
            with lock:
                done[0] += 1
                if why:
                    failures.append(f"request #{i} {method} {path} {(body or b'')[:200]!r}: {why}")

    with ThreadPoolExecutor(fz.CONNECTIONS) as pool:
        list(pool.map(worker, range(fz.CONNECTIONS)))
    print(f"gateway fuzz seed {SEED}: {done[0]} requests in {time.monotonic() - t0:.1f} s, "
          f"statuses {sorted(statuses.items())}")
    assert not failures, f"seed {SEED}: {len(failures)} failures, first ones:\n" + "\n".join(failures[:10])
    assert done[0] >= MIN_DONE, f"only {done[0]} requests in {BUDGET_S}s"
    fz._healthy(fz.Client(port))
    assert proc.poll() is None
    for log in logs.glob("*.log"):
        text = log.read_text()
        assert "Traceback" not in text, (log.name, text[-3000:])
