"""k3serve.openai_api.protocol: request validation, sampling mapping, context check, responses, SSE."""

import json

import pytest

from k3serve.openai_api import protocol as P
from k3serve.sampling_params import SamplingParams


def chat(**kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return P.parse_request(P.ChatCompletionRequest, json.dumps(body))


def bad_chat(raw_or_kw) -> P.ProtocolError:
    with pytest.raises(P.ProtocolError) as ei:
        if isinstance(raw_or_kw, bytes | str):
            P.parse_request(P.ChatCompletionRequest, raw_or_kw)
        else:
            chat(**raw_or_kw)
    assert ei.value.status_code == 400
    return ei.value


def test_chat_request_full_mapping():
    req = chat(temperature=0.3, top_p=0.8, top_k=7, min_p=0.05, seed=11, n=3, presence_penalty=0.1,
               frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={"12": -5}, stop="END",
               stop_token_ids=[4], max_completion_tokens=9, min_tokens=2, ignore_eos=True, logprobs=True,
               top_logprobs=3, cache_salt="salt", include_stop_str_in_output=True)
    kw = P.sampling_kwargs(req, max_tokens=9, chat=True)
    assert kw == dict(n=3, max_tokens=9, min_tokens=2, stop=["END"], stop_token_ids=[4], ignore_eos=True,
                      include_stop_str_in_output=True, seed=11, temperature=0.3, top_p=0.8, top_k=7, min_p=0.05,
                      presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={12: -5.0},
                      logprobs=3, skip_special_tokens=False, spaces_between_special_tokens=False)
    SamplingParams(**kw)  # the engine's own validation accepts it
    assert req.requested_max_tokens == 9 and req.cache_salt == "salt"
    # unset sampling fields are left to SamplingParams' defaults; logprobs=False -> none
    kw = P.sampling_kwargs(chat(), max_tokens=None, chat=True)
    assert "temperature" not in kw and kw["logprobs"] is None and kw["max_tokens"] is None


def test_explicit_nulls_mean_default():
    req = chat(temperature=None, n=None, stream=None, logprobs=None, stop=None, tools=None, tool_choice=None,
               max_tokens=None)
    assert req.n == 1 and req.stream is False and req.logprobs is False and req.max_tokens is None
    assert "temperature" not in P.sampling_kwargs(req, max_tokens=None, chat=True)
    comp = P.parse_request(P.CompletionRequest, '{"model": "m", "prompt": "x", "max_tokens": null, "echo": null}')
    assert comp.max_tokens is None and comp.echo is False  # explicit null max_tokens: up to the context


def test_completion_request_prompts_and_mapping():
    def comp(**kw):
        return P.parse_request(P.CompletionRequest, {"model": "m", **kw})

    assert comp(prompt="abc").prompts() == ["abc"]
    assert comp(prompt=[1, 2]).prompts() == [[1, 2]]
    assert comp(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert comp(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    r = comp(prompt="x", logprobs=2, skip_special_tokens=False)
    assert r.max_tokens == 16  # the completions default
    kw = P.sampling_kwargs(r, max_tokens=16, chat=False)
    assert kw["logprobs"] == 2 and kw["skip_special_tokens"] is False
    for bad, needle in [([], "empty"), ([1, "a"], "token ids"), ([[]], "token-id arrays"), (3, "string"),
                        ([True], "token ids")]:
        with pytest.raises(P.ProtocolError, match=needle) as ei:
            comp(prompt=bad)
        assert ei.value.param == "prompt"
    with pytest.raises(P.ProtocolError, match="suffix"):
        comp(prompt="x", suffix="y")
    with pytest.raises(P.ProtocolError, match="best_of"):
        comp(prompt="x", best_of=2)


@pytest.mark.parametrize("raw, needle, param", [
    ("{bad json", "not valid JSON", None),
    ("[1, 2]", "JSON object", None),
    ('{"messages": [{"role": "user", "content": "x"}]}', "model: field required", "model"),
    ('{"model": "m", "messages": []}', "messages", "messages"),
    ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens", "max_tokens"),
    ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', "max_tokens", "max_tokens"),
    ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": "2"}', "valid integer", "n"),
    ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream", "stream"),
    ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}', "temperature", "temperature"),
    ('{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages.0.role", "messages.0.role"),
])
def test_chat_validation_errors_name_the_field(raw, needle, param):
    err = bad_chat(raw)
    assert needle in err.message
    assert err.param == param
    body = err.body()
    assert body["error"]["message"] == err.message and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("kw, needle", [
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "image_url"),
    (dict(messages=[{"role": "tool", "content": "r"}]), "tool_call_id"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), "tool_calls"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "function name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]), "'object'"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "list"}}}}}]), "properties.a.type"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"anyOf": []}}}}}]), "anyOf"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
     "duplicate"),
    (dict(tools=[{"type": "retrieval"}]), "tools.0.type"),
    (dict(tool_choice="required"), "needs at least one tool"),
    (dict(tool_choice={"type": "function", "function": {"name": "g"}},
          tools=[{"type": "function", "function": {"name": "f"}}]), "'g'"),
    (dict(chat_template_kwargs={"add_vision_id": True}), "add_vision_id"),
    (dict(max_tokens=3, max_completion_tokens=4), "disagree"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(logit_bias={"abc": 1}), "not a token id"),
    (dict(logit_bias={"5": 500}), "[-100, 100]"),
    (dict(stop=["ok", ""]), "non-empty"),
    (dict(cache_salt=""), "cache_salt"),
    (dict(top_logprobs=2), "requires logprobs"),
    (dict(response_format={"type": "json_schema"}), "json_schema"),
])
def test_chat_semantic_errors(kw, needle):
    assert needle in bad_chat(kw).message


def test_json_schema_check_accepts_real_schemas():
    schema = {"type": "object", "properties": {
        "loc": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/point"}]},
        "tags": {"type": "array", "items": {"type": ["string", "null"]}},
        "opts": {"type": "object", "additionalProperties": {"type": "number"}}},
        "required": ["loc"], "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    P.check_json_schema(schema)
    req = chat(tools=[{"type": "function", "function": {"name": "geo.find-1", "parameters": schema}}],
               tool_choice={"type": "function", "function": {"name": "geo.find-1"}})
    kw = req.render_kwargs()
    assert kw["tools"][0]["function"]["parameters"] == schema
    assert kw["tool_choice"] == {"type": "function", "function": {"name": "geo.find-1"}}
    assert req.tools_enabled
    assert not chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none").tools_enabled


def test_render_kwargs_and_plain_messages():
    req = chat(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning": "r",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "res"}],
        reasoning_effort="high", chat_template_kwargs={"thinking": True},
        response_format={"type": "json_object"})
    msgs = req.plain_messages()
    assert msgs[0] == {"role": "developer", "content": "ab"}
    assert msgs[1]["reasoning_content"] == "r" and msgs[1]["tool_calls"][0]["function"]["name"] == "f"
    assert msgs[2] == {"role": "tool", "content": "res", "tool_call_id": "c"}
    kw = req.render_kwargs()
    assert kw["thinking"] is True and kw["enable_thinking"] is None and kw["reasoning_effort"] == "high"
    assert kw["response_format"] == {"type": "json_object"} and kw["tools"] is None


def test_resolve_max_tokens():
    assert P.resolve_max_tokens(10, None, 100) == 90
    assert P.resolve_max_tokens(10, 90, 100) == 90
    with pytest.raises(P.ProtocolError, match="maximum context length is 100") as ei:
        P.resolve_max_tokens(10, 91, 100)
    assert ei.value.param == "max_tokens" and ei.value.code == "context_length_exceeded"
    with pytest.raises(P.ProtocolError, match="your prompt has 100 tokens") as ei:
        P.resolve_max_tokens(100, None, 100, prompt_param="prompt")
    assert ei.value.param == "prompt"
    assert P.resolve_max_tokens(99, None, 100) == 1


def test_errors_and_response_builders():
    e = P.model_not_found("gpt", ["a", "b"])
    assert e.status_code == 404 and e.body()["error"]["code"] == "model_not_found" and "a, b" in e.message
    assert P.error_body("boom", status_code=500)["error"]["type"] == "server_error"
    u = P.usage(3, 4, cached_tokens=1)
    assert u == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                 "prompt_tokens_details": {"cached_tokens": 1}}
    ml = P.model_list(["x"], max_model_len=64, created=5)
    assert ml == {"object": "list", "data": [{"id": "x", "object": "model", "created": 5, "owned_by": "k3serve",
                                              "root": "x", "max_model_len": 64}]}
    ch = P.chat_chunk("id", 1, "m", [P.chat_delta_choice(0, {"content": "x"})], include_usage_field=True)
    assert ch["usage"] is None and ch["choices"][0]["finish_reason"] is None
    assert "usage" not in P.chat_chunk("id", 1, "m", [])
    resp = P.chat_response("id", 1, "m", [P.chat_choice(0, content=None, reasoning="r",
                                                        tool_calls=[P.tool_call_dict("f", "{}", call_id="f:0")],
                                                        finish_reason="tool_calls")], u)
    msg = resp["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": None, "reasoning_content": "r",
                   "tool_calls": [{"id": "f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert P.new_id("cmpl").startswith("cmpl-") and P.new_id("x") != P.new_id("x")


def test_sse_framing_roundtrip():
    events = [{"a": 1}, {"text": "line1\nline2 ünï"}, {"b": [1, 2]}]
    wire = "".join(P.sse_data(e) for e in events) + P.SSE_DONE + P.sse_data({"after": "done"})
    assert wire.startswith('data: {"a":1}\n\n')
    assert list(P.iter_sse_data(wire.split("\n"))) == events
    # comments, multi-line data fields, no trailing blank line
    lines = [": keep-alive", "data: {\"x\":", "data: 1}", "", "data: {\"y\": 2}"]
    assert list(P.iter_sse_data(lines)) == [{"x": 1}, {"y": 2}]
