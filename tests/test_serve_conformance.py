"""OpenAI conformance and the crashes a fuzz found, on the HTTP layer over the scripted fake engine
(tests/_serve_fakes.py), plus busy ports and the fatal-engine exit of the real processes.

Each fuzz crash (issue 12) answers 400 and the server keeps serving on the same connection; the fuzz
test itself (tests/test_fuzz_server.py) runs the real engine.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import _serve_fakes as fakes  # tests/ is on sys.path (conftest)
import openai
import pytest
from prometheus_client import CollectorRegistry

from k3serve.workers.async_engine import AsyncEngine
from k3serve.workers.metrics import EngineMetrics
from k3serve.workers.serving.app import build_app

MODEL = "k3-test"


class CrashingEngine(fakes.FakeEngine):
    """add_request raises a non-ValueError for the prompt [3, 3, 3] (an unhandled server error)."""

    def add_request(self, request_id, prompt_token_ids, params, cache_salt=None):
        if list(prompt_token_ids) == [3, 3, 3]:
            raise RuntimeError("simulated unexpected failure")
        return super().add_request(request_id, prompt_token_ids, params, cache_salt)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tok = fakes.make_tokenizer(tmp_path_factory.mktemp("tok"))
    engine = CrashingEngine(tok, max_model_len=512)
    registry = CollectorRegistry()
    aeng = AsyncEngine(engine, model_name=MODEL, metrics=EngineMetrics(registry, MODEL), idle_wait_s=0.05)
    aeng.start()
    srv = fakes.ThreadServer(build_app(aeng, served_model_names=[MODEL], registry=registry))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
    yield SimpleNamespace(tok=tok, engine=engine, aeng=aeng, srv=srv, client=client)
    srv.stop()
    aeng.shutdown()


def _conn(env) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", env.srv.port, timeout=30)


def _send(conn, method, path, body=None):
    data = body if body is None or isinstance(body, str | bytes) else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.getheader("connection"), json.loads(r.read() or b"null")


def _ok_completion(env, conn):
    status, _, body = _send(conn, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body


def test_model_card_by_id(env):
    card = env.client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "k3serve")
    with pytest.raises(openai.NotFoundError) as ei:
        env.client.models.retrieve("nope")
    assert ei.value.body["code"] == "model_not_found" and ei.value.body["param"] == "model"


def test_wrong_method_is_an_invalid_request_405(env):
    status, _, body = _send(_conn(env), "PUT", "/v1/chat/completions", {})
    assert status == 405 and body["error"]["type"] == "invalid_request_error"
    status, _, body = _send(_conn(env), "GET", "/v1/completions")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"


def test_more_than_four_stop_sequences(env):
    env.client.completions.create(model=MODEL, prompt="hi", max_tokens=1, stop=["a", "b", "c", "d"])
    with pytest.raises(openai.BadRequestError) as ei:
        env.client.completions.create(model=MODEL, prompt="hi", max_tokens=1, stop=["a", "b", "c", "d", "e"])
    assert ei.value.body["param"] == "stop" and "at most 4" in ei.value.body["message"]


@pytest.mark.parametrize("effort", ["minimal", "low", "medium", "high", "xhigh", "none"])
def test_openai_reasoning_efforts_are_accepted(env, effort):
    r = env.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           reasoning_effort=effort)
    assert r.choices[0].finish_reason in ("length", "stop")


_M = {"role": "user", "content": "x"}
FUZZ_CRASHES = [  # (endpoint, body, param named in the 400) for each crash of issue 12, and neighbours
    ("completions", {"prompt": "hi", "max_tokens": 1, "top_k": 9223372036854775808}, "top_k"),
    ("completions", {"prompt": "hi", "max_tokens": 1, "seed": 2**64}, "seed"),
    ("completions", {"prompt": "hi", "max_tokens": 2**63}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 1, "min_tokens": 2**70}, "min_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [2**64]}, "stop_token_ids.0"),
    ("completions", {"prompt": [2**64], "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {"99999999999999999999999": 1}},
     "logit_bias"),
    ("completions", {"prompt": " " * 1_000_000, "max_tokens": 1}, "prompt"),
    ("chat/completions", {"messages": [_M, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 1000 + "]" * 1000}}]}],
        "max_tokens": 1}, "messages.1.tool_calls.0.function.arguments"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\t" * 1_000_000}], "max_tokens": 1},
     "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "name": " " * 1_000_000}],
                          "max_tokens": 1}, "messages"),
    ("chat/completions", {"messages": [_M], "max_tokens": 1, "repetition_penalty": 1e308}, "repetition_penalty"),
]


@pytest.mark.parametrize("endpoint,body,param", FUZZ_CRASHES, ids=[f"{e}-{p}" for e, _b, p in FUZZ_CRASHES])
def test_fuzz_crashes_answer_400_and_the_server_keeps_serving(env, endpoint, body, param):
    conn = _conn(env)
    status, connection, err = _send(conn, "POST", f"/v1/{endpoint}", {"model": MODEL, **body})
    assert status == 400 and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["param"] == param, err
    assert connection != "close"
    _ok_completion(env, conn)  # same keep-alive connection
    assert env.aeng.is_healthy()


def test_nan_and_infinity_are_rejected(env):
    for lit in ("NaN", "Infinity", "-Infinity"):
        raw = json.dumps({"model": MODEL, "prompt": "hi"})[:-1] + f', "temperature": {lit}}}'
        status, _, err = _send(_conn(env), "POST", "/v1/completions", raw)
        assert status == 400 and err["error"]["param"] == "temperature", (lit, err)


def test_an_unhandled_error_is_a_json_500_and_the_connection_stays_usable(env, caplog):
    conn = _conn(env)
    with caplog.at_level(logging.ERROR):
        status, connection, err = _send(conn, "POST", "/v1/completions",
                                        {"model": MODEL, "prompt": [3, 3, 3], "max_tokens": 1})
    assert status == 500 and "simulated unexpected failure" in err["error"]["message"]
    assert err["error"]["type"] == "server_error" and connection != "close"
    _ok_completion(env, conn)  # the same connection: no reset
    assert sum(1 for r in caplog.records if r.exc_info) == 1  # logged once


def test_a_client_gone_while_its_body_is_read_is_one_log_line(env, caplog):
    with caplog.at_level(logging.INFO):
        s = socket.create_connection(("127.0.0.1", env.srv.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.2)
        s.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("disconnected" in r.getMessage() for r in caplog.records):
            time.sleep(0.05)
    mine = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(mine) == 1 and not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
    _ok_completion(env, _conn(env))


# --- real processes --------------------------------------------------------------------------------

def _k3serve(*argv, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "k3serve", *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONSAFEPATH": "1", **(env or {})})


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("command,flag", [("serve", "--port"), ("worker", "--metrics-port"),
                                          ("worker", "--grpc-port"), ("operator", "--metrics-port")])
def test_a_busy_port_is_one_line_and_exit_2(busy_port, tmp_path, command, flag):
    argv = {"serve": ["serve", str(tmp_path), "--port"],
            "worker": ["worker", "--model", str(tmp_path), "--metrics-port", "0", "--grpc-port", "0", flag],
            "operator": ["operator", "run", "--metrics-host", "127.0.0.1", "--metrics-port"]}[command]
    r = _k3serve(*argv, str(busy_port))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines == [f"k3serve {command}: error: port {busy_port} on 127.0.0.1 is already in use; choose another "
                     f"with {flag} (0 picks a free one)"], r.stderr
    assert "listening" not in r.stdout and "ready" not in r.stdout


def test_an_engine_that_cannot_serve_any_more_exits_nonzero(tiny_model_dir, tmp_path):
    """Every engine step raising: the requests get 500s, then `k3serve serve` stops itself with exit 1
    (a supervisor restarts it) instead of staying up unable to serve."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from k3serve.workers.engine.llm_engine import LLMEngine\n"
        "def step(self):\n    raise RuntimeError('simulated broken engine')\n"
        "LLMEngine.step = step\n"
        "from k3serve.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.Popen([sys.executable, str(script), "serve", str(tiny_model_dir), "--port", "0",
                             "--max-model-len", "64", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONSAFEPATH": "1"})
    try:
        line = proc.stdout.readline()
        assert "listening on http://" in line, line + proc.stderr.read()
        url = line.split("listening on ")[1].split()[0]
        host, port = url.removeprefix("http://").split(":")
        statuses = []
        for _ in range(6):
            try:
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                statuses.append(_send(conn, "POST", "/v1/completions",
                                      {"model": tiny_model_dir.name, "prompt": [1, 2], "max_tokens": 1})[0])
            except (ConnectionError, OSError):
                break
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert statuses[:4] == [500] * 4 and rc == 1, (statuses, rc, err)
    assert "the engine failed" in err and "simulated broken engine" in err


def test_a_worker_whose_engine_cannot_serve_any_more_exits_nonzero(tiny_model_dir, tmp_path):
    """The same for `k3serve worker`: gRPC requests fail with INTERNAL, then the process exits 1."""
    import grpc

    from k3serve.proto import worker_pb2 as pb
    from k3serve.proto import worker_pb2_grpc as pb_grpc
    from k3serve.proto.convert import sampling_to_proto

    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from k3serve.workers.engine.llm_engine import LLMEngine\n"
        "def step(self):\n    raise RuntimeError('simulated broken engine')\n"
        "LLMEngine.step = step\n"
        "from k3serve.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.Popen([sys.executable, str(script), "worker", "--model", str(tiny_model_dir), "--grpc-port", "0",
                             "--metrics-port", "0", "--max-model-len", "64", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONSAFEPATH": "1"})
    try:
        line = ""
        while "ready grpc=" not in line:
            line = proc.stdout.readline()
            assert line, "worker did not start"
        addr = line.split("ready grpc=")[1].split()[0]
        codes = []
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.WorkerStub(channel)
            for i in range(6):
                try:
                    list(stub.Generate(pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2],
                                                          sampling_params=sampling_to_proto({"max_tokens": 1})),
                                       timeout=30))
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(e.code().name)
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        break
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert codes[:4] == ["INTERNAL"] * 4 and rc == 1, (codes, rc, out)
    assert "the engine failed" in out


def test_a_tokenizer_panic_is_a_400(env):
    """The fallback behind the whitespace bound: a native tokenizer failure (tiktoken's Rust panic, a
    BaseException) becomes a ProtocolError naming the field."""
    from k3serve.openai_api.protocol import ProtocolError
    from k3serve.openai_api.text_guards import tokenize_guarded

    with pytest.raises(ProtocolError) as ei:
        tokenize_guarded(lambda: env.tok.encode(" " * 1_000_000), "messages.0.name")
    assert ei.value.status_code == 400 and ei.value.param == "messages.0.name"
    assert "tokenizer cannot split" in ei.value.message
