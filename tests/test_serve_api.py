"""The OpenAI HTTP layer (workers/serving) with the official `openai` client, over a scripted fake engine.

The fake engine (tests/_serve_fakes.py) follows the LLMEngine contract and can emit any K3 output text,
so the response side (reasoning_content, tool calls, finish reasons, logprobs, usage) is checked
exactly; the real-model end-to-end tests are in test_serve_e2e.py.
"""

import itertools
import json
import time
from types import SimpleNamespace

import _serve_fakes as fakes  # tests/ is on sys.path (conftest)
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from k3serve.workers.async_engine import AsyncEngine
from k3serve.workers.metrics import EngineMetrics
from k3serve.workers.serving.app import build_app

C, O, S, END, el = fakes.C, fakes.O, fakes.S, fakes.END, fakes.el

MODEL = "k3-test"
MAX_LEN = 2048
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def _serve(engine, api_key=None):
    registry = CollectorRegistry()
    aeng = AsyncEngine(engine, model_name=MODEL, metrics=EngineMetrics(registry, MODEL), idle_wait_s=0.05)
    aeng.start()
    srv = fakes.ThreadServer(build_app(aeng, served_model_names=[MODEL], registry=registry, api_key=api_key))
    return aeng, srv


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tok = fakes.make_tokenizer(tmp_path_factory.mktemp("tok"))
    engine = fakes.FakeEngine(tok, max_model_len=MAX_LEN)
    aeng, srv = _serve(engine)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
    yield SimpleNamespace(tok=tok, engine=engine, aeng=aeng, srv=srv, client=client)
    srv.stop()
    aeng.shutdown()


def script_text(env, text):
    ids = fakes.encode_marked(env.tok, text)
    env.engine.script = lambda prompt, params, i: list(ids)
    return ids


def last_added(env):
    return env.engine.added[-1]


def user(text="Hi"):
    return [{"role": "user", "content": text}]


# --------------------------------------------------------------------------------------- chat

def test_models_and_health(env):
    assert [m.id for m in env.client.models.list().data] == [MODEL]
    assert httpx.get(env.srv.url + "/health").status_code == 200


def test_chat_reasoning_content_usage(env):
    ids = script_text(env, f"Let me think.{C}think{S}{O}response{S}Hi there!{C}response{S}{END}")
    r = env.client.chat.completions.create(model=MODEL, messages=user())
    msg = r.choices[0].message
    assert msg.content == "Hi there!"
    assert msg.reasoning_content == "Let me think."
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "chat.completion" and r.model == MODEL
    rid, prompt, params, _ = last_added(env)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == len(prompt) + len(ids)
    assert params.skip_special_tokens is False
    # thinking is on by default: the prompt ends with the think opener
    assert env.tok.decode(prompt).endswith(f"{O}think{S}")


def test_chat_stream_include_usage(env):
    ids = script_text(env, f"Hmm.{C}think{S}{O}response{S}Streaming works.{C}response{S}{END}")
    chunks = list(env.client.chat.completions.create(model=MODEL, messages=user(), stream=True,
                                                     stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in body)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in body)
    assert (reasoning, content) == ("Hmm.", "Streaming works.")
    assert body[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in body)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == len(last_added(env)[1])
    assert len({c.id for c in chunks}) == 1


def test_stream_continuous_usage_stats(env):
    env.engine.script = lambda prompt, params, i: env.tok.encode(" a b c")
    chunks = list(env.client.completions.create(
        model=MODEL, prompt="x", max_tokens=16, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == len(env.tok.encode(" a b c")) + 1
    assert chunks[-1].usage.completion_tokens == counts[-1]


def test_chat_stream_without_usage_has_no_usage_chunk(env):
    script_text(env, f"{C}think{S}{O}response{S}ok{C}response{S}{END}")
    chunks = list(env.client.chat.completions.create(model=MODEL, messages=user(), stream=True))
    assert all(c.choices for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "ok"


def test_chat_tool_calls_parsed(env):
    call = fakes.tool_call_text("get_weather", {"city": "Paris", "days": 3})
    script_text(env, f"I should call.{C}think{S}{O}response{S}{C}response{S}{el('tools', call)}{END}")
    r = env.client.chat.completions.create(model=MODEL, messages=user("Weather in Paris?"), tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris", "days": 3}
    assert tc.id
    chunks = list(env.client.chat.completions.create(model=MODEL, messages=user("Weather?"), tools=[WEATHER],
                                                     stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "get_weather", {"city": "Paris", "days": 3})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice="none": the same text is not parsed into calls
    r = env.client.chat.completions.create(model=MODEL, messages=user(), tools=[WEATHER], tool_choice="none")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"


def test_chat_tools_rendered_into_prompt(env):
    script_text(env, f"{C}think{S}{O}response{S}x{C}response{S}{END}")
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    env.client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="required",
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    text = env.tok.decode(last_added(env)[1])
    assert "get_weather" in text and '"city"' in text and "Weather forecast for a city." in text
    assert "tool_choice=required" in text
    assert "Sunny, 21 C" in text and "Oslo" in text
    assert text.endswith(f"{O}response{S}")  # thinking off


def test_chat_sampling_fields_reach_engine(env):
    script_text(env, f"{C}think{S}{O}response{S}ab{C}response{S}{END}")
    r = env.client.chat.completions.create(
        model=MODEL, messages=user(), temperature=0.5, top_p=0.9, seed=7, n=2, stop=["zz"],
        max_completion_tokens=80, presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"5": 3.0},
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1, "cache_salt": "s1",
                    "ignore_eos": False})
    _, _, p, salt = last_added(env)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.n) == (0.5, 0.9, 5, 0.1, 7, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.stop == ["zz"] and p.max_tokens == 80 and p.min_tokens == 1 and p.logit_bias == {5: 3.0}
    assert salt == "s1"
    assert [c.index for c in r.choices] == [0, 1] and all(c.message.content == "ab" for c in r.choices)


def test_chat_default_max_tokens_fills_context(env):
    script_text(env, f"{C}think{S}{O}response{S}x{C}response{S}{END}")
    env.client.chat.completions.create(model=MODEL, messages=user())
    _, prompt, p, _ = last_added(env)
    assert p.max_tokens == MAX_LEN - len(prompt)


def test_chat_logprobs(env):
    ids = script_text(env, f"{C}think{S}{O}response{S}Hello{C}response{S}{END}")
    r = env.client.chat.completions.create(model=MODEL, messages=user(), logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids)
    assert content[0].logprob == -0.25 and len(content[0].top_logprobs) == 2
    assert content[0].top_logprobs[0].token == content[0].token
    assert "".join(c.token for c in content).startswith(f"{C}think")
    assert last_added(env)[2].logprobs == 2


# ---------------------------------------------------------------------------------- completions

def test_completions_text_ids_batch(env):
    env.engine.script = lambda prompt, params, i: env.tok.encode(f" answer{i}")
    r = env.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10)
    assert r.choices[0].text == " answer0" and r.choices[0].finish_reason == "stop"
    assert last_added(env)[1] == env.tok.encode("Once upon a time")
    assert r.usage.prompt_tokens == len(env.tok.encode("Once upon a time"))
    assert r.usage.completion_tokens == len(env.tok.encode(" answer0")) + 1  # + EOS
    r = env.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5)
    assert last_added(env)[1] == [5, 6, 7]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = env.client.completions.create(model=MODEL, prompt=["a b", "c"], n=2, max_tokens=16)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [" answer0", " answer1"] * 2
    assert r.usage.prompt_tokens == len(env.tok.encode("a b")) + len(env.tok.encode("c"))
    r = env.client.completions.create(model=MODEL, prompt=[[9, 10], [11]], max_tokens=16)
    assert [c.text for c in r.choices] == [" answer0"] * 2 and r.usage.prompt_tokens == 3


def test_completions_echo_stop_and_logprobs(env):
    env.engine.script = lambda prompt, params, i: env.tok.encode(" one two three")
    r = env.client.completions.create(model=MODEL, prompt="Count:", echo=True, max_tokens=16)
    assert r.choices[0].text == "Count: one two three"
    r = env.client.completions.create(model=MODEL, prompt="Count:", stop=[" two"], max_tokens=16)
    assert r.choices[0].text == " one" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("stop_reason") == " two"
    r = env.client.completions.create(model=MODEL, prompt="Count:", logprobs=2, max_tokens=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.token_logprobs == [-0.25] * 3
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0


def test_completions_stream(env):
    env.engine.script = lambda prompt, params, i: env.tok.encode(" streamed text")
    chunks = list(env.client.completions.create(model=MODEL, prompt="x", max_tokens=16, stream=True,
                                                stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " streamed text"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(env.tok.encode(" streamed text")) + 1


# ------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature="hot"), "temperature"),
    (dict(messages="hello"), "messages"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "role"),
    (dict(n=0), "n"),
    (dict(top_p=0.0), "top_p"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "properties": {"a": 3}}}}]),
     "parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "name"),
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}, tools=[WEATHER]), "tool_choice"),
    (dict(reasoning_effort="extreme"), "reasoning_effort"),
    (dict(messages=[{"role": "user", "content": "word " * 3000}]), "maximum context length"),
    (dict(max_tokens=MAX_LEN - 5), "maximum context length"),
    (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(logit_bias={"999999": 1.0}), "vocabulary"),
    (dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids"),
])
def test_chat_bad_requests_400(env, kwargs, needle):
    before = len(env.engine.added)
    args = dict(model=MODEL, messages=user())
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as ei:
        env.client.chat.completions.create(**args)
    err = ei.value
    assert err.status_code == 400
    assert needle in err.body["message"] and err.body["type"] == "invalid_request_error"
    assert len(env.engine.added) == before  # rejected before the engine


@pytest.mark.parametrize("kwargs, needle", [
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[1, "a"]), "prompt"),
    (dict(prompt=[10 ** 9]), "vocabulary"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", logprobs=99), "logprobs"),
    (dict(prompt="hi", suffix="x"), "suffix"),
])
def test_completion_bad_requests_400(env, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as ei:
        env.client.completions.create(model=MODEL, **kwargs)
    assert needle in ei.value.body["message"]


def test_bad_json_and_unknown_model(env):
    r = httpx.post(env.srv.url + "/v1/chat/completions", content=b'{"model": "k3-test", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(env.srv.url + "/v1/completions", content=b'[1, 2]')
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as ei:
        env.client.chat.completions.create(model="gpt-4", messages=user())
    assert ei.value.status_code == 404 and "gpt-4" in ei.value.body["message"]
    assert ei.value.body["code"] == "model_not_found"
    r = httpx.get(env.srv.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


# ------------------------------------------------------------------------------ disconnects

def _wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_client_disconnect_aborts_stream_and_nonstream(env):
    env.engine.script = lambda prompt, params, i: itertools.cycle(env.tok.encode(" la"))
    env.engine.step_delay = 0.02
    try:
        body = {"model": MODEL, "prompt": "sing", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", env.srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert got
        rid = last_added(env)[0]
        assert _wait_for(lambda: rid in env.engine.aborted), "streaming request was not aborted"
        body = {"model": MODEL, "prompt": "sing again", "max_tokens": 200}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(env.srv.url + "/v1/completions", json=body, timeout=0.5)
        rid2 = last_added(env)[0]
        assert rid2 != rid
        assert _wait_for(lambda: rid2 in env.engine.aborted), "non-streaming request was not aborted"
        assert _wait_for(lambda: env.aeng.num_in_flight() == 0)
    finally:
        env.engine.step_delay = 0.0


# ---------------------------------------------------------------------------------- metrics

def test_metrics_endpoint(env):
    env.engine.script = lambda prompt, params, i: env.tok.encode(" m")
    env.client.completions.create(model=MODEL, prompt="metrics please", max_tokens=4)
    text = httpx.get(env.srv.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "k3serve_kda_state_slots_total", "k3serve_kda_state_slots_used"):
        assert name + "{" in text or name + " " in text, name

    def value(prefix):
        line = next(x for x in text.splitlines() if x.startswith(prefix))
        return float(line.rsplit(" ", 1)[1])

    assert value(f'vllm:prompt_tokens_total{{model_name="{MODEL}"}}') > 0
    assert value(f'k3serve_kda_state_slots_total{{model_name="{MODEL}"}}') == 50
    assert value(f'vllm:request_success_total{{finished_reason="stop",model_name="{MODEL}"}}') >= 1


# ---------------------------------------------------------------------------- auth and failure

def test_api_key(tmp_path, env):
    engine = fakes.FakeEngine(env.tok, max_model_len=64)
    aeng, srv = _serve(engine, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError) as ei:
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert ei.value.status_code == 401 and "API key" in ei.value.body["message"]
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in ok.models.list().data] == [MODEL]
        assert httpx.get(srv.url + "/health").status_code == 200  # not under /v1
    finally:
        srv.stop()
        aeng.shutdown()


def test_engine_failure_is_loud(env):
    engine = fakes.FakeEngine(env.tok, max_model_len=64, fail_on_step=2)
    aeng, srv = _serve(engine)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=20)
        for i in range(4):  # three failed steps are contained (the request fails alone), the fourth is fatal
            with pytest.raises(openai.InternalServerError) as ei:
                client.completions.create(model=MODEL, prompt="boom", max_tokens=10)
            assert "simulated engine failure" in ei.value.body["message"]
            assert httpx.get(srv.url + "/health").status_code == (200 if i < 3 else 503)
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and "simulated engine failure" in h.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError):  # later requests fail at once, no hang
            client.completions.create(model=MODEL, prompt="again", max_tokens=10)
    finally:
        srv.stop()
        aeng.shutdown()


def test_engine_failure_mid_stream_sends_error_event(env):
    engine = fakes.FakeEngine(env.tok, max_model_len=64, fail_on_step=3,
                              script=lambda p, params, i: itertools.cycle(env.tok.encode("x")))
    aeng, srv = _serve(engine)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=20)
        got = []
        with pytest.raises(openai.APIError) as ei:
            for chunk in client.completions.create(model=MODEL, prompt="boom", max_tokens=10, stream=True):
                got.append(chunk.choices[0].text)
        assert got == ["x", "x"] and "simulated engine failure" in ei.value.message
    finally:
        srv.stop()
        aeng.shutdown()
