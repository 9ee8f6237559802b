"""How many ops the fixed-shape MTP drafter step runs: workers/engine/spec/mtp_graphs.py `_fused_step` (the one-wait
greedy step's acceptance + observe + k - 1 draft steps) under torch.profiler on the CPU.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/mtp_drafter_ops.py                # the demo model, bf16, k = 3

A CUDA graph of the step holds one kernel per op that computes something, so the count here is the graph's kernel
count up to the CPU/Triton dispatch differences: the engine's ops (k3serve.kernels.ops: rms_norm, situ_and_mul,
moe_route, moe_experts, ...) count as ONE op each (`engine ops`: one or two Triton kernels each on CUDA, whatever
their CPU form runs), the other ops are the aten ops the profiler records, counted where they stop decomposing
(an op with a CompositeImplicitAutograd kernel, such as einsum, linear, softmax or `to`, counts its parts; any other
aten op counts as one whatever its CPU form calls inside), minus those that compute nothing (views, reshapes
without a copy, `to` without a cast, empty tensors: no kernel on CUDA). The drafter runs on the demo model (or
`--model DIR`) after one greedy request of `--prompt-tokens` + `--max-tokens` tokens through the engine with the
fixed-shape drafter run eagerly, so its pool holds a real request; the staged inputs are that request's last
step's. Prints per op name the count of one `_fused_step` call, the totals, and the same for the eager pieces of
`verify_and_draft` around it (the argmax and the two index_copy into the step's buffers).
"""

from __future__ import annotations

import argparse
import collections
import contextlib

import torch

# ops that launch no kernel (metadata, views, allocation, no-op casts)
NO_KERNEL = {
    "aten::view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::_unsafe_view",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::expand",
    "aten::expand_as",
    "aten::select",
    "aten::slice",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::as_strided",
    "aten::alias",
    "aten::detach",
    "aten::to",
    "aten::contiguous",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::unbind",
    "aten::split",
    "aten::chunk",
    "aten::narrow",
    "aten::lift_fresh",
    "aten::view_as",
    "aten::diagonal",
    "aten::unflatten",
    "aten::flatten",
    "aten::split_with_sizes",
    "aten::result_type",
    "aten::is_nonzero",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::numpy_T",
    "aten::movedim",
}
ENGINE = "k3op::"


@contextlib.contextmanager
def engine_ops_marked():
    """Every k3serve.kernels.ops entry point wrapped in a profiler range `k3op::NAME` (counted as one op)."""
    from k3serve.kernels import ops, reference

    saved = {}
    for name in reference.OPS:
        fn = getattr(ops, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def marked(*a, _fn=fn, _name=name, **kw):
            with torch.profiler.record_function(ENGINE + _name):
                return _fn(*a, **kw)

        setattr(ops, name, marked)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)


_COMPOSITE: dict[str, bool] = {}


def _composite(name: str) -> bool:
    """Every overload of the aten op has a CompositeImplicitAutograd kernel (it decomposes into other ops)."""
    c = _COMPOSITE.get(name)
    if c is None:
        packet = getattr(torch.ops.aten, name.split("::", 1)[1], None)
        key = torch._C.DispatchKey.CompositeImplicitAutograd
        c = packet is not None and all(_has(getattr(packet, o), key) for o in packet.overloads())
        _COMPOSITE[name] = c
    return c


def _has(op, key) -> bool:
    try:
        return op.has_kernel_for_dispatch_key(key)
    except RuntimeError:  # an overload without a C++ schema (a Python-only one): not a kernel of its own
        return True


def count_ops(fn) -> collections.Counter:
    """{op name: calls} of fn() at the leaves of the profiler's tree (engine ops as one; no-kernel ops left out)."""
    with (
        engine_ops_marked(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        with torch.profiler.record_function("k3op_root"):
            fn()
    root = [e for e in prof.events() if e.name == "k3op_root"]
    counts: collections.Counter = collections.Counter()

    def walk(e):
        if e.name.startswith(ENGINE):
            counts[e.name] += 1
        elif e.name.startswith("aten::") and not _composite(e.name):
            if e.name not in NO_KERNEL:
                counts[e.name] += 1  # a kernel (whatever its CPU form calls inside)
        else:  # a composite op (einsum, linear, softmax, to, ...) or a range: its parts
            for c in e.cpu_children:
                walk(c)

    for r in root:
        for c in r.cpu_children:
            walk(c)
    return counts


def summary(counts: collections.Counter) -> tuple[int, int]:
    eng = sum(v for k, v in counts.items() if k.startswith(ENGINE))
    return sum(counts.values()) - eng, eng


def build(model: str, dtype: str, k: int, prompt_tokens: int, max_tokens: int):
    """The demo model's engine with the fixed-shape drafter (eager) after one greedy request."""
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.engine.spec.mtp_graphs import GraphMTPProposer
    from k3serve.workers.llm import LLM

    llm = LLM(
        model,
        device="cpu",
        dtype=dtype,
        max_num_seqs=1,
        max_model_len=prompt_tokens + max_tokens + 8,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )
    eng = llm.engine
    p = eng.proposer
    eng.proposer = GraphMTPProposer(p.cfg, eng.runner.model.w, p.dtype, k, graphs=False)
    calls = []
    vd = eng.proposer.verify_and_draft

    def recorded(items, logits, hidden):
        calls.append((items, logits.clone(), hidden.clone()))
        return vd(items, logits, hidden)

    eng.proposer.verify_and_draft = recorded
    vocab = eng.proposer.cfg.vocab_size
    prompt = [(7 * i + 3) % (vocab - 300) for i in range(prompt_tokens)]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    eng.proposer.verify_and_draft = vd
    if not calls:
        raise SystemExit("no one-wait verify step ran (no drafts accepted into a verify step?)")
    return eng.proposer, calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the demo model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--top", type=int, default=40, help="op names to print")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from k3serve.workers.model.paths import default_serving_model

    prop, calls = build(
        args.model or str(default_serving_model()), args.dtype, args.k, args.prompt_tokens, args.max_tokens
    )
    size = next(s for s in prop.sizes if s >= 1)
    with torch.inference_mode():
        step = count_ops(lambda: prop._fused_step(size))
    items, logits, hidden = calls[-1]
    whole = count_ops(lambda: prop.verify_and_draft(items, logits, hidden))
    aten, eng = summary(step)
    waten, weng = summary(whole)
    print(f"MTP layers {prop.n}, k {prop.k}, pool {prop._pool['S']} x {prop._pool['L']}, dtype {args.dtype}")
    print(f"_fused_step({size}): {aten + eng} ops = {aten} aten kernels + {eng} engine ops")
    print(
        f"verify_and_draft (the step + its eager inputs): {waten + weng} ops = {waten} aten + {weng} engine"
    )
    print(f"{'op':40s} calls")
    for name, c in step.most_common(args.top):
        print(f"{name:40s} {c}")


if __name__ == "__main__":
    main()
