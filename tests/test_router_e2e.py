"""`k3serve up` with 2 colocated workers and the router, driven by the official `openai` client.

One platform for the whole module (float64, tiny max_tokens). Greedy outputs through the gateway equal the
offline engine's; chat / stream / completions / tools / usage / n > 1 / logprobs; bad requests give
400/401/404 with messages; the router's predicted reusable prefix equals the cached tokens the worker
reports; the prefix index equals a fresh snapshot of each worker's cache; a client disconnect aborts the
work on the worker; killing the worker that serves a stream mid-way still completes the stream with the
same tokens, and the killed worker is ejected, then reinstated when it comes back.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from _up import running_up

MAX_LEN = 1024
PREFIX = "You are a helpful assistant. " * 20  # long shared prefix: several 240-token blocks


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def platform(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-logs")
    with running_up(tiny_model_dir, logs, "--workers", "2", max_model_len=MAX_LEN) as up:
        yield dict(up, model_dir=tiny_model_dir)


@pytest.fixture(scope="module")
def client(platform):
    return openai.OpenAI(base_url=platform["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    import torch

    from k3serve.workers.llm import LLM

    torch.set_num_threads(1)
    return LLM(str(tiny_model_dir), dtype="float64", max_model_len=MAX_LEN)


def _workers(url):
    return httpx.get(url + "/router/workers", timeout=10).json()["workers"]


def _synced(url):
    """Every worker's index has applied everything the worker published (GetLoad's kv_event_sequence)."""
    import grpc

    from k3serve.proto import worker_pb2 as pb
    from k3serve.proto import worker_pb2_grpc as pb_grpc

    for w in _workers(url):
        if not w["healthy"]:
            continue
        with grpc.insecure_channel(w["address"]) as ch:
            seq = pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=10).kv_event_sequence
        if not w["index_ready"] or w["index_sequence"] != seq:
            return False
    return True


def test_up_printed_url_and_curl_after_ready(platform):
    out = "".join(platform["lines"])
    assert "✓ worker-0" in out and "✓ worker-1" in out and "✓ router" in out
    assert out.index("✓ router") < out.index("API is at")
    assert len(platform["state"]["workers"]) == 2


def test_models_and_errors(platform, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert "does not exist" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x" * 6000, max_tokens=1)
    assert "context length" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       tools=[{"type": "function", "function": {"name": "bad name!"}}])
    r = httpx.post(platform["url"] + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"x-request-id": "my-req-1", "content-type": "application/json"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "my-req-1" and "JSON" in r.json()["error"]["message"]
    assert httpx.get(platform["url"] + "/v1/nothing", timeout=10).status_code == 404
    assert httpx.get(platform["url"] + "/health", timeout=10).json()["workers"]["both"] == 2


def test_greedy_chat_and_completions_equal_offline_engine(client, offline):
    from k3serve.chat.parsers import parse_output
    from k3serve.chat.renderer import render_chat
    from k3serve.sampling_params import SamplingParams

    msgs = [{"role": "user", "content": "Tell me about caches."}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    rendered = render_chat(offline.engine.tokenizer, msgs)
    ref = offline.generate(rendered.token_ids, SamplingParams(temperature=0, max_tokens=6,
                                                              skip_special_tokens=False))[0].outputs[0]
    parsed = parse_output(ref.text, thinking=rendered.thinking, tools_enabled=False)
    assert r.choices[0].message.content == (parsed.content or None)
    assert getattr(r.choices[0].message, "reasoning_content", None) == (parsed.reasoning or None)
    assert r.usage.completion_tokens == len(ref.token_ids) and r.usage.prompt_tokens == len(rendered.token_ids)
    for prompt in ("The quick brown fox", [5, 17, 42, 99, 7]):
        c = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0)
        ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=7))[0].outputs[0]
        assert c.choices[0].text == ref.text and c.usage.completion_tokens == len(ref.token_ids)


def test_stream_usage_n_logprobs_tools(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            temperature=0, n=2, stream=True, stream_options={"include_usage": True},
                                            logprobs=True, top_logprobs=2)
    texts, usage, lps = {0: "", 1: ""}, None, {0: 0, 1: 0}
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            texts[ch.index] += (d.content or "") + (getattr(d, "reasoning_content", None) or "")
            if ch.logprobs and ch.logprobs.content:
                lps[ch.index] += len(ch.logprobs.content)
                assert all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    assert texts[0] == texts[1] and usage.completion_tokens == 10 and lps == {0: 5, 1: 5}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                       tools=tools, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    c = client.completions.create(model="tiny", prompt=["a b", "c d"], max_tokens=3, n=2, temperature=0,
                                  logprobs=1)
    assert len(c.choices) == 4 and c.usage.completion_tokens == 12
    assert all(len(ch.logprobs.tokens) == 3 for ch in c.choices)


def test_predicted_hit_equals_worker_cached_tokens(platform):
    url = platform["url"]
    seen = []
    for i, tail in enumerate(["first question", "second question", "first question again", "x" * 30, "y"]):
        _wait(lambda: _synced(url), 30, "the prefix index to catch up")
        body = {"model": "tiny", "messages": [{"role": "system", "content": PREFIX},
                                              {"role": "user", "content": tail}], "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        predicted = int(r.headers["x-k3serve-predicted-cached-tokens"])
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert predicted == cached, (i, predicted, cached)
        seen.append((r.headers["x-k3serve-worker"], cached))
    assert sum(c > 0 for _, c in seen) >= 3  # the shared prefix was reused, on the worker that had it


def _fresh_snapshot_size(address) -> int:
    """Keys in a new subscriber's snapshot of the worker's cache (= what the cache holds now)."""
    import grpc

    from k3serve.kv_events.index import KvEventIndex
    from k3serve.proto import worker_pb2 as pb
    from k3serve.proto import worker_pb2_grpc as pb_grpc

    fresh = KvEventIndex()
    with grpc.insecure_channel(address) as ch:
        call = pb_grpc.WorkerStub(ch).SubscribeKvEvents(pb.KvEventsRequest(), timeout=30)
        for msg in call:
            fresh.apply(msg)
            if fresh.snapshot_complete:
                call.cancel()
                break
    return len(fresh.entries)


def test_index_equals_fresh_snapshot_of_each_worker(platform):
    url = platform["url"]
    _wait(lambda: _synced(url), 30, "the prefix index to catch up")
    total = 0
    for w in _workers(url):
        n = _fresh_snapshot_size(w["address"])
        assert w["index_keys"] == n, w
        total += n
    assert total > 0


def test_client_disconnect_aborts_on_worker(platform):
    url = platform["url"]
    body = {"model": "tiny", "prompt": "count", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    _wait(lambda: all(w["inflight"] == 0 for w in _workers(url)), 5, "the router to cancel the worker call")
    _wait(lambda: all(w["load"].get("running", 0) == 0 for w in _workers(url)), 10, "the worker to abort it")


def test_api_key_router_on_the_same_workers(platform, tmp_path):
    key = tmp_path / "api-key"
    key.write_text("s3cret-key\n")
    addrs = ",".join(w["grpc"] for w in platform["state"]["workers"])
    proc = subprocess.Popen([sys.executable, "-m", "k3serve.cli", "router", "--model", str(platform["model_dir"]),
                             "--workers", addrs, "--port", "0", "--metrics-port", "0", "--api-key-file", str(key),
                             "--served-model-name", "tiny", "--request-timeout", "6"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONSAFEPATH="1"))
    try:
        line = ""
        for line in proc.stdout:
            if "listening on" in line:
                break
        url = re.search(r"listening on (http://\S+)", line).group(1)
        _wait(lambda: httpx.get(url + "/health", timeout=5).json()["workers"]["both"] == 2, 30, "workers")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "s3cret" not in r.text
        ok = openai.OpenAI(base_url=url + "/v1", api_key="s3cret-key", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1
        assert httpx.get(url + "/health", timeout=5).status_code == 200  # probes need no key
        r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer s3cret-key"}, timeout=60,
                       json={"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"  # --request-timeout 6
        _wait(lambda: all(w["inflight"] == 0 for w in _workers(url)), 10, "the timed-out call to be cancelled")
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM drains and exits cleanly


def test_bench_random_and_agentic_json(platform, tmp_path):
    out = tmp_path / "bench.json"
    for extra in (["--dataset", "random", "--num-prompts", "4", "--random-input-len", "40", "--random-output-len", "3",
                   "--max-concurrency", "1,2"],
                  ["--dataset", "agentic", "--sessions", "2", "--turns", "2", "--shared-prefix-len", "40", "--task-len", "8", "--turn-len", "4",
                   "--output-len", "2", "--max-concurrency", "2"]):
        r = subprocess.run([sys.executable, "-m", "k3serve.cli", "bench", "--base-url", platform["url"],
                            "--result-file", str(out), "--no-progress", *extra], capture_output=True, text=True,
                           timeout=180, env=dict(os.environ, PYTHONSAFEPATH="1"))
        assert r.returncode == 0, r.stdout + r.stderr
        runs = json.loads(out.read_text())["runs"]
        for run in runs:
            assert run["failed"] == 0 and run["completed"] > 0
            assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
        assert "TTFT" in r.stdout and "p99" in r.stdout
    assert runs[0]["cached_prompt_tokens"] > 0  # agentic turns share the system prompt and the history


def test_kill_worker_mid_stream_completes_and_reinstates(platform, client, offline):
    from k3serve.sampling_params import SamplingParams

    url, state = platform["url"], platform["state"]
    prompt = "resume me"
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))[0].outputs[0]
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=120, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    text, killed, n_chunks = "", None, 0
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.text
        n_chunks += 1
        if killed is None and n_chunks == 10:
            busy = [w for w in _workers(url) if w["inflight"]]
            assert len(busy) == 1
            killed = next(w for w in state["workers"] if w["grpc"] == busy[0]["address"])
            os.kill(killed["pid"], signal.SIGKILL)
    assert killed is not None
    assert text == ref.text  # nothing repeated, nothing dropped
    m = httpx.get(url + "/metrics", timeout=10).text
    assert re.search(r'^k3serve_router_resumptions_total\{model_name="tiny"\} 1\.0$', m, re.M)
    _wait(lambda: any(w["address"] == killed["grpc"] and not w["healthy"] for w in _workers(url)), 10, "ejection")
    # bring it back on the same address: the router reinstates it and re-subscribes to its KV events
    cmd = [c if c != "0" or cmd_prev != "--grpc-port" else killed["grpc"].rsplit(":", 1)[1]
           for cmd_prev, c in zip([None, *killed["cmd"]], killed["cmd"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    try:
        _wait(lambda: any(w["address"] == killed["grpc"] and w["healthy"] and w["index_ready"]
                          for w in _workers(url)), 120, "reinstatement")
        for i in range(2):  # reach the restarted worker too; its index is rebuilt from its new instance
            r = client.completions.create(model="tiny", prompt=[7 + i] * 300 + [i], max_tokens=5, temperature=0)
            assert r.usage.completion_tokens == 5
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
        assert r.choices[0].text == offline.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
        _wait(lambda: _synced(url), 30, "the prefix index to catch up after the reconnect")
        back = next(w for w in _workers(url) if w["address"] == killed["grpc"])
        assert back["resubscribes"] >= 1 and back["index_keys"] == _fresh_snapshot_size(killed["grpc"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
