"""Structured outputs: per-step cost of grammar masking in the sampler, and grammar compile time.

PYTHONSAFEPATH=1 .venv/bin/python benchmarks/structured_overhead.py [--vocab 163840] [--batch 1 16 64]
    [--repeat 7] [--device cpu]

Vocabulary: a synthetic K3-format tokenizer with `--vocab` ids (256 byte ranks, learned + synthetic
merges, 256 specials; the real K3 vocabulary has 163840), so the masks have the real width.

Table 1, per sampler call (one engine step's sampling) at each batch size, measured in the same run:
  * unconstrained: greedy rows, no grammar (the baseline);
  * constrained: the same rows, each with a JSON-schema grammar matcher (rows sit at different
    positions inside the JSON), i.e. bitmask fill (XGrammar, CPU threads) + copy + unpack + mask + the
    matcher advance. Every matcher is rolled back one token after each call so the positions stay put;
    the rollback is timed too.
  `fill ms` is XGrammar's bitmask fill alone. Ratio = constrained / unconstrained.
Table 2, compile time per grammar: cold (a fresh cache: structural tag -> Grammar -> CompiledGrammar)
and cached (the same constraint again: a cache hit), with the cold/cached ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from k3serve.sampling_params import SamplingParams, StructuredOutputsParams
from k3serve.tokenizer import K3Tokenizer, write_tokenizer_files
from k3serve.workers.sampler import Sampler, SamplingState

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table, timeit  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 32},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                    "pattern": "[0-9]{5}"}},
                "required": ["city"]}},
    "required": ["name", "age"], "additionalProperties": False}
SAMPLE = '{"name": "Ada Lovelace", "age": 36, "tags": ["a", "ccc"], "address": {"city": "London", "zip": "1'
TOOL = {"name": "search", "strict": True, "parameters": {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 64}, "top_k": {"type": "integer", "minimum": 1, "maximum": 20}},
    "required": ["query"]}}
GRAMMARS = {
    "json schema": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{1,10}( [A-Z][a-z]{1,10}){0,3}"),
    "K3 chat + json": StructuredOutputsParams(json=SCHEMA, k3_chat=True, thinking=True),
    "K3 tools required": StructuredOutputsParams(k3_chat=True, tools=[TOOL], tool_choice="required"),
}


def make_tokenizer(vocab: int) -> K3Tokenizer:
    d = tempfile.mkdtemp(prefix="k3-bench-tok-")
    write_tokenizer_files(d, num_merges=vocab - 512)
    return K3Tokenizer.from_dir(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.vocab < 1024:
        ap.error("--vocab must be at least 1024")

    from k3serve.workers.structured.compile_cache import GrammarCompileCache
    from k3serve.workers.structured.matcher import GrammarState, fill_bitmasks

    t0 = time.perf_counter()
    tok = make_tokenizer(args.vocab)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache = GrammarCompileCache(tok, tok.vocab_size)
    t_info = time.perf_counter() - t0

    compiled = cache.compile_now(GRAMMARS["json schema"])
    prefix = tok.encode(SAMPLE)
    torch.manual_seed(0)
    sampler = Sampler(seed=0)
    rows = []
    for n in args.batch:
        logits = torch.randn(n, tok.vocab_size, device=args.device)
        plain = [SamplingState.new(SamplingParams(temperature=0.0), [1, 2, 3], eos_token_id=tok.eos_token_id)
                 for _ in range(n)]
        constrained = []
        for i in range(n):
            st = SamplingState.new(SamplingParams(temperature=0.0), [1, 2, 3], eos_token_id=tok.eos_token_id)
            st.structured = GrammarState(compiled)
            for t in prefix[: 1 + (i * 7) % len(prefix)]:  # spread the rows over positions in the JSON
                assert st.structured.accept(t)
            constrained.append(st)

        def step_constrained(states=constrained, logits=logits):
            sampler(logits, states)
            for st in states:
                st.structured.rollback(1)

        t_plain = timeit(lambda: sampler(logits, plain), repeat=args.repeat, warmup=2)  # noqa: B023
        t_con = timeit(step_constrained, repeat=args.repeat, warmup=2)
        t_fill = timeit(lambda: fill_bitmasks([s.structured for s in constrained], tok.vocab_size),  # noqa: B023
                        repeat=args.repeat, warmup=2)
        rows.append([n, t_plain * 1e3, t_con * 1e3, (t_con - t_plain) * 1e3, t_con / t_plain, t_fill * 1e3])

    comp_rows = []
    for name, so in GRAMMARS.items():
        fresh = GrammarCompileCache(tok, tok.vocab_size)
        t0 = time.perf_counter()
        fresh.compile_now(so)
        cold = time.perf_counter() - t0
        warm = timeit(lambda: fresh.compile_now(so), repeat=args.repeat, warmup=1, sync=None)  # noqa: B023
        assert fresh.stats["misses"] == 1
        comp_rows.append([name, cold * 1e3, warm * 1e3, cold / warm])
        fresh.close()

    print(f"vocab={tok.vocab_size} device={args.device} threads={torch.get_num_threads()} "
          f"(tokenizer {t_tok:.1f} s, TokenizerInfo + compiler {t_info:.1f} s, once per engine)")
    print("per sampler call, greedy rows, same logits; baseline = unconstrained")
    print_table(["batch", "unconstrained ms", "constrained ms", "overhead ms", "ratio", "fill ms"], rows)
    print()
    print("grammar compile")
    print_table(["grammar", "cold ms", "cached ms", "cold/cached"], comp_rows)
    cache.close()


if __name__ == "__main__":
    main()
