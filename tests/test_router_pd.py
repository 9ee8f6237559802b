"""`k3serve up --prefill 2 --decode 2`: the router's P/D orchestration over real NIXL workers, driven by the
official `openai` client. Greedy outputs (float64) equal the offline engine's; requests go prefill -> decode
with a real transfer (the decode workers' `k3serve_kv_transfers_total{outcome="pulled"}` grows); a decode
worker killed mid-stream -> the stream completes with the same tokens on the other decode worker; a prefill
worker killed -> new requests still succeed (the other prefill worker, or the decode worker computes).
"""

import os
import re
import signal
import time

import httpx
import openai
import pytest
from _up import running_up

MAX_LEN = 1024


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
    from k3serve.up import pd_roles_available

    if not pd_roles_available():
        pytest.skip("this version's workers have no prefill/decode roles")
    logs = tmp_path_factory.mktemp("up-pd")
    with running_up(tiny_model_dir, logs, "--prefill", "2", "--decode", "2", max_model_len=MAX_LEN,
                    start_timeout=300, stop_timeout=60, check_exit=False) as up:
        yield up


@pytest.fixture(scope="module")
def client(platform):
    return openai.OpenAI(base_url=platform["url"] + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    import torch

    from k3serve.workers.llm import LLM

    torch.set_num_threads(1)
    return LLM(str(tiny_model_dir), dtype="float64", max_model_len=MAX_LEN)


def _pulled(platform) -> float:
    total = 0.0
    for w in platform["state"]["workers"]:
        if w["role"] != "decode":
            continue
        log = open(w["log"]).read()
        murl = re.search(r"metrics=(http://\S+)", log).group(1)
        try:
            text = httpx.get(murl + "/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for m in re.finditer(r'^k3serve_kv_transfers_total\{[^}]*outcome="pulled"[^}]*\} (\S+)$', text, re.M):
            total += float(m.group(1))
    return total


PROMPT = "The router sends the prompt to a prefill worker first. " * 6  # well over the P/D threshold


def test_pd_greedy_equals_offline_and_pulls(platform, client, offline):
    from k3serve.sampling_params import SamplingParams

    before = _pulled(platform)
    r = httpx.post(platform["url"] + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers.get("x-k3serve-prefill-worker") and r.headers["x-k3serve-worker"]
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert r.json()["choices"][0]["text"] == ref.text
    _wait(lambda: _pulled(platform) > before, 10, "a pulled transfer in the decode workers' metrics")
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 4
    short = client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)  # skips prefill
    assert short.choices[0].text == offline.generate("hi", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].text


def test_kill_decode_mid_stream_then_prefill(platform, client, offline):
    from k3serve.sampling_params import SamplingParams

    url, state = platform["url"], platform["state"]
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))[0].outputs[0]
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=80, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    text, n, killed = "", 0, None
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.text
        n += 1
        if n == 8 and killed is None:
            busy = [w for w in httpx.get(url + "/router/workers").json()["workers"]
                    if w["inflight"] and w["role"] == "decode"]
            assert len(busy) == 1
            killed = next(w for w in state["workers"] if w["grpc"] == busy[0]["address"])
            os.kill(killed["pid"], signal.SIGKILL)
    assert killed is not None and text == ref.text
    prefill = next(w for w in state["workers"] if w["role"] == "prefill")
    os.kill(prefill["pid"], signal.SIGKILL)
    for i in range(3):  # new requests keep succeeding with one prefill and one decode worker gone
        prompt = PROMPT + f" variant {i}"
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
        assert r.choices[0].text == offline.generate(prompt, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
