"""K3 output parsers: channels, typed tool-call values, degradation, and streaming split invariance."""

import json
import random

import pytest

from k3serve.chat import ParsedOutput, StreamingParser, ToolCall, parse_output
from k3serve.chat.parsers import collect

O, C, S, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"


def el(name, body="", **attrs):
    head = "".join(f' {k}="{v}"' for k, v in attrs.items())
    return f"{O}{name}{head}{S}{body}{C}{name}{S}"


def arg(key, typ, value):
    return el("argument", value, key=key, type=typ)


def call(name, *args, index=1):
    return el("call", "".join(args), tool=name, index=index)


def tools(*calls):
    return el("tools", "".join(calls))


END = f"{C}message{S}{EOM}"


def stream(text, pieces, **kw):
    p = StreamingParser(kw["thinking"], kw["tools_enabled"], kw.get("tool_choice"))
    deltas = []
    for piece in pieces:
        deltas += p.feed(piece)
    deltas += p.finish()
    return deltas


def assert_split_invariant(text, expected: ParsedOutput, **kw):
    """Streaming at every 1-split, char by char, and random 3-splits equals the non-streaming result."""
    assert parse_output(text, **kw) == expected
    for i in range(len(text) + 1):
        assert collect(stream(text, [text[:i], text[i:]], **kw)) == expected, f"split at {i}: {text[:i]!r}"
    deltas = stream(text, list(text), **kw)
    assert collect(deltas) == expected
    rng = random.Random(len(text))
    for _ in range(30):
        a, b = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        assert collect(stream(text, [text[:a], text[a:b], text[b:]], **kw)) == expected
    return deltas


def tc(i, name, args):
    return ToolCall(f"{name}:{i}", name, json.dumps(args, ensure_ascii=False))


def test_thinking_reasoning_then_content():
    text = f"Let me think.\nDone{C}think{S}{O}response{S}The answer is 4.{C}response{S}{END}"
    kw = dict(thinking=True, tools_enabled=False)
    deltas = assert_split_invariant(text, ParsedOutput("Let me think.\nDone", "The answer is 4.", []), **kw)
    # char-by-char deltas never leak marker text
    assert all("<|" not in (d.reasoning or d.content or "") for d in deltas)
    assert "".join(d.reasoning or "" for d in deltas) == "Let me think.\nDone"


def test_echoed_think_opener_and_whitespace_tolerant_markers():
    text = f"{O}think{S}r1{C} think {S}{O} response {S}c1{C}response{S}"
    assert_split_invariant(text, ParsedOutput("r1", "c1", []), thinking=True, tools_enabled=False)


def test_reasoning_ended_by_response_opener_and_truncated_reasoning():
    kw = dict(thinking=True, tools_enabled=True)
    assert_split_invariant(f"abc{O}response{S}xyz", ParsedOutput("abc", "xyz", []), **kw)
    assert_split_invariant(f"{O}response{S}xyz{C}response{S}", ParsedOutput(None, "xyz", []), **kw)
    assert_split_invariant("still thinking <|clo", ParsedOutput("still thinking <|clo", None, []), **kw)


def test_non_thinking_output_starts_inside_response():
    kw = dict(thinking=False, tools_enabled=False)
    assert_split_invariant(f"Hello!{C}response{S}{END}", ParsedOutput(None, "Hello!", []), **kw)
    assert_split_invariant(f"{O}response{S}Hi{C}response{S}{END}", ParsedOutput(None, "Hi", []), **kw)
    # thinking off: think markers are literal content, never reasoning
    text = f"{O}think{S}x{C}think{S}y{C}response{S}"
    assert_split_invariant(text, ParsedOutput(None, f"{O}think{S}x{C}think{S}y", []), **kw)


TYPED = [
    ("s", "string", 'raw "quoted" {not json} \n<b>', 'raw "quoted" {not json} \n<b>'),
    ("s_num", "string", "123", "123"),
    ("s_empty", "string", "", ""),
    ("i", "number", "42", 42),
    ("f", "number", "-1.5e3", -1500.0),
    ("b", "boolean", "true", True),
    ("b2", "boolean", "false", False),
    ("n", "null", "null", None),
    ("o", "object", '{"a": [1, {"b": null}], "ü": "x"}', {"a": [1, {"b": None}], "ü": "x"}),
    ("a", "array", '[1, "two", false]', [1, "two", False]),
    ("bad_num", "number", "twelve", "twelve"),
    ("bad_obj", "object", "{oops", "{oops"),
    ("weird", "mystery", "[1]", [1]),
]


def test_every_typed_value():
    args = "".join(arg(k, t, raw) for k, t, raw, _ in TYPED) + el("argument", "untyped 1", key="notype")
    text = f"plan{C}think{S}{O}response{S}{C}response{S}{tools(call('f', args))}{END}"
    expected_args = {k: v for k, _, _, v in TYPED} | {"notype": "untyped 1"}
    out = parse_output(text, thinking=True, tools_enabled=True)
    assert out.tool_calls == [tc(0, "f", expected_args)]
    assert json.loads(out.tool_calls[0].arguments) == expected_args
    assert out.tool_calls[0].to_openai() == {"id": "f:0", "type": "function",
                                             "function": {"name": "f", "arguments": out.tool_calls[0].arguments}}
    assert_split_invariant(text, out, thinking=True, tools_enabled=True)


def test_multiple_calls_content_and_escaped_attrs():
    text = (f"I'll look.{C}response{S}" + tools(
        call("get_weather", arg("city", "string", "Paris"), arg("days", "number", "3"), index=1),
        call("a&amp;b", arg("k&quot;ey", "string", "v"), index=2),
        call("search", index=3)) + END)
    kw = dict(thinking=False, tools_enabled=True, tool_choice="auto")
    expected = ParsedOutput(None, "I'll look.", [tc(0, "get_weather", {"city": "Paris", "days": 3}),
                                                 tc(1, "a&b", {'k"ey': "v"}), tc(2, "search", {})])
    deltas = assert_split_invariant(text, expected, **kw)
    calls = [d.tool_call for d in deltas if d.tool_call]
    assert [(c.index, c.id, c.name) for c in calls] == [(0, "get_weather:0", "get_weather"), (1, "a&b:1", "a&b"),
                                                       (2, "search:2", "search")]
    assert calls[0].to_openai()["function"]["arguments"] == json.dumps({"city": "Paris", "days": 3})


def test_calls_without_name_dropped_and_text_between_calls_dropped():
    text = (f"{C}response{S}{O}tools{S}\n" + el("call", arg("x", "number", "1"), index=1) + "\n junk \n"
            + call("ok", arg("y", "null", "null"), index=2) + f"\n{C}tools{S}")
    assert_split_invariant(text, ParsedOutput(None, None, [tc(0, "ok", {"y": None})]),
                           thinking=False, tools_enabled=True)


def test_tools_directly_after_think():
    text = f"r{C}think{S}{tools(call('f', arg('a', 'string', 'b')))}{END}"
    assert_split_invariant(text, ParsedOutput("r", None, [tc(0, "f", {"a": "b"})]), thinking=True, tools_enabled=True)


def test_json_argument_block():
    text = f"{C}response{S}" + tools(call("f", el("json", '{"a": 1, "b": [2]}', type="object")),
                                     call("g", el("json", "{broken", type="object")))
    expected = ParsedOutput(None, None, [tc(0, "f", {"a": 1, "b": [2]}), ToolCall("g:1", "g", "{broken")])
    assert_split_invariant(text, expected, thinking=False, tools_enabled=True)


@pytest.mark.parametrize("kw", [dict(tools_enabled=True, tool_choice="none"), dict(tools_enabled=False)])
def test_tools_disabled_keeps_block_as_content(kw):
    block = tools(call("f", arg("a", "string", "b")))
    text = f"hi{C}response{S}{block}{END}"
    assert_split_invariant(text, ParsedOutput(None, "hi" + block, []), thinking=False, **kw)


def test_marker_text_inside_string_argument():
    value = f"a{O}b<|sep x {S}c{O}d{S}e"
    text = f"{C}response{S}" + tools(call("f", arg("v", "string", value)))
    assert_split_invariant(text, ParsedOutput(None, None, [tc(0, "f", {"v": value})]),
                           thinking=False, tools_enabled=True)


def test_unfinished_call_degrades_to_content():
    partial = f"{O}call tool=\"g\" index=\"2\"{S}{O}argument key=\"q\" type=\"string\"{S}trunc"
    text = f"ok{C}response{S}{O}tools{S}{call('f', index=1)}{partial}"
    assert_split_invariant(text, ParsedOutput(None, "ok" + partial, [tc(0, "f", {})]),
                           thinking=False, tools_enabled=True)
    text2 = f"{C}response{S}{O}tools{S}{partial}{END}"  # call cut off by the message end
    assert_split_invariant(text2, ParsedOutput(None, partial, []), thinking=False, tools_enabled=True)


def test_malformed_markers_are_literal_text():
    text = f"a{S}b{O}no sep here{C}bad header!{S}c{O}{O}x{S}{C}response{S}"
    expected = ParsedOutput(None, f"a{S}b{O}no sep here{C}bad header!{S}c{O}{O}x{S}", [])
    assert_split_invariant(text, expected, thinking=False, tools_enabled=True)
    long_header = f"{O}{'h' * 1100}{S}tail"
    assert_split_invariant(long_header, ParsedOutput(None, long_header, []), thinking=False, tools_enabled=False)


def test_text_after_end_is_ignored_and_after_response_is_content():
    kw = dict(thinking=False, tools_enabled=True)
    assert_split_invariant(f"x{C}response{S}y{END}ignored{O}response{S}z",
                           ParsedOutput(None, "xy", []), **kw)
    assert_split_invariant(f"x{EOM}after", ParsedOutput(None, "x", []), **kw)


def test_feed_after_finish_and_empty():
    p = StreamingParser(True, True)
    assert p.feed("") == [] and p.finish() == [] and p.feed("x") == []
    assert parse_output("", thinking=True, tools_enabled=True) == ParsedOutput(None, None, [])


def test_random_marker_soup_never_raises_and_is_split_invariant():
    rng = random.Random(7)
    atoms = [O, C, S, EOM, "think", "response", "tools", "call", "argument", "json", ' tool="f"', ' key="k"',
             ' type="number"', ' type="string"', "1", "x", " ", "\n", "<|", "|>", '"', "世"]
    for n in range(150):
        text = "".join(rng.choice(atoms) for _ in range(rng.randrange(1, 25)))
        kw = dict(thinking=rng.random() < 0.5, tools_enabled=rng.random() < 0.7,
                  tool_choice=rng.choice([None, "auto", "none", "required"]))
        expected = parse_output(text, **kw)
        for i in range(len(text) + 1):
            assert collect(stream(text, [text[:i], text[i:]], **kw)) == expected, (n, text, i)
        assert collect(stream(text, list(text), **kw)) == expected
