"""`k3serve serve` end to end: the real engine on the generated tiny checkpoint, a real subprocess, and
the official `openai` client. With random weights the text is noise, so chat answers are checked for what
is deterministic: the prompt equals the renderer's, and the answer equals the K3 parser applied to the raw
greedy output of the same prompt."""

import re
import time

import httpx
import openai
import pytest

from k3serve.chat.renderer import render_chat
from k3serve.tokenizer import K3Tokenizer
from tests._serve_proc import serve_process

NAME = "k3-tiny"
MAX_LEN = 1024
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_process(tiny_model_dir, "--served-model-name", NAME, "--max-model-len", str(MAX_LEN), "--num-threads",
                       "1", "--log-level", "warning", "--enable-prefix-caching") as (url, client):
        yield url, client


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return K3Tokenizer.from_dir(str(tiny_model_dir))


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def test_models_health_metrics(server):
    url, client = server
    (card,) = client.models.list().data
    assert card.id == NAME and card.model_extra["max_model_len"] == MAX_LEN
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    text = httpx.get(url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "k3serve_kda_state_slots_used", "k3serve_kda_state_slots_total"):
        assert f"# TYPE {name} " in text, name
    total = re.search(r'^k3serve_kda_state_slots_total\{model_name="k3-tiny"\} (\S+)$', text, re.M)
    assert total and float(total.group(1)) > 0


def test_chat_greedy_stream_equals_nonstream(server, tok):
    _, client = server
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert r.usage.prompt_tokens == len(render_chat(tok, MSGS).token_ids)
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    assert body[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in body)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in body)
    assert (reasoning or None, content or None) == (choice.message.reasoning_content, choice.message.content)
    assert body[-1].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


TOOL_HISTORY = MSGS + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
CHAT_CASES = {  # name -> (messages, request fields beyond model/messages, render_chat keyword arguments)
    "tools-auto-no-thinking": (MSGS, dict(tools=[WEATHER], tool_choice="auto",
                                          extra_body={"chat_template_kwargs": {"thinking": False}}),
                               dict(tools=[WEATHER], tool_choice="auto", thinking=False)),
    "thinking": (MSGS, {}, {}),
    "tools-after-a-tool-result": (TOOL_HISTORY, dict(tools=[WEATHER], tool_choice="auto"),
                                  dict(tools=[WEATHER], tool_choice="auto")),
}  # (a named tool_choice constrains decoding, so its answer is not the free greedy output)


@pytest.mark.parametrize("case", CHAT_CASES)
def test_chat_response_is_the_parse_of_the_raw_output(server, tok, case):
    """What is deterministic with random weights: the prompt is exactly the renderer's, and the answer
    (content, reasoning_content, tool calls, finish_reason) is exactly the K3 parser applied to the raw
    greedy output, fetched separately from /v1/completions on the rendered ids (another cache salt, so
    neither request reuses the other's cache)."""
    from k3serve.chat import parse_output

    _, client = server
    messages, fields, render_kw = CHAT_CASES[case]
    rendered = render_chat(tok, messages, **render_kw)
    extra = fields.get("extra_body", {})
    args = {k: v for k, v in fields.items() if k != "extra_body"}
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, **args,
                                       extra_body={**extra, "cache_salt": f"chat-{case}"})
    assert r.usage.prompt_tokens == len(rendered.token_ids)
    raw = client.completions.create(model=NAME, prompt=rendered.token_ids, max_tokens=6, temperature=0,
                                    extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False,
                                                "cache_salt": f"raw-{case}"})
    assert raw.usage.completion_tokens == r.usage.completion_tokens
    want = parse_output(raw.choices[0].text, thinking=rendered.thinking, tools_enabled="tools" in fields,
                        tool_choice=render_kw.get("tool_choice"))
    msg = r.choices[0].message
    assert (msg.content, getattr(msg, "reasoning_content", None)) == (want.content, want.reasoning)
    assert [(tc.function.name, tc.function.arguments) for tc in msg.tool_calls or []] == \
        [(tc.name, tc.arguments) for tc in want.tool_calls]
    finish = raw.choices[0].finish_reason
    assert r.choices[0].finish_reason == ("tool_calls" if want.tool_calls and finish == "stop" else finish)
    assert finish == ("length" if raw.usage.completion_tokens == 6 else "stop")
    if render_kw.get("thinking") is False:  # thinking off: nothing can be reasoning
        assert not rendered.thinking and getattr(msg, "reasoning_content", None) is None
    if "tools" in fields:  # the tool definitions are in the prompt
        assert len(rendered.token_ids) > len(render_chat(tok, messages, thinking=render_kw.get("thinking")).token_ids)


def test_completions_text_ids_and_stream(server, tok):
    _, client = server
    prompt = "The cache keeps"
    a = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    b = client.completions.create(model=NAME, prompt=tok.encode(prompt), max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
    assert a.usage.prompt_tokens == len(tok.encode(prompt))
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == a.choices[0].text
    batch = client.completions.create(model=NAME, prompt=[prompt, "Another one"], n=2, max_tokens=4, seed=3)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert 4 <= batch.usage.completion_tokens <= 16
    assert all(c.finish_reason in ("stop", "length") for c in batch.choices)
    assert batch.usage.prompt_tokens == len(tok.encode(prompt)) + len(tok.encode("Another one"))
    lp = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == lp.usage.completion_tokens
    assert all(v <= 0 for v in lp.choices[0].logprobs.token_logprobs)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=-5), "max_tokens"),
    (dict(temperature=[1]), "temperature"),
    (dict(messages=[{"role": "user", "content": "tok " * 2000}]), "maximum context length"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "required": "city"}}}]),
     "required"),
    (dict(tool_choice="sometimes"), "tool_choice"),
])
def test_bad_requests(server, kwargs, needle):
    _, client = server
    args = dict(model=NAME, messages=MSGS, max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(**args)
    assert ei.value.status_code == 400 and needle in ei.value.body["message"]


def test_bad_json_and_unknown_model(server):
    url, client = server
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="nope", prompt="x")
    assert "nope" in ei.value.body["message"]


def test_prefix_cache_hits_reported(server):
    url, client = server
    prompt = list(range(20, 330))  # longer than one cache block (240 tokens for the tiny model)
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.choices[0].text == second.choices[0].text
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens % 240 == 0

    def metric(name, labels='model_name="k3-tiny"'):
        m = re.search(rf'^{re.escape(name)}\{{{labels}\}} (\S+)$', httpx.get(url + "/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    deadline = time.monotonic() + 5  # counters follow the engine's stats refreshes
    while metric("vllm:prefix_cache_hits_total") < 240 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric("vllm:prefix_cache_hits_total") >= 240
    assert metric("vllm:prefix_cache_queries_total") >= 2 * len(prompt)
    assert metric("k3serve_prefix_cache_group_hits_tokens_total", 'group="kda",model_name="k3-tiny"') >= 240


def test_client_disconnect_aborts(server):
    url, _ = server

    def aborted() -> float:
        m = re.search(r'^vllm:request_success_total\{finished_reason="abort",model_name="k3-tiny"\} (\S+)$',
                      httpx.get(url + "/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    before = aborted()
    body = {"model": NAME, "prompt": "Go on and on", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data:")
            if n >= 3:
                break
    deadline = time.monotonic() + 20
    while aborted() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1

    def running() -> float:
        m = re.search(r'^vllm:num_requests_running\{model_name="k3-tiny"\} (\S+)$',
                      httpx.get(url + "/metrics").text, re.M)
        return float(m.group(1))

    deadline = time.monotonic() + 5  # the gauge follows the engine's next stats refresh
    while running() != 0.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 0.0
