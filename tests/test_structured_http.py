"""Structured outputs through the OpenAI HTTP layer with the official `openai` client: the real engine on
the random tiny model behind `build_app` (in-process uvicorn), one server for the module.

response_format / structured_outputs / strict tools / tool_choice become SamplingParams.structured_outputs
(k3serve/openai_api/protocol.py) and the mask in the engine makes the random model's output valid.
"""

import json
import re
from types import SimpleNamespace

import _serve_fakes as fakes  # tests/ is on sys.path (conftest)
import httpx
import jsonschema
import openai
import pytest
from prometheus_client import CollectorRegistry

from k3serve.workers.async_engine import AsyncEngine
from k3serve.workers.engine.api import EngineArgs
from k3serve.workers.engine.llm_engine import LLMEngine
from k3serve.workers.serving.app import build_app

MODEL = "k3-tiny"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50},
                                           "tag": {"type": "string", "enum": ["a", "b"]}},
          "required": ["n", "tag"], "additionalProperties": False}
LOOKUP = {"type": "function", "function": {"name": "lookup", "strict": True, "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 4},
                                     "k": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["q", "k"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC"]}}, "required": ["tz"]}}}
TOOLS = [LOOKUP, CLOCK]


@pytest.fixture(scope="module")
def env(tiny_model_dir):
    engine = LLMEngine(EngineArgs(model=str(tiny_model_dir), max_model_len=1024))
    aeng = AsyncEngine(engine, model_name=MODEL, idle_wait_s=0.05)
    aeng.start()
    srv = fakes.ThreadServer(build_app(aeng, served_model_names=[MODEL], registry=CollectorRegistry()))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
    close = engine.tokenizer.special_id("<|close|>")
    # A random model's free text (think channel, unconstrained response text) is long; a bias on <|close|>
    # keeps it short. Wherever the grammar does not allow <|close|>, the mask removes it anyway.
    yield SimpleNamespace(client=client, url=srv.url, bias={str(close): 7.0})
    srv.stop()
    aeng.shutdown()


def chat(env, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Hi"}])
    kw.setdefault("max_tokens", 300)
    kw.setdefault("temperature", 1.0)
    extra = dict(kw.pop("extra_body", {}))
    extra.setdefault("chat_template_kwargs", {"thinking": False})
    return env.client.chat.completions.create(model=MODEL, logit_bias=env.bias, extra_body=extra, **kw)


@pytest.mark.parametrize("thinking", [False, True])
def test_response_format_json_schema(env, thinking):
    for seed in range(2):
        r = chat(env, seed=seed, response_format={"type": "json_schema", "json_schema": {
            "name": "out", "schema": SCHEMA, "strict": True}}, extra_body={"chat_template_kwargs": {"thinking": thinking}})
        c = r.choices[0]
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert c.message.tool_calls in (None, [])


def test_structured_outputs_on_completions(env):
    for so, check in [({"choice": ["left", "right"]}, lambda t: t in ("left", "right")),
                      ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)]:
        r = env.client.completions.create(model=MODEL, prompt="Go", max_tokens=60, temperature=1.0, seed=3,
                                          extra_body={"structured_outputs": so})
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), r.choices[0].text
    r = env.client.completions.create(model=MODEL, prompt="Go", max_tokens=60, temperature=1.0, seed=4,
                                      extra_body={"response_format": {"type": "json_object"}},
                                      logit_bias={str(t): 6.0 for t in (34, 93, 125)})  # '"', ']', '}' bytes
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


def _stream(env, **kw):
    content, calls, finish = "", {}, None
    for chunk in chat(env, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["named", "required"])
def test_tool_choice_enforced_and_streams_reassemble(env, choice):
    tool_choice = {"type": "function", "function": {"name": "lookup"}} if choice == "named" else "required"
    r = chat(env, seed=11, tools=TOOLS, tool_choice=tool_choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.tool_calls
    if choice == "named":
        assert [t.function.name for t in c.message.tool_calls] == ["lookup"]
    for t in c.message.tool_calls:
        schema = {"lookup": LOOKUP, "clock": CLOCK}[t.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(t.function.arguments), schema)
    content, calls, finish = _stream(env, seed=11, tools=TOOLS, tool_choice=tool_choice)
    assert finish == "tool_calls"
    assert content == c.message.content
    assert calls == [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]


def test_tool_choice_none_with_strict_tool_never_calls(env):
    r = chat(env, seed=5, tools=TOOLS, tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}}, "nope"),
    ({"structured_outputs": {"regex": "(a"}}, "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "missing"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}}, "whitespace_pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
])
def test_bad_structured_requests_are_400(env, body, needle):
    r = httpx.post(env.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert httpx.get(env.url + "/health").status_code == 200


def test_worker_grpc_passes_structured_outputs(tiny_model_dir):
    """worker.proto carries the constraint: the gRPC worker enforces it and rejects a bad one with
    INVALID_ARGUMENT (the router turns that into a 400)."""
    import grpc
    from test_worker_grpc import Loop, Worker, req  # the gRPC harness of tests/test_worker_grpc.py

    loop = Loop()
    w = Worker(loop, LLMEngine(EngineArgs(model=str(tiny_model_dir), max_model_len=256)))
    try:
        resps = w.generate(req("s1", [5, 6], max_tokens=20, temperature=1.0, seed=2,
                               structured_outputs={"regex": "[0-9]{2}-[a-z]{2}"}), timeout=120)
        text = "".join(o.text for r in resps for o in r.outputs)
        finish = [o.finish_reason for r in resps for o in r.outputs if o.HasField("finish_reason")]
        assert finish == ["stop"] and re.fullmatch("[0-9]{2}-[a-z]{2}", text), text
        with pytest.raises(grpc.aio.AioRpcError) as e:
            w.generate(req("s2", [5], max_tokens=4, structured_outputs={"grammar": "root ::= nowhere"}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nowhere" in e.value.details()
    finally:
        w.close()
        loop.close()
