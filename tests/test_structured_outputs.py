"""Structured outputs in the engine (k3serve.workers.structured + the sampler's mask), on the random
tiny model: its outputs are noise, so every valid output below is valid because of the mask alone.

One float64 engine for the module; batches are submitted together so each test costs a few dozen steps.
"""

import json
import random
import re

import jsonschema
import pytest

from k3serve.chat import parse_output
from k3serve.chat.renderer import render_chat
from k3serve.proto.convert import sampling_kwargs_from_proto, sampling_to_proto
from k3serve.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from k3serve.workers.llm import LLM
from k3serve.workers.structured import StructuredOutputError

WORDS = ["red", "green", "blue", "a b", "x\"y", "<tag>", "ünï"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float64", max_model_len=1024)


def random_property(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["int", "str", "enum", "bool", "null", "arr"] + (["obj"] if depth == 0 else []))
    if kind == "int":
        lo = rng.randint(-20, 20)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 40)}
    if kind == "str":
        return {"type": "string", "minLength": rng.randint(0, 1), "maxLength": rng.randint(1, 4)}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(1, 3))}
    if kind == "arr":
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": rng.randint(0, 1), "maxItems": 2}
    if kind == "obj":
        return random_schema(rng, depth + 1)
    return {"type": {"bool": "boolean", "null": "null"}[kind]}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema whose every instance is short: bounded integers, strings, enums, arrays."""
    props = {rng.choice(["k", "name", "v", "ключ", "a b"]) + str(i): random_property(rng, depth)
             for i in range(rng.randint(1, 3))}
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def test_random_bounded_schemas_always_validate(llm):
    rng = random.Random(21)
    schemas = [random_schema(rng) for _ in range(8)]
    prompts, params = [], []
    for i, schema in enumerate(schemas):
        for seed in (i, 100 + i):
            prompts.append([rng.randrange(300) for _ in range(rng.randint(1, 12))])
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                         structured_outputs={"json": schema}))
        prompts.append([1, 2, 3])  # greedy too
        params.append(SamplingParams(temperature=0.0, max_tokens=160, structured_outputs={"json": schema}))
    outs = llm.generate(prompts, params)
    per_schema = len(outs) // len(schemas)
    for j, out in enumerate(outs):
        schema = schemas[j // per_schema]
        o = out.outputs[0]
        assert o.finish_reason == "stop", (schema, o.text)
        jsonschema.validate(json.loads(o.text), schema)


def test_regex_choice_grammar_json_object(llm):
    cases = [
        ({"regex": r"[a-c]{2,4}-\d{1,3}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-\d{1,3}", t)),
        ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        ({"grammar": 'root ::= "(" num ("+" num)? ")"\nnum ::= [1-9] [0-9]?'},
         lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)", t)),
    ]
    prompts, params, checks = [], [], []
    for so, check in cases:
        for seed in range(4):
            prompts.append([5 + seed])
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=so))
            checks.append(check)
    for out, check in zip(llm.generate(prompts, params), checks):
        o = out.outputs[0]
        assert o.finish_reason == "stop" and check(o.text), o.text


def test_json_object_is_an_object(llm):
    # free-form JSON is unbounded; a bias towards closing tokens keeps it short, the mask keeps it valid
    tok = llm.tokenizer
    bias = {tok.encode(c)[0]: 6.0 for c in ['"', "}", "]"]}
    outs = llm.generate([[7], [8], [9]], [SamplingParams(temperature=1.0, seed=s, max_tokens=200, logit_bias=bias,
                                                         structured_outputs={"json_object": True})
                                          for s in range(3)])
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        assert isinstance(json.loads(o.text), dict)


def ordinary_runs_text(tok, ids) -> list[bytes]:
    """The bytes of each run of ordinary tokens between special tokens."""
    runs, cur = [], []
    for t in ids:
        if tok.is_special(t):
            runs.append(b"".join(tok.token_bytes(i) for i in cur))
            cur = []
        else:
            cur.append(t)
    return runs + [b"".join(tok.token_bytes(i) for i in cur)]


def _chat_prompt(llm, thinking: bool, tools=None):
    msgs = [{"role": "user", "content": "What is the weather?"}]
    return render_chat(llm.tokenizer, msgs, tools=tools, thinking=thinking).token_ids


WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"type": "string", "enum": ["c", "f"]}}}}
NOTE = {"name": "note", "strict": True, "parameters": {"type": "object", "properties": {
    "text": {"type": "string", "maxLength": 5}}, "required": ["text"]}}


def _chat_params(llm, seed, **so):
    # free text (the think channel, a response body without a constraint) is unbounded for a random model;
    # a bias on <|close|> makes it short. Where a close marker is not allowed the mask removes it.
    close = llm.tokenizer.special_id("<|close|>")
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=300, skip_special_tokens=False,
                          logit_bias={close: 7.0}, structured_outputs=dict(so, k3_chat=True))


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_json_body_and_envelope(llm, thinking):
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "why": {"type": "string", "maxLength": 3}},
              "required": ["answer", "why"], "additionalProperties": False}
    prompt = _chat_prompt(llm, thinking)
    outs = llm.generate([prompt] * 3, [_chat_params(llm, s, json=schema, thinking=thinking) for s in range(3)])
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop"
        assert o.text.endswith("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"), o.text
        assert o.token_ids[-1] == llm.tokenizer.eos_token_id
        assert not any(b"<|" in run for run in ordinary_runs_text(llm.tokenizer, o.token_ids))
        parsed = parse_output(o.text, thinking=thinking, tools_enabled=False)
        jsonschema.validate(json.loads(parsed.content), schema)
        if thinking:
            assert "<|close|>think<|sep|><|open|>response<|sep|>" in o.text


def test_tool_choice_named_required_none(llm):
    tools = [WEATHER, NOTE]
    openai_tools = [{"type": "function", "function": t} for t in tools]
    prompt = _chat_prompt(llm, False, openai_tools)
    by_name = {t["name"]: t for t in tools}
    cases = [("named", 0), ("named", 1), ("required", 0), ("required", 1), ("none", 0), ("auto", 0)]
    params = []
    for mode, seed in cases:
        choice = {"type": "function", "function": {"name": "get_weather"}} if mode == "named" else mode
        params.append(_chat_params(llm, seed, tools=tools, tool_choice=choice))
    outs = llm.generate([prompt] * len(cases), params)
    for (mode, _seed), out in zip(cases, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        choice = "get_weather" if mode == "named" else mode
        assert not any(b"<|" in run for run in ordinary_runs_text(llm.tokenizer, o.token_ids))
        parsed = parse_output(o.text, thinking=False, tools_enabled=True,
                              tool_choice=None if mode == "named" else mode)
        if mode == "none":
            assert parsed.tool_calls == [] and "<|open|>tools" not in o.text
            continue
        if mode in ("named", "required"):
            assert parsed.tool_calls, o.text
        if mode == "named":
            assert [c.name for c in parsed.tool_calls] == ["get_weather"]
        for call in parsed.tool_calls:
            if mode == "auto" and not by_name[call.name].get("strict"):
                continue  # auto: only strict tools' arguments are enforced
            jsonschema.validate(json.loads(call.arguments), by_name[call.name]["parameters"])
        assert choice


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm):
    rng = random.Random(5)
    plain = [[rng.randrange(300) for _ in range(rng.randint(2, 20))] for _ in range(3)]
    plain_params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                    SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
                    SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=12, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate(plain, plain_params)]
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                                  structured_outputs={"json": random_schema(rng)}) for s in range(3)]
    mixed = llm.generate([plain[0], [3], plain[1], [4], plain[2], [5]],
                         [plain_params[0], constrained[0], plain_params[1], constrained[1], plain_params[2],
                          constrained[2]])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone


def test_bad_schemas_raise_with_xgrammar_message(llm):
    bad = [({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "missing"),
           ({"json": {"type": "string", "pattern": "a("}}, "parenthesis"),
           ({"regex": "a("}, "parenthesis"),
           ({"grammar": "root ::= undefined_rule"}, "undefined_rule")]
    for so, needle in bad:
        with pytest.raises(StructuredOutputError, match=needle):
            llm.generate([[1]], SamplingParams(max_tokens=4, structured_outputs=so))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(SamplingParamsError, match="only one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(SamplingParamsError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a"})


def test_compile_cache_and_matcher_rollback(llm):
    from k3serve.workers.structured.matcher import GrammarState, fill_bitmasks

    cache = llm.engine.structured.cache
    so = StructuredOutputsParams(json={"type": "object", "properties": {"z": {"type": "integer"}}})
    hits = cache.stats["hits"]
    g1 = cache.compile_now(so)
    g2 = cache.compile_now(StructuredOutputsParams(json={"type": "object", "properties": {"z": {"type": "integer"}}}))
    assert g1 is g2 and cache.stats["hits"] == hits + 1
    # property order is generation order: another order is another grammar
    two = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    flipped = dict(two, properties=dict(reversed(list(two["properties"].items()))))
    assert cache.compile_now(StructuredOutputsParams(json=flipped)) is not cache.compile_now(
        StructuredOutputsParams(json=two))
    st = GrammarState(g1)
    before = fill_bitmasks([st], cache.vocab_size).clone()
    for t in llm.tokenizer.encode('{"z": 1'):
        assert st.accept(t)
    assert not bool((fill_bitmasks([st], cache.vocab_size) == before).all())
    st.rollback(st.num_accepted)
    assert bool((fill_bitmasks([st], cache.vocab_size) == before).all())


def test_structured_outputs_cross_the_proto():
    so = {"json": {"type": "object"}, "k3_chat": True, "tools": [NOTE], "tool_choice": "required"}
    kw = sampling_kwargs_from_proto(sampling_to_proto({"max_tokens": 5, "structured_outputs": so}))
    assert kw["structured_outputs"] == so
    assert SamplingParams(**kw).structured_outputs == StructuredOutputsParams(**so)


def test_held_request_waits_while_others_run(llm):
    """A request whose grammar is still compiling waits outside the scheduler; the others keep stepping."""
    from concurrent.futures import Future

    eng = llm.engine
    cache = eng.structured.cache
    so = StructuredOutputsParams(regex="[0-9]{3}")
    ready = cache.compile_now(so)
    pending: Future = Future()
    real_compile = cache.compile
    cache.compile = lambda key: pending
    try:
        eng.add_request("held", [1, 2], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so))
        eng.add_request("free", [3, 4], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    finally:
        cache.compile = real_compile
    done = {}
    for _ in range(3):
        for out in eng.step():
            done[out.request_id] = out
    assert done["free"].finished and "held" not in done
    assert eng.has_unfinished_requests() and len(eng.structured) == 1 and not eng.scheduler.has_unfinished()
    pending.set_result(ready)
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
    held = done["held"].outputs[0]
    assert held.finish_reason == "stop" and re.fullmatch("[0-9]{3}", held.text)


def test_chunked_prefill_and_preemption_keep_constrained_outputs(llm, tiny_model_dir):
    from _engine_helpers import tight_kv_budget

    rng = random.Random(8)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 60))] for _ in range(7)]
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, seed=i, max_tokens=50,
                             structured_outputs={"json": random_schema(rng)}) for i in range(7)]
    reference = [o.outputs[0] for o in llm.generate(prompts, params)]
    budget = tight_kv_budget(tiny_model_dir, 128, extra_blocks=2, block_size=16)
    tight = LLM(str(tiny_model_dir), dtype="float64", max_model_len=128, max_num_batched_tokens=24,
                max_num_seqs=16, block_size=16, kv_cache_memory=budget)
    outs = [o.outputs[0] for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    for o, p in zip(outs, params):
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), p.structured_outputs.json)
    assert sum(o.finish_reason == "stop" for o in outs) >= 5


def test_marker_guard_blocks_spelled_markers(llm, monkeypatch):
    from k3serve.workers.structured import matcher
    from k3serve.workers.structured.matcher import GrammarState, fill_bitmasks

    monkeypatch.setattr(matcher, "BATCH_FILL_MIN_ROWS", 2)  # two rows take XGrammar's batched fill

    tok, cache = llm.tokenizer, llm.engine.structured.cache
    so = StructuredOutputsParams(json={"type": "string"}, k3_chat=True)
    compiled = cache.compile_now(so)
    bar = tok.encode("|")[0]
    allowed = {}
    for guarded in (False, True):
        st = GrammarState(compiled, cache.marker_guard if guarded else None)
        for t in tok.encode('"a<'):
            assert st.accept(t)
        row = fill_bitmasks([st, st], cache.vocab_size)[1]  # the batched path too
        allowed[guarded] = bool((row[bar // 32] >> (bar % 32)) & 1)
        st.rollback(1)  # after "a" a "|" is fine again
        row = fill_bitmasks([st], cache.vocab_size)[0]
        assert (row[bar // 32] >> (bar % 32)) & 1
    assert allowed == {False: True, True: False}


def test_failed_compile_raises_once_and_aborted_held_requests_are_dropped(llm):
    from concurrent.futures import Future

    eng = llm.engine
    cache = eng.structured.cache
    so = StructuredOutputsParams(regex="[a-z]{2}")
    failing, never = Future(), Future()
    real_compile = cache.compile
    cache.compile = lambda key: failing
    try:
        eng.add_request("fails", [1], SamplingParams(max_tokens=4, structured_outputs=so))
    finally:
        cache.compile = lambda key: never
    try:
        eng.add_request("aborted", [1], SamplingParams(max_tokens=4, structured_outputs=so))
    finally:
        cache.compile = real_compile
    failing.set_exception(StructuredOutputError("compile failed"))
    with pytest.raises(StructuredOutputError, match="compile failed"):
        eng.step()
    eng.abort_request(["fails", "aborted"])
    eng.step()
    assert not eng.has_unfinished_requests() and len(eng.structured) == 0


def test_sampler_masks_and_the_grammar_wins_a_dead_row(llm):
    import torch

    from k3serve.workers.sample.constraints import apply_grammar_masks
    from k3serve.workers.sampler import Sampler, SamplingState
    from k3serve.workers.structured.matcher import GrammarState

    tok, cache = llm.tokenizer, llm.engine.structured.cache
    compiled = cache.compile_now(StructuredOutputsParams(choice=["ab", "ba"]))
    v = cache.vocab_size
    raw = torch.randn(3, v, dtype=torch.float64)
    states = [SamplingState.new(SamplingParams(temperature=0.0), [1]) for _ in range(3)]
    states[0].structured, states[2].structured = GrammarState(compiled), GrammarState(compiled)
    x = raw.clone()
    x[2] = float("-inf")  # as if the other adjustments had removed every token of row 2
    apply_grammar_masks(x, raw, states, [0, 2])
    allowed = {tok.encode("a")[0], tok.encode("b")[0]} | {t for t in range(v) if tok.token_bytes(t) in (b"ab", b"ba")}
    for row in (0, 2):
        finite = set(torch.isfinite(x[row]).nonzero().flatten().tolist())
        assert finite and finite <= allowed
        assert torch.equal(x[row][list(finite)], raw[row][list(finite)])
    assert torch.equal(x[1], raw[1])  # the unconstrained row is untouched
    out = Sampler(seed=0)(raw, states)
    assert out.token_ids[1] == int(raw[1].argmax()) and out.token_ids[0] in allowed
    assert states[0].structured.num_accepted == 1 and states[1].structured is None


def test_benchmark_smallest_run():
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "structured_overhead.py")
    proc = subprocess.run([sys.executable, script, "--vocab", "1024", "--batch", "1", "3", "--repeat", "1"],
                          env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "unconstrained ms" in proc.stdout and "K3 tools required" in proc.stdout
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.strip() and ln.split()[0] in ("1", "3")]
    assert [r[0] for r in rows] == ["1", "3"] and all(float(r[2]) > 0 for r in rows)


def test_k3_grammar_accepts_free_and_union_arguments(llm):
    """Token-level walk through the grammar: a non-strict tool under auto takes any typed arguments;
    a property with several types (or anyOf) takes any of them; the turn ends with the stop token."""
    from k3serve.workers.structured.matcher import GrammarState

    tok, cache = llm.tokenizer, llm.engine.structured.cache
    o, c, s = (tok.special_id(n) for n in ("<|open|>", "<|close|>", "<|sep|>"))
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": ["integer", "string"]}, "b": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}]

    def walk(so, parts) -> GrammarState:
        st = GrammarState(cache.compile_now(so))
        for p in parts:
            for t in [p] if isinstance(p, int) else tok.encode(p):
                assert st.accept(t), (p, t)
        return st

    def call(*args):
        out = [o, 'call tool="f" index="1"', s]
        for key, typ, val in args:
            out += [o, f'argument key="{key}" type="{typ}"', s, val, c, "argument", s]
        return out + [c, "call", s]

    tail = [c, "tools", s, c, "message", s, tok.eos_token_id]
    st = walk(StructuredOutputsParams(json={"type": "object"}, k3_chat=True, tools=tools, tool_choice="auto"),
              ["{}", c, "response", s, o, "tools", s, *call(("zz", "string", "hi"), ("y", "object", '{"q": [1]}')),
               *tail])
    assert st.matcher.is_terminated()
    st = walk(StructuredOutputsParams(k3_chat=True, tools=tools, tool_choice="required"),
              ["x", c, "response", s, o, "tools", s, *call(("a", "string", "hi"), ("b", "number", "5")), *tail])
    assert st.matcher.is_terminated()
    st = GrammarState(cache.compile_now(StructuredOutputsParams(k3_chat=True, tools=tools, tool_choice="required")))
    for t in tok.encode("x") + [c] + tok.encode("response") + [s]:
        assert st.accept(t)
    assert not st.accept(c)  # required: the message cannot close before a call
