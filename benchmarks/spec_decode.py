"""Speculative decoding end to end: per-user decode tok/s at batch 1 with and without speculation, in one run.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/spec_decode.py --device cpu            # the demo model
    PYTHONSAFEPATH=1 python3 benchmarks/spec_decode.py --device cuda --max-tokens 128    # on a GPU

Model: models/k3-demo-stdlib (workers/model/paths.py `default_serving_model`; `--model DIR` for another).
Prompts, two sets:
  * code: the last `--prompt-tokens` tokens before a function body, from the standard-library files the
    demo model held out of training (workers/model/train/corpus.py: the split is by a hash of the file's
    relative path, so a held-out path of this machine's stdlib was never trained on);
  * high-entropy: the same length of uniformly random ordinary (non-special) token ids.
Rows, every request alone (batch 1), greedy, `--max-tokens` new tokens: `baseline` (no speculation) and
each speculative config: MTP with k = `--k` under both rollback schemes (multi_slot, recover_ssm),
and ngram (prompt lookup) with the same k, multi_slot. Per row: per-user decode tok/s = (tokens - 1) /
(last token time - first token time), the mean over the prompts; `speedup` = that over the baseline's
on the same prompts in the same run; `cpu speedup` = the same ratio with the engine thread's CPU time of
the steps after the first token in place of the wall-clock time (steadier on a shared machine; the
engine runs in this thread, so with `--threads 1` it is the work done); `accept len` = mean tokens per verify step (1 + accepted drafts);
`acc@i` = fraction of verify steps whose draft i was accepted; `same` = requests whose tokens equal the
baseline's (greedy: all of them, up to float rounding off float64); `spec state` = the speculation-only
state one request holds (the rollback scheme's KDA bytes: workers/engine/spec/rollback.py `state_bytes`
at batch 1, plus the MTP layer's latent cache at the end of the longest request). After the table: how
many verify steps ran on the fixed-shape path (CUDA graphs on a GPU; workers/engine/spec/static_verify.py).
`--configs` picks the rows besides the baseline (default mtp,recover,ngram; `mtp-two-wait` adds the MTP multi-slot row
with the greedy step's acceptance on the host and the drafter after it: the path before workers/engine/llm_engine.py
`_fused_spec`), `--ngram-ks 3,5,7` one ngram row per k, `--ngram-lookup MIN:MAX` its prompt-lookup suffix lengths.
`--chunked-verify`: the KDA layers of verify steps take the chunked form (kernels/cpu/kda.py, and for recover_ssm
kernels/kda_recover.py `kda_recover_verify`) instead of the short-chunk token walks (kernels/cpu/kda_verify.py,
workers/engine/spec/recover_ssm.py `_verify_walk`), to compare the two on one machine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table  # noqa: E402


def code_prompts(tok, n: int, length: int) -> list[list[int]]:
    from k3serve.workers.model.train.corpus import extract_functions, split_files, stdlib_files

    _train, _valid, held = split_files(stdlib_files())
    out = []
    for _path, text in held:
        for f in extract_functions(text):
            ids = tok.encode(f.prefix + f.header)
            if len(ids) >= length:
                out.append(ids[-length:])
                break  # one function per file: more variety
        if len(out) >= n:
            break
    if not out:
        raise SystemExit("no held-out standard-library function found (is the stdlib's source installed?)")
    return out


def entropy_prompts(tok, vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = getattr(tok, "num_base_tokens", vocab)
    return [[rng.randrange(base) for _ in range(length)] for _ in range(n)]


class Row:
    """One engine (one config) and what it measured."""

    def __init__(self, model: str, args, spec: dict | None, fused: bool = True):
        from k3serve.sampling_params import SamplingParams
        from k3serve.workers.llm import LLM

        self.spec = spec
        self.llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=1,
                       max_model_len=args.prompt_tokens + args.max_tokens + 8, speculative_config=spec)
        self.llm.engine.fused_spec_step = fused  # False: the two-wait greedy step (workers/engine/llm_engine.py)
        self.sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        self.rates: dict[str, list[float]] = {}
        self.toks: dict[str, list[list[int]]] = {}
        self.counts: dict[str, list[int]] = {}  # set -> [drafts, accepted, per position...]
        self.mtp_bytes = 0
        self.cpu_rates: dict[str, list[float]] = {}  # the same rate over the engine thread's CPU time
        self.steps: list[tuple[float, float]] = []  # per engine step: (monotonic start, thread CPU seconds)
        step = self.llm.engine.step

        def timed_step(step=step):
            cur = self._cur = {} if self._recording is not None else None
            t, c = time.monotonic(), time.thread_time()
            out = step()
            self.steps.append((t, time.thread_time() - c))
            if cur is not None:
                cur["wall"] = 1000 * (time.monotonic() - t)
                self.split.setdefault(self._recording, []).append(cur)
            self._cur = None
            return out

        self._recording: str | None = None

        self.llm.engine.step = timed_step
        self.split: dict[str, list[dict]] = {}  # set -> per engine step: where its time went (`_split_hooks`)
        self._cur: dict | None = None
        self._split_hooks(args.device.startswith("cuda"))
        prop = getattr(self.llm.engine, "proposer", None)
        if prop is not None and hasattr(prop, "cache_bytes"):  # the MTP cache's size when a request leaves
            drop = prop.drop

            def measured_drop(rid, prop=prop, drop=drop):
                self.mtp_bytes = max(self.mtp_bytes, prop.cache_bytes())
                drop(rid)

            prop.drop = measured_drop

    def _split_hooks(self, cuda: bool) -> None:
        """Per step: the forward (runner.execute) and the drafting (the proposer's observe + propose) timed on the
        device's stream (CUDA events: the stream time between two points, which is the kernels' time when the host
        keeps ahead, as with graph replays) or on the host clock (CPU); the rest of the step's wall time is host."""
        import torch

        eng = self.llm.engine

        def mark():
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                return e
            return time.perf_counter()

        execute = eng.runner.execute

        def timed_execute(sched, execute=execute):
            t0 = mark()
            out = execute(sched)
            if self._cur is not None:
                self._cur.update(fwd=(t0, mark()), verify=bool(sched.spec_token_ids),
                                 tokens=sum(len(c.token_ids) for c in sched.chunks))
            return out

        eng.runner.execute = timed_execute
        prop = getattr(eng, "proposer", None)
        if prop is None:
            return
        observe, propose = getattr(prop, "observe_batch", None), prop.propose_batch

        def timed_observe(items, observe=observe):
            if self._cur is not None:
                self._cur["draft0"] = mark()
            return observe(items)

        def timed_propose(reqs, propose=propose):
            if self._cur is not None and "draft0" not in self._cur:
                self._cur["draft0"] = mark()
            out = propose(reqs)
            if self._cur is not None:
                self._cur["draft1"] = mark()
            return out

        if observe is not None:
            prop.observe_batch = timed_observe
        prop.propose_batch = timed_propose
        fused = getattr(prop, "verify_and_draft", None)
        if fused is None:
            return

        def timed_fused(items, logits, hidden, fused=fused):  # acceptance + observe + drafts (one host wait)
            t0 = mark()
            out = fused(items, logits, hidden)
            if self._cur is not None:
                self._cur["draft0"], self._cur["draft1"] = t0, mark()
            return out

        prop.verify_and_draft = timed_fused

    def split_rows(self, set_name: str, cuda: bool) -> list[float]:
        """Medians over the decode-phase steps (after the first token) of: step wall ms, forward ms of verify
        steps, forward ms of plain decode steps, drafting ms, host ms (wall - forward - drafting)."""
        def ms(a, b):
            return a.elapsed_time(b) if cuda else 1000 * (b - a)

        steps = [d for d in self.split.get(set_name, []) if "fwd" in d and d["tokens"] <= 16]

        def med(xs):
            return round(statistics.median(xs), 3) if xs else float("nan")

        fwd = [ms(*d["fwd"]) for d in steps]
        draft = [ms(d["draft0"], d["draft1"]) if "draft1" in d else 0.0 for d in steps]
        wall = [d["wall"] for d in steps]
        return [len(steps), med(wall), med([f for f, d in zip(fwd, steps) if d["verify"]]),
                med([f for f, d in zip(fwd, steps) if not d["verify"]]), med(draft),
                med([w - f - g for w, f, g in zip(wall, fwd, draft)])]

    def warm_up(self, prompt: list[int]) -> None:
        """One whole request of the measured shape (on CUDA: every graph of batch 1 captured, the kernels
        compiled: the decode graph, say, is first needed only near max_tokens, where no lookahead fits), then
        the fixed-shape path counters are read so the summary counts the measured requests only."""
        self.llm.generate([prompt], self.sp)
        self.base_counts = self.path_counts()

    def path_counts(self) -> dict[str, int]:
        """Decode steps, verify steps and drafter calls on the fixed-shape (on CUDA: graph) paths so far."""
        runner = self.llm.engine.runner
        sv = getattr(runner, "static_verify", None)
        prop = getattr(self.llm.engine, "proposer", None)
        return dict(decode=runner.num_static_decode_steps, verify=sv.num_steps if sv is not None else 0,
                    replays=getattr(prop, "num_replays", 0), eager=getattr(prop, "num_eager", 0))

    def _spec_counts(self) -> list[int]:
        st = self.llm.engine.stats()
        if self.spec is None:
            return []
        return [st["spec_decode_num_drafts"], st["spec_decode_num_accepted_tokens"],
                *st["spec_decode_num_accepted_tokens_per_pos"]]

    def run(self, set_name: str, prompt: list[int], device: str) -> None:
        import torch

        before = self._spec_counts()
        self.steps.clear()
        self._recording = set_name
        out = self.llm.generate([prompt], self.sp)[0]
        self._recording = None
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        m, n = out.metrics, len(out.outputs[0].token_ids)
        dt = (m["last_token_time"] or 0) - (m["first_token_time"] or 0)
        self.rates.setdefault(set_name, []).append((n - 1) / dt if dt > 0 else float("nan"))
        # CPU time of the steps after the first token (the engine steps in this thread; steady on a shared CPU)
        cpu = sum(c for t, c in self.steps if t >= (m["first_token_time"] or 0))
        self.cpu_rates.setdefault(set_name, []).append((n - 1) / cpu if cpu > 0 else float("nan"))
        self.toks.setdefault(set_name, []).append(out.outputs[0].token_ids)
        after = self._spec_counts()
        acc = self.counts.setdefault(set_name, [0] * len(after))
        for i, (a, b) in enumerate(zip(after, before)):
            acc[i] += a - b

    def state_bytes(self) -> int:
        if self.spec is None:
            return 0
        return self.llm.engine.runner.rollback.state_bytes() + self.mtp_bytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set")
    ap.add_argument("--sets", default="code,entropy")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--ngram-ks", default=None,
                    help="comma-separated k for the ngram rows (default: --k), e.g. 3,5,7")
    ap.add_argument("--ngram-lookup", default="2:4", help="ngram prompt_lookup_min:prompt_lookup_max")
    ap.add_argument("--configs", default="mtp,recover,ngram",
                    help="rows besides the baseline: mtp (multi_slot, one-wait greedy step), mtp-two-wait (the "
                         "same with the step's acceptance on the host and the drafter after it), recover "
                         "(mtp, recover_ssm), ngram (multi_slot, one row per --ngram-ks)")
    ap.add_argument("--cprofile", default=None, metavar="CONFIG",
                    help="profile the measured requests of the row named CONFIG (e.g. 'mtp multi_slot') with "
                         "cProfile and print its 30 costliest functions (own time) after the tables")
    ap.add_argument("--kernel-profile", default=None, metavar="CONFIG",
                    help="on CUDA: torch.profiler over the measured requests of the row named CONFIG; prints the "
                         "30 kernels with the most device time (graph replays' kernels included) after the tables")
    ap.add_argument("--chunked-verify", action="store_true",
                    help="verify chunks through the chunked KDA forms (the paths before the CPU token walks)")
    args = ap.parse_args(argv)
    if args.chunked_verify:
        from k3serve.workers.engine.k3_forward import K3ForwardModel
        from k3serve.workers.engine.spec import recover_ssm

        K3ForwardModel._short_rows = staticmethod(lambda b: False)
        recover_ssm.WALK_MAX_TOKENS = 0  # RecoverSSM's verify: the chunked kda_recover_verify, not the token walk
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from k3serve.tokenizer import K3Tokenizer
    from k3serve.workers.model.config import K3Config
    from k3serve.workers.model.paths import default_serving_model

    model = args.model or str(default_serving_model())
    tok = K3Tokenizer.from_dir(model)
    vocab = K3Config.from_pretrained(model).vocab_size
    sets = {}
    for name in args.sets.split(","):
        if name == "code":
            sets["code"] = code_prompts(tok, args.prompts, args.prompt_tokens)
        elif name == "entropy":
            sets["entropy"] = entropy_prompts(tok, vocab, args.prompts, args.prompt_tokens)
        else:
            raise SystemExit(f"--sets: unknown set {name!r} (code, entropy)")
    k = args.k
    ngram_ks = [int(x) for x in args.ngram_ks.split(",")] if args.ngram_ks else [k]
    lo, hi = (int(x) for x in args.ngram_lookup.split(":"))
    mtp = {"method": "mtp", "num_speculative_tokens": k, "rollback": "multi_slot"}
    configs = [("baseline", None, True)]
    for name in args.configs.split(","):
        if name == "mtp":
            configs.append(("mtp multi_slot", mtp, True))
        elif name == "mtp-two-wait":
            configs.append(("mtp two-wait", mtp, False))
        elif name == "recover":
            configs.append(("mtp recover_ssm", dict(mtp, rollback="recover_ssm"), True))
        elif name == "ngram":
            configs += [(f"ngram multi_slot k={nk}" if args.ngram_ks else "ngram multi_slot",
                         {"method": "ngram", "num_speculative_tokens": nk, "prompt_lookup_min": lo,
                          "prompt_lookup_max": hi, "rollback": "multi_slot"}, True) for nk in ngram_ks]
        else:
            raise SystemExit(f"--configs: unknown config {name!r} (mtp, mtp-two-wait, recover, ngram)")
    kmax = max([k] + ngram_ks)
    print(f"model {model}, device {args.device}, dtype {args.dtype}, k={k}, batch 1, {args.prompts} prompts "
          f"x {args.prompt_tokens} tokens per set, {args.max_tokens} new tokens, greedy")
    headers = ["set", "config", "tok/s/user", "speedup", "cpu speedup", "accept len"] + [
        f"acc@{i}" for i in range(kmax)] + ["same", "spec state KiB"]
    engines = [(cname, Row(model, args, spec, fused)) for cname, spec, fused in configs]
    first = next(iter(sets.values()))[0]
    for _c, r in engines:
        r.warm_up(first)
    t0 = time.perf_counter()
    prof = None
    if args.cprofile is not None:
        import cProfile

        if args.cprofile not in {c for c, _r in engines}:
            raise SystemExit(f"--cprofile: no row {args.cprofile!r}")
        prof = cProfile.Profile()
    kprof = None
    if args.kernel_profile is not None:
        from torch.profiler import ProfilerActivity, profile

        if args.kernel_profile not in {c for c, _r in engines}:
            raise SystemExit(f"--kernel-profile: no row {args.kernel_profile!r}")
        kprof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        kprof_steps = 0
    for sname, prompts in sets.items():  # prompt by prompt, every config in turn (machine load drifts)
        for p in prompts:
            for c, r in engines:
                if c == args.cprofile:
                    prof.enable()
                if c == args.kernel_profile:
                    kprof.start()
                r.run(sname, p, args.device)
                if c == args.cprofile:
                    prof.disable()
                if c == args.kernel_profile:
                    kprof.stop()
                    kprof_steps += len(r.steps)  # (Row.run starts a request's step list afresh)
        print(f"  {sname}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    rows = []
    for sname, prompts in sets.items():
        base = engines[0][1]
        base_rate = statistics.mean(base.rates[sname])
        base_cpu = statistics.mean(base.cpu_rates[sname])
        for cname, r in engines:
            rate = statistics.mean(r.rates[sname])
            cpu_rate = statistics.mean(r.cpu_rates[sname])
            c = r.counts.get(sname) or []
            drafts = max(c[0], 1) if c else 1
            same = sum(a == b for a, b in zip(r.toks[sname], base.toks[sname]))
            rows.append([sname, cname, round(rate, 1), round(rate / base_rate, 2), round(cpu_rate / base_cpu, 2),
                         round(1 + c[1] / drafts, 2) if c else 1.0]
                        + ([round(x / drafts, 2) for x in c[2:]] + [""] * (kmax - len(c[2:])) if c else [""] * kmax)
                        + [f"{same}/{len(prompts)}", round(r.state_bytes() / 1024, 1)])
    print_table(headers, rows)
    cuda = args.device.startswith("cuda")
    print("\nWhere a decode-phase step's time goes (medians, ms; forward and drafting timed "
          + ("on the CUDA stream" if cuda else "on the host clock") + "; host = wall - forward - drafting):")
    rows = []
    for sname in sets:
        for cname, r in engines:
            rows.append([sname, cname, *r.split_rows(sname, cuda)])
    print_table(["set", "config", "steps", "step wall", "verify fwd", "decode fwd", "drafting", "host"], rows)
    print()
    print("measured requests only (after the warm-up request):")
    for cname, r in engines:  # verify steps, decode steps and drafter calls on the fixed-shape (graph) paths
        now, was = r.path_counts(), r.base_counts
        d = {key: now[key] - was[key] for key in now}
        decode_steps = sum(1 for x in r.split.values() for s in x if "fwd" in s and not s["verify"]
                           and s["tokens"] <= 16)
        sv = getattr(r.llm.engine.runner, "static_verify", None)
        steps = sum(c[0] for c in r.counts.values() if c) if r.spec is not None else 0
        line = (f"{cname}: {d['decode']} of {decode_steps} decode-phase plain decode steps on the fixed-shape "
                f"{'graph' if cuda else 'batch'} path")
        if r.spec is not None:
            line += (f"; {d['verify']} of {steps} verify steps"
                     + ("" if sv is None or sv.enabled else " (verify graphs switched off: see the warning)"))
            if hasattr(r.llm.engine.proposer, "num_replays"):
                line += f"; drafter calls: {d['replays']} graph replays, {d['eager']} eager"
        print(line)

    if kprof is not None:
        print(f"\nKernels of {args.kernel_profile!r} ({kprof_steps} engine steps; device time):")
        table = None
        for key in ("self_device_time_total", "self_cuda_time_total"):
            try:
                table = kprof.key_averages().table(sort_by=key, row_limit=30)
                break
            except (KeyError, AttributeError, ValueError):
                continue
        print(table)
    if prof is not None:
        import pstats

        print(f"\ncProfile of {args.cprofile!r} (its measured requests; own time):")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
