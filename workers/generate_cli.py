"""`k3serve generate`: offline greedy generation from token ids; prints the new ids as a JSON list.

    k3serve generate --model DIR --prompt-ids 1,2,3 --max-tokens N [--engine reference|engine] [--dtype T]

`--engine reference` (default) runs the plain reference forward pass (full recomputation, no caches;
dtype default float64). `--engine engine` runs `k3serve.workers.llm.LLM` (imported only then; dtype
default auto). Both decode greedily and ignore EOS, so their outputs are directly comparable.
"""

from __future__ import annotations

import argparse
import json
import sys

DTYPE_CHOICES = ("auto", "float64", "float32", "bfloat16")


def parse_ids(text: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3] (argparse type; a bad item raises ArgumentTypeError)."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"--prompt-ids needs at least one non-negative id, got {text!r}")
    return ids


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--prompt-ids", required=True, type=parse_ids, help="comma-separated token ids")
    parser.add_argument("--max-tokens", type=_positive, default=16)
    parser.add_argument("--engine", choices=("reference", "engine"), default="reference")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto: float64 for the reference, the engine's own default for the engine")
    parser.add_argument("--device", default="cpu")


def generate(model: str, prompt_ids: list[int], max_tokens: int, engine: str = "reference",
             dtype: str = "auto", device: str = "cpu") -> list[int]:
    """The greedy continuation (new ids only) from the chosen engine."""
    if engine == "reference":
        import torch

        from k3serve.workers.model.reference import reference_generate

        dt = torch.float64 if dtype == "auto" else getattr(torch, dtype)
        return reference_generate(model, prompt_ids, max_tokens, dtype=dt, device=device)
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM

    llm = LLM(model=model, dtype=dtype, device=device)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([list(prompt_ids)], params)
    return list(out[0].outputs[0].token_ids)


def run(args: argparse.Namespace) -> int:
    try:
        ids = generate(args.model, args.prompt_ids, args.max_tokens, args.engine, args.dtype, args.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"k3serve generate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(ids))
    return 0
