"""Communication volume per layer of TP vs sequence-parallel TEP, and the CPU overhead of a step on N ranks vs 1.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/parallel_comm.py [--tokens 128] [--k3-tokens 2048] [--ranks 8]
                                                                  [--steps 8] [--overhead-ranks 2,4]

Every byte below is counted from the shapes passed to the collectives actually issued: RankGroup
(workers/engine/parallel/group.py) records (name, shape, itemsize) of each call when its `log` is a list.
Bytes per rank on the wire, ring algorithms: all-reduce 2(N-1)/N x n, reduce-scatter (N-1)/N x n (n = its
input), all-gather (N-1) x n (n = one rank's piece), all-to-all exactly the rows this rank sends to other
ranks (the log records those).

1. Measured on a small random model (random_config(27): KDA + MLA, LatentMoE with shared experts): one
   prefill step of TP=2 + EP (the MoE combined by one all-reduce) and of TEP+SP (TP=2 + EP + sequence
   parallelism: workers/engine/parallel/seq_parallel.py), the collectives rank 0 issues, labelled by the
   formulas `tp_collectives` / `sp_collectives` of the config (checked against the log: the all-to-all
   shapes depend on the routing, so only their names and column counts are checked).
2. K3's dimensions (hidden 7168, latent 3584, 16 of 896 experts, bf16), ONE MoE layer, T tokens, N ranks:
   N real gloo ranks (threads of this process) issue the layer's collectives with K3's shapes — TP: the
   all-reduce after attention and ours of [T, latent + H] (vLLM's TP MoE reduces [T, H] instead: the
   baseline row, also issued); TEP+SP: the reduce-scatter after o_proj, the all-to-all dispatch (counts,
   then latent tokens with their routing metadata) and combine of workers/engine/parallel/moe_a2a.py with K3's router
   (sigmoid top-16, renormalized) over random logits, the all-gather before the next QKV. The experts are
   not computed (no 896 experts are loaded): the combine sends back rows of the received shape, which is
   what the expert output is. Mean and max over the ranks; "vs the claim" = whether TEP+SP moves less.
3. CPU overhead: wall time per decode step (as many running requests as the most ranks, so TEP+SP shards
   them: a step with fewer tokens than ranks runs the replicated TP step) and per prefill step (--tokens
   tokens) of the random model on 1 rank vs TP+EP and TEP+SP on 2 and 4 ranks, in the same run, every rank with
   --threads torch threads (default 1: OMP_NUM_THREADS before torch loads, and K3SERVE_RANK_THREADS, which
   every rank applies, workers/engine/parallel/threads.py; ranks that each take every core oversubscribe
   them, and OpenMP then runs 10-40x slower on a loaded 2-core machine). The ranks share this machine's few cores and talk over loopback gloo, so the
   ratios are the cost of the pipe and the collectives here (noisy, not a GPU figure).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table  # noqa: E402

SEED = 27  # random_config(27): KDA + MLA, LatentMoE with shared experts, 16 experts: shardable over 2 and 4 ranks
K3 = dict(H=7168, lat=3584, E=896, k=16)
MIB = 1 / (1 << 20)


def tp_collectives(cfg, T: int, n: int, S: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """The collectives one prefill step issues on a TP rank: (where, name, shape), in order."""
    H = cfg.hidden_size
    out = [("embedding", "all_reduce", (T, H))]  # vocab-parallel embedding
    for i in range(cfg.num_hidden_layers):
        out.append((f"layer {i} attn", "all_reduce", (T, H)))  # attention output (row-parallel o_proj)
        if cfg.is_moe_layer(i) and cfg.routed_expert_hidden_size and cfg.num_shared_experts:
            out.append((f"layer {i} moe", "all_reduce", (T, cfg.routed_expert_hidden_size + H)))
        elif cfg.is_moe_layer(i) and cfg.routed_expert_hidden_size:
            out.append((f"layer {i} moe", "all_reduce", (T, cfg.routed_expert_hidden_size)))
        else:
            out.append((f"layer {i} mlp", "all_reduce", (T, H)))
    out.append(("lm head", "all_gather", (S, -(-cfg.vocab_size // n))))  # LM head slices
    return out


def sp_collectives(cfg, T: int, n: int, S: int, item: int = 4) -> list[tuple[str, str, tuple[int, ...] | None]]:
    """The collectives one prefill step issues on a TEP+SP rank; an all-to-all's rows depend on the routing
    (None), its columns do not (the shape is (None, cols)); the dispatch moves bytes: a token's `item`-byte
    values, then its k slots and k weights as float64 (workers/engine/parallel/moe_a2a.py)."""
    H, s = cfg.hidden_size, -(-T // n)
    k, lat = cfg.num_experts_per_token, cfg.routed_expert_hidden_size or cfg.hidden_size
    out = [("embedding", "reduce_scatter", (n * s, H))]
    for i in range(cfg.num_hidden_layers):
        out += [(f"layer {i} attn in", "all_gather", (s, H)), (f"layer {i} attn out", "reduce_scatter", (n * s, H))]
        if cfg.is_moe_layer(i):
            out += [(f"layer {i} moe counts", "all_to_all", (None,)),
                    (f"layer {i} moe dispatch", "all_to_all", (None, lat * item + 16 * k)),
                    (f"layer {i} moe combine", "all_to_all", (None, lat))]
        else:
            out += [(f"layer {i} mlp in", "all_gather", (s, H)), (f"layer {i} mlp out", "reduce_scatter", (n * s, H))]
    out += [("lm head rows", "all_reduce", (S, H)), ("lm head", "all_gather", (S, -(-cfg.vocab_size // n)))]
    return out


def wire_bytes(name: str, numel: int, item: int, n: int) -> float:
    b = numel * item
    if name == "all_reduce":
        return 2 * (n - 1) / n * b
    if name == "reduce_scatter":
        return (n - 1) / n * b
    if name == "all_gather":  # numel = this rank's piece
        return (n - 1) * b
    if name == "all_to_all":  # numel = the rows sent to other ranks (group.py records those)
        return b
    raise ValueError(name)


def _numel(shape) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


def _matches(want, log) -> bool:
    if len(want) != len(log):
        return False
    for (_where, name, shape), (got_name, got_shape, _item) in zip(want, log):
        if name != got_name or len(shape) != len(got_shape):
            return False
        if any(w is not None and w != g for w, g in zip(shape, got_shape)):
            return False
    return True


def _table(title: str, want, log, n: int) -> float:
    rows, total = [], 0.0
    for (where, _name, _shape), (name, shape, item) in zip(want, log):
        wire = wire_bytes(name, _numel(shape), item, n)
        total += wire
        rows.append([where, name, "x".join(map(str, shape)), item, _numel(shape) * item, int(wire)])
    print(title)
    print_table(["where", "collective", "shape", "itemsize", "payload B", "wire B/rank"], rows)
    return total


def measured(d: Path, cfg, tokens: int) -> None:
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM

    opts = _opts(tokens)
    prompt = [(7 * i) % cfg.vocab_size for i in range(tokens)]
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    totals = {}
    for label, extra, formula in (("TP=2 + EP", {}, tp_collectives),
                                  ("TEP+SP (TP=2 + EP + SP)", {"enable_sequence_parallel": True}, sp_collectives)):
        llm = LLM(str(d), tensor_parallel_size=2, enable_expert_parallel=True, **extra, **opts)
        try:
            group = llm.engine.runner.group
            group.log = []
            llm.generate([prompt], sp)
            log, group.log = group.log, None
        finally:
            llm.engine.runner.close()
        want = formula(cfg, tokens, 2, 1)
        totals[label] = _table(f"\n1. measured: {label}, one {tokens}-token prefill step, random_config({SEED}), "
                               "rank 0's collectives", want, log, 2)
        print(f"formula {formula.__name__}() == measured shapes: {_matches(want, log)}")
    a, b = totals.values()
    print(f"step total wire B/rank: TP+EP {a:.0f}, TEP+SP {b:.0f}, ratio TEP+SP / TP+EP {b / a:.3f}")


def _run_ranks(n: int, fn):
    """fn(group) on n gloo ranks of one group (threads of this process), results in rank order."""
    from k3serve.workers.engine.parallel.group import RankGroup, host_store, join_store

    store = host_store(n, 120)
    out, errors = [None] * n, []

    def rank(r):
        try:
            out[r] = fn(RankGroup(store if r == 0 else join_store(store.port, n, 120), r, n, 120))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def k3_layer(T: int, n: int) -> None:
    import torch

    from k3serve.kernels import ops
    from k3serve.workers.engine.parallel.moe_a2a import combine, dispatch
    from k3serve.workers.engine.parallel.shard import ExpertMap

    H, lat, E, k = K3["H"], K3["lat"], K3["E"], K3["k"]
    if E % n:
        raise SystemExit(f"--ranks {n}: K3's {E} experts do not split over {n} ranks")
    s = -(-T // n)
    emap = ExpertMap.contiguous(E, n)
    bf = torch.bfloat16

    def layer(group):
        g = torch.Generator().manual_seed(group.rank)
        logs = {}
        group.log = []  # TP, vLLM's two all-reduces of [T, H]
        group.all_reduce(torch.zeros(T, H, dtype=bf))
        group.all_reduce(torch.zeros(T, H, dtype=bf))
        logs["tp2"], group.log = group.log, []  # ours: the MoE all-reduce carries [latent partial | shared partial]
        group.all_reduce(torch.zeros(T, H, dtype=bf))
        group.all_reduce(torch.zeros(T, lat + H, dtype=bf))
        logs["ours"], group.log = group.log, []  # TEP+SP
        group.reduce_scatter(torch.zeros(n * s, H, dtype=bf))
        real = max(0, min(s, T - group.rank * s))
        w, ids = ops.moe_route(torch.randn(s, E, generator=g), torch.zeros(E), k, scoring="sigmoid", renormalize=True)
        ids[real:] = -1  # pad rows of the last shard go nowhere
        d = dispatch(group, torch.zeros(s, lat, dtype=bf), w, ids, emap)
        combine(group, d, d.tokens)  # the expert output has the received rows' shape [R, lat]
        group.all_gather_cat(torch.zeros(s, H, dtype=bf), dim=0)
        logs["sp"], group.log = group.log, None
        return {key: sum(wire_bytes(nm, _numel(sh), it, n) for nm, sh, it in lg) for key, lg in logs.items()}, logs["sp"]

    res = _run_ranks(n, layer)
    per = {key: [r[0][key] for r in res] for key in ("tp2", "ours", "sp")}
    mean = {key: sum(v) / n for key, v in per.items()}
    base = mean["tp2"]
    print(f"\n2. K3 dimensions, one MoE layer, T={T} tokens, N={n} ranks, bf16: collectives issued on {n} gloo "
          "ranks (wire MiB per rank)")
    print_table(["layout", "collectives", "MiB/rank mean", "MiB/rank max", "ratio vs TP (2 AR [T,H])"], [
        ["TP, 2 all-reduces of [T,H] (baseline)", "AR + AR", mean["tp2"] * MIB, max(per["tp2"]) * MIB, 1.0],
        ["ours: TP, AR [T,H] + AR [T,lat+H]", "AR + AR", mean["ours"] * MIB, max(per["ours"]) * MIB,
         mean["ours"] / base],
        ["TEP+SP (implemented)", "RS + A2A x3 + AG", mean["sp"] * MIB, max(per["sp"]) * MIB, mean["sp"] / base],
    ])
    rank0: dict[str, float] = {}
    for nm, sh, it in res[0][1]:
        rank0[nm] = rank0.get(nm, 0.0) + wire_bytes(nm, _numel(sh), it, n)
    distinct = n * (1 - (1 - 1 / n) ** k)
    print("   TEP+SP parts on rank 0 (MiB): " + ", ".join(f"{nm} {b * MIB:.2f}" for nm, b in rank0.items())
          + f"; uniform routing expects a token on {distinct:.2f} of {n} ranks")
    print(f"   vs the claim that TEP+SP moves less than TP's two all-reduces: "
          f"{'holds' if mean['sp'] < base else 'does NOT hold'} here ({mean['sp'] / base:.3f}x)")


def _opts(tokens: int) -> dict:
    return dict(dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=max(tokens, 64),
                max_model_len=max(tokens + 64, 256))


def _decode_step_time(llm, prompt: list[int], steps: int, batch: int) -> float:
    from k3serve.sampling_params import SamplingParams

    eng = llm.engine
    for r in range(batch):
        eng.add_request(f"bench-{r}", [(t + r) % 50 for t in prompt],
                        SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True))
    eng.step()  # prefill
    eng.step()
    times = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _prefill_step_time(llm, prompt: list[int], reps: int) -> float:
    from k3serve.sampling_params import SamplingParams

    eng = llm.engine
    times = []
    for r in range(reps):
        eng.add_request(f"prefill-{r}", [(t + r) % 50 for t in prompt],
                        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
        while eng.has_unfinished_requests():
            eng.step()
    times.sort()
    return times[len(times) // 2]


def overhead(d: Path, cfg, tokens: int, steps: int, ranks: list[int]) -> None:
    from k3serve.workers.llm import LLM

    opts = _opts(tokens)
    prompt = [(7 * i) % cfg.vocab_size for i in range(tokens)]
    layouts = [("1 rank", 1, {})]
    for n in ranks:
        layouts += [(f"TP+EP {n}", n, dict(tensor_parallel_size=n, enable_expert_parallel=True)),
                    (f"TEP+SP {n}", n, dict(tensor_parallel_size=n, enable_expert_parallel=True,
                                            enable_sequence_parallel=True))]
    rows, batch = [], max([1, *ranks])
    for label, n, extra in layouts:
        llm = LLM(str(d), **extra, **opts)
        try:
            dec = _decode_step_time(llm, prompt[:16], steps, batch)
            pre = _prefill_step_time(llm, prompt, max(3, steps // 2))
        finally:
            if n > 1:
                llm.engine.runner.close()
        rows.append([label, n, dec * 1e3, pre * 1e3])
    one_dec, one_pre = rows[0][2], rows[0][3]
    import torch

    print(f"\n3. CPU overhead per step, random_config({SEED}), same run ({os.cpu_count()} CPUs shared by all ranks, "
          f"{torch.get_num_threads()} torch thread(s) per rank: noisy, a CPU/gloo figure)")
    print_table(["layout", "ranks", f"decode ms/step ({batch} req)", "ratio vs 1 rank", f"{tokens}-token prefill ms",
                 "ratio vs 1 rank"],
                [[lab, n, dec, dec / one_dec, pre, pre / one_pre] for lab, n, dec, pre in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="prefill tokens of the measured and timed steps")
    p.add_argument("--k3-tokens", type=int, default=2048, help="tokens of the K3-dimension layer")
    p.add_argument("--ranks", type=int, default=8, help="ranks of the K3-dimension layer")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed")
    p.add_argument("--overhead-ranks", default="2,4", help="rank counts of the CPU-overhead table, comma-separated")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (OMP_NUM_THREADS)")
    a = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # before torch loads; spawned ranks inherit it
    os.environ["K3SERVE_RANK_THREADS"] = str(a.threads)  # every rank's count (workers/engine/parallel/threads.py)
    import torch

    torch.set_num_threads(a.threads)

    from k3serve.workers.model.testing import write_random_model

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "m"
        cfg, _ = write_random_model(d, seed=SEED, dtype=torch.float32)
        measured(d, cfg, a.tokens)
        k3_layer(a.k3_tokens, a.ranks)
        overhead(d, cfg, a.tokens, a.steps, [int(x) for x in a.overhead_ranks.split(",") if x])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
