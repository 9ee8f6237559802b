"""The engine against Hugging Face transformers' KimiLinearForCausalLM.generate, same checkpoint, one run.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/vs_transformers.py                # CPU, float32, 8 prompts
    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/vs_transformers.py --num-prompts 8 32 128
    python3 benchmarks/vs_transformers.py --device cuda --dtype bfloat16 --num-prompts 32 64 \\
        --min-len 128 --max-len 1024 --new-tokens 128 --size gpu

A random Kimi-Linear model (weights re-drawn at useful scales, so greedy tokens are not degenerate) is
written with transformers' own `save_pretrained` (or `--model DIR` names an existing transformers-saved
Kimi-Linear checkpoint); the engine (`k3serve.workers.llm.LLM`) and transformers both load that directory.
For every batch size, the same mixed-length prompts (lengths uniform in [--min-len, --max-len]) go through

* transformers: ONE batched `generate` call, left-padded with an attention mask, greedy, `use_cache=True`
  (its recurrent KDA state, conv state and MLA cache), EOS off, exactly --new-tokens new tokens; with
  FLA's kernels where `fla` imports (GPU), otherwise its exact PyTorch path (`--no-fla` forces that);
* the engine: all prompts submitted at once, greedy, `ignore_eos`, --new-tokens each (its defaults:
  continuous batching, chunked prefill, `max_num_seqs` = the batch); `--max-num-batched-tokens N M ...` gives
  one engine row per token budget against the same transformers timing (default: the engine's own default).

Each side is warmed up once on prompts of the timed ones' lengths (other token ids) with up to 16 new tokens, so
Triton's compiles and autotuning for its shapes and the engine's CUDA-graph captures for its decode batch sizes
happen before the clock (a warm-up on a smaller batch left them inside the first timed run), then timed `--repeats` times alternately (the best time
counts, so a noisy neighbour hurts neither side more). Printed per batch size: both sides' generated
tokens/s (end to end, prefill included, wall clock), their ratio, the ratio of the process CPU time the two
spent (on a shared CPU with `--threads 1` the steadier figure: time spent waiting for a core is not in
it), and how many requests' greedy tokens agree with transformers'. In float32 against transformers' exact PyTorch path every request must agree (the script
exits 1 otherwise); with FLA (TF32 inside its float32 kernels) or in bf16 agreement is reported only.

Exit code 2 with one line where transformers (or its KimiLinear) is not installed, or for bad arguments.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import SET_HELP, apply_sets, print_table  # noqa: E402

# model sizes: "cpu" is the CPU row (float32, a few layers), "gpu" a 12-layer 64-expert model
SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32,
                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, linear_head_dim=16, linear_num_heads=2,
                 num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1),
    "cpu": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128,
                qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, linear_head_dim=64, linear_num_heads=4,
                num_local_experts=16, num_experts_per_tok=4, n_shared_experts=1),
    "gpu": dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, linear_head_dim=128,
                linear_num_heads=16, num_local_experts=64, num_experts_per_tok=8, n_shared_experts=1),
}


def die(msg: str) -> None:
    print(f"vs_transformers: {msg}", file=sys.stderr)
    sys.exit(2)


def import_transformers(no_fla: bool):
    """(KimiLinearConfig, KimiLinearForCausalLM, transformers version, whether FLA's kernels are in use)."""
    if no_fla:
        sys.modules["fla"] = None  # transformers picks FLA at import time; None makes `import fla` fail
    try:
        import transformers
        from transformers import KimiLinearConfig, KimiLinearForCausalLM
    except ImportError as e:
        die(f"transformers with KimiLinear is not installed here ({e}); install transformers>=5 to compare")
    try:
        import fla  # noqa: F401

        fla_ok = True
    except Exception:
        fla_ok = False
    return KimiLinearConfig, KimiLinearForCausalLM, transformers.__version__, fla_ok


def write_model(d: str, size: str, seed: int, KimiLinearConfig, KimiLinearForCausalLM) -> None:
    """A random Kimi-Linear checkpoint saved by transformers (3 KDA : 1 MLA layers, first layer dense)."""
    kw = dict(SIZES[size])
    L = kw["num_hidden_layers"]
    layer_types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(L)]
    torch.manual_seed(seed)
    cfg = KimiLinearConfig(layer_types=layer_types, mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
                           q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=True,
                           routed_scaling_factor=2.446, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=8192,
                           tie_word_embeddings=False, **kw)
    m = KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    H = cfg.hidden_size
    with torch.no_grad():
        for n, p in list(m.named_parameters()) + list(m.named_buffers()):
            if n.endswith(("A_log", "dt_bias")) or not p.is_floating_point():
                continue  # transformers' FLA-style init of the gate is already realistic
            if n.endswith("e_score_correction_bias"):
                new = torch.randn(p.shape, generator=g) * 0.1
            elif n.endswith(("norm.weight", "layernorm.weight")):
                new = 1 + 0.1 * torch.randn(p.shape, generator=g)
            elif n.endswith("embed_tokens.weight"):
                new = torch.randn(p.shape, generator=g)
            elif n.endswith("lm_head.weight"):
                new = torch.randn(p.shape, generator=g) * 2 / math.sqrt(H)
            elif n.endswith("conv1d.weight"):
                new = (torch.rand(p.shape, generator=g) * 2 - 1) / math.sqrt(p.shape[-1])
            else:
                new = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
            p.copy_(new.to(p.dtype))
    m.save_pretrained(d)


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


WARM_NEW = 16  # warm-up tokens: enough decode steps for the whole batch to decode together once


def other_ids(prompts: list[list[int]], vocab: int, seed: int) -> list[list[int]]:
    """Prompts of the same lengths as `prompts` with other token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in p] for p in prompts]


def engine_counts(llm) -> dict[str, int]:
    """The engine's counters a timed run should not move much: steps, replayed (fixed-shape) decode steps,
    CUDA graphs captured, preemptions."""
    eng = llm.engine
    runner = getattr(eng, "runner", None)
    return {"steps": getattr(eng, "num_steps", 0),
            "fixed-shape decode steps": getattr(runner, "num_static_decode_steps", 0),
            "graphs captured": len(getattr(runner, "graphs", ()) or ()),
            "preemptions": eng.scheduler.num_preemptions}


class StepTimer:
    """Wraps an engine's `runner.execute` to time every step (the device synchronized after each, so a step's
    time is its own) with what the step held: prefill tokens and decode rows. `--slow-steps N` prints the N
    slowest steps of one more, untimed run after the timed ones, to find where a run's time goes."""

    def __init__(self, llm, device: str):
        self.device, self.steps, self.on = device, [], False
        runner = llm.engine.runner
        self._execute = runner.execute
        runner.execute = self._timed

    def _timed(self, sched):
        if not self.on:
            return self._execute(sched)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self._execute(sched)
        _sync(self.device)
        chunks = sched.chunks
        rows = sum(len(c.token_ids) == 1 for c in chunks)
        self.steps.append((time.perf_counter() - t0, sum(len(c.token_ids) for c in chunks) - rows, rows))
        return out

    def report(self, n: int) -> str:
        total = sum(t for t, _, _ in self.steps)
        slow = sorted(self.steps, reverse=True)[:n]
        return (f"{len(self.steps)} steps, {total * 1e3:.1f} ms in execute; slowest: "
                + ", ".join(f"{t * 1e3:.1f} ms ({p} prefill tokens, {r} decode rows)" for t, p, r in slow))


def hf_generate(model, prompts: list[list[int]], new: int, device: str) -> list[list[int]]:
    """One batched greedy generate, left-padded (pad id 0, masked), with transformers' caches."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0,
                             eos_token_id=None)
    return out[:, width:].tolist()


def engine_generate(llm, prompts: list[list[int]], new: int) -> list[list[int]]:
    from k3serve.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default=None,
                    help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--num-prompts", type=int, nargs="+", default=None,
                    help="batch sizes, each one run (1..128; default 8 on cpu, 32 64 on cuda)")
    ap.add_argument("--min-len", type=int, default=None, help="shortest prompt (default 16 cpu, 128 cuda)")
    ap.add_argument("--max-len", type=int, default=None, help="longest prompt (default 192 cpu, 1024 cuda)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated per request (default 32 cpu, 128 cuda)")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="model size (default: cpu / gpu)")
    ap.add_argument("--model", default=None, help="an existing transformers-saved Kimi-Linear checkpoint dir")
    ap.add_argument("--save-model", default=None, metavar="DIR",
                    help="write the generated checkpoint of --size to DIR and exit (for other benchmarks' --model)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per side (best counts)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for both sides (cpu)")
    ap.add_argument("--no-fla", action="store_true", help="transformers without FLA's kernels (exact PyTorch)")
    ap.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[None], metavar="N",
                    help="the engine's token budget per step, one engine row per value (default: the engine's "
                         "default: 16384 on a CUDA device with >= 80 GB, else 2048)")
    ap.add_argument("--slow-steps", type=int, default=0, metavar="N",
                    help="print the N slowest engine steps of the last timed run (each step synchronized)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], metavar="MODULE.NAME=VALUE", help=SET_HELP)
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    dtype_name = args.dtype or ("bfloat16" if gpu else "float32")
    sizes = args.num_prompts or ([32, 64] if gpu else [8])
    lo = args.min_len if args.min_len is not None else (128 if gpu else 16)
    hi = args.max_len if args.max_len is not None else (1024 if gpu else 192)
    new = args.new_tokens if args.new_tokens is not None else (128 if gpu else 32)
    if any(not 1 <= n <= 128 for n in sizes):
        die("--num-prompts: each batch size must be in 1..128")
    if not 1 <= lo <= hi:
        die("--min-len/--max-len: need 1 <= min-len <= max-len")
    if new < 1 or args.repeats < 1:
        die("--new-tokens and --repeats must be positive")
    budgets = args.max_num_batched_tokens
    if any(b is not None and b < 1 for b in budgets):
        die("--max-num-batched-tokens: each value must be positive")
    if gpu and not torch.cuda.is_available():
        die("--device cuda: no CUDA device here")
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        die(f"--model: no config.json in {args.model}")
    apply_sets(ap, args.set)
    if args.threads:
        torch.set_num_threads(args.threads)
    KCfg, KLM, hf_version, fla = import_transformers(args.no_fla)
    fla = fla and gpu  # FLA's kernels are Triton: CUDA only; on the CPU transformers runs exact PyTorch
    dtype = getattr(torch, dtype_name)
    exact = dtype_name != "bfloat16" and not fla

    size = args.size or ("gpu" if gpu else "cpu")
    if args.save_model:
        if os.path.exists(os.path.join(args.save_model, "config.json")):
            die(f"--save-model: {args.save_model} already holds a checkpoint")
        write_model(args.save_model, size, args.seed, KCfg, KLM)
        print(f"# wrote the {size} checkpoint to {args.save_model}")
        return 0

    from k3serve.workers.llm import LLM

    tmp = tempfile.TemporaryDirectory(prefix="vs-transformers-")
    model_dir = args.model
    if model_dir is None:
        model_dir = tmp.name
        write_model(model_dir, size, args.seed, KCfg, KLM)
    hf = KLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    hf.generation_config.eos_token_id = None
    vocab = hf.config.vocab_size
    max_len = hi + new + 16
    print(f"# transformers {hf_version} ({'FLA kernels' if fla else 'exact PyTorch path'}), torch "
          f"{torch.__version__}, experts {getattr(hf.config, '_experts_implementation', None)}, attention "
          f"{getattr(hf.config, '_attn_implementation', None)}; device {args.device}, {dtype_name}, threads {torch.get_num_threads()}; model "
          f"{'--model ' + args.model if args.model else size} ({hf.config.num_hidden_layers} layers, hidden "
          f"{hf.config.hidden_size}, {getattr(hf.config, 'num_experts', None)} experts); prompts {lo}-{hi} "
          f"tokens, {new} new, best of {args.repeats}", flush=True)
    rows, bad = [], []
    for n in sizes:
        prompts = make_prompts(n, lo, hi, vocab, args.seed + n)
        llms = [LLM(model_dir, device=args.device, dtype=dtype_name, max_num_seqs=n, max_model_len=max_len,
                    skip_tokenizer_init=True, max_num_batched_tokens=b) for b in budgets]
        # the timed batch's lengths with other ids: the same chunk plan and decode batch sizes, so every
        # Triton specialization and CUDA graph the timed run needs is made before the clock
        warm = other_ids(prompts, vocab, args.seed + 1000 + n)
        hf_generate(hf, warm, min(new, WARM_NEW), args.device)
        for llm in llms:
            engine_generate(llm, warm, min(new, WARM_NEW))
        before = [engine_counts(llm) for llm in llms]
        t_hf, c_hf = [], []
        t_en, c_en, got = [[] for _ in llms], [[] for _ in llms], [None] * len(llms)
        for _ in range(args.repeats):
            _sync(args.device)
            t0, c0 = time.perf_counter(), time.process_time()
            want = hf_generate(hf, prompts, new, args.device)
            _sync(args.device)
            t_hf.append(time.perf_counter() - t0)
            c_hf.append(time.process_time() - c0)
            for j, llm in enumerate(llms):
                t0, c0 = time.perf_counter(), time.process_time()
                got[j] = engine_generate(llm, prompts, new)
                _sync(args.device)
                t_en[j].append(time.perf_counter() - t0)
                c_en[j].append(time.process_time() - c0)
        after = [engine_counts(llm) for llm in llms]
        timers = [StepTimer(llm, args.device) for llm in llms] if args.slow_steps > 0 else []
        for timer, llm in zip(timers, llms):  # one more engine run, untimed, each step synchronized
            timer.on = True
            engine_generate(llm, prompts, new)
        tok = n * new
        for j, llm in enumerate(llms):
            agree = sum(a == b for a, b in zip(got[j], want))
            if exact and agree != n:
                bad.append(n)
            rows.append([n, sum(map(len, prompts)), llm.engine.args.max_num_batched_tokens, tok / min(t_hf),
                         tok / min(t_en[j]), min(t_hf) / min(t_en[j]), min(c_hf) / min(c_en[j]), f"{agree}/{n}"])
            print(f"# {n} prompts, budget {rows[-1][2]}: transformers {rows[-1][3]:.1f} tok/s, engine "
                  f"{rows[-1][4]:.1f} tok/s, ratio {rows[-1][5]:.3f}, agree {agree}/{n}; engine per timed run: "
                  + ", ".join(f"{k} {(v - before[j][k]) / args.repeats:g}" for k, v in after[j].items()),
                  flush=True)  # kept if cut
            if timers:
                print(f"# {n} prompts, budget {rows[-1][2]}, a run after the timed ones: "
                      f"{timers[j].report(args.slow_steps)}", flush=True)
        del llms, llm  # the loop variable held the last engine (and its KV cache) into the next batch size
        if gpu:
            import gc
            gc.collect()
            torch.cuda.empty_cache()
    print_table(["prompts", "prompt tokens", "engine budget", "transformers tok/s", "engine tok/s", "ratio",
                 "CPU-time ratio", "greedy agree"], rows)
    if bad:
        print(f"vs_transformers: greedy tokens differ from transformers' exact path at batch sizes {bad}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
