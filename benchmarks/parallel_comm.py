"""Communication volume per layer of tensor parallelism, and the CPU overhead of a step on N ranks vs 1.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/parallel_comm.py [--tokens 8192] [--ranks 8] [--steps 8]

1. Measured: a TP=2 engine (workers/engine/parallel/) on a small random LatentMoE model runs one prefill
   step with rank 0's RankGroup recording every collective it issues (name, shape, itemsize); the bytes
   per layer come from those shapes, and `tp_collectives` (the same shapes as a formula of the config)
   is checked against them.
2. At K3's dimensions (hidden 7168, latent 3584, 2 shared experts, top-16 of 896, bf16), per MoE layer
   and T tokens: ours (TP: one all-reduce of [T, H] after attention, one of [T, latent + H] for the
   latent partial and the shared experts' partial) against sequence-parallel TEP (reduce-scatter after
   o_proj, all-to-all dispatch and combine of the latent token, all-gather before the next QKV). TEP is
   NOT implemented here: its row is the analytical volume of that scheme under uniform routing (each
   token's latent goes once to every other rank holding one of its 16 experts), labelled as such.
   Bytes are per rank on the wire with ring algorithms: all-reduce 2(N-1)/N x n, reduce-scatter and
   all-to-all (N-1)/N x n, all-gather (N-1)/N x n of the gathered n.
3. CPU overhead: wall time per decode step of the same model, TP=2 vs TP=1, measured in the same run
   (2 CPU ranks on this machine's shared cores; the ratio is the cost of the pipe + gloo round trips).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table  # noqa: E402

SEED = 77  # random_config(77): KDA + MLA, dense and LatentMoE layers with shared experts, 2-shardable


def tp_collectives(cfg, T: int, n: int, S: int) -> list[tuple[str, tuple[int, ...]]]:
    """The collectives one prefill step issues on a TP rank: (name, shape), in order."""
    H = cfg.hidden_size
    out = [("all_reduce", (T, H))]  # vocab-parallel embedding
    for i in range(cfg.num_hidden_layers):
        out.append(("all_reduce", (T, H)))  # attention output (row-parallel o_proj)
        if cfg.is_moe_layer(i) and cfg.routed_expert_hidden_size and cfg.num_shared_experts:
            out.append(("all_reduce", (T, cfg.routed_expert_hidden_size + H)))
        elif cfg.is_moe_layer(i) and cfg.routed_expert_hidden_size:
            out.append(("all_reduce", (T, cfg.routed_expert_hidden_size)))
        else:
            out.append(("all_reduce", (T, H)))
    out.append(("all_gather", (S, -(-cfg.vocab_size // n))))  # LM head slices
    return out


def wire_bytes(name: str, numel: int, item: int, n: int) -> float:
    b = numel * item
    if name == "all_reduce":
        return 2 * (n - 1) / n * b
    if name in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n * b
    if name == "all_gather":  # numel = this rank's piece
        return (n - 1) * b
    raise ValueError(name)


def measured(tokens: int, steps: int) -> None:
    import torch

    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM
    from k3serve.workers.model.testing import write_random_model

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "m"
        cfg, _ = write_random_model(d, seed=SEED, dtype=torch.float32)
        opts = dict(dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=max(tokens, 64),
                    max_model_len=max(tokens + steps + 8, 256))
        prompt = [(7 * i) % cfg.vocab_size for i in range(tokens)]
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        tp = LLM(str(d), tensor_parallel_size=2, **opts)
        try:
            group = tp.engine.runner.group
            group.log = []
            tp.generate([prompt], sp)
            log, group.log = group.log, None
            want = tp_collectives(cfg, tokens, 2, 1)
            got = [(name, shape) for name, shape, _item in log]
            rows = []
            per_layer = 2 if cfg.num_hidden_layers else 0
            for k, (name, shape, item) in enumerate(log):
                where = ("embedding" if k == 0 else "lm head" if k == len(log) - 1
                         else f"layer {(k - 1) // per_layer} {'attn' if (k - 1) % per_layer == 0 else 'mlp/moe'}")
                rows.append([where, name, "x".join(map(str, shape)), item,
                             int(torch.Size(shape).numel() * item), int(wire_bytes(name, torch.Size(shape).numel(),
                                                                                   item, 2))])
            print(f"1. measured: collectives of one {tokens}-token prefill step, TP=2, random_config({SEED})")
            print_table(["where", "collective", "shape", "itemsize", "payload B", "wire B/rank"], rows)
            print(f"formula tp_collectives() == measured shapes: {got == want}")
            step_tp = _decode_step_time(tp, prompt[:16], steps)
        finally:
            tp.engine.runner.close()
        one = LLM(str(d), **opts)
        step_one = _decode_step_time(one, prompt[:16], steps)
    print("\n3. CPU overhead per decode step (one running request), same model, same run")
    print_table(["ranks", "ms/step", "ratio vs 1 rank"], [[1, step_one * 1e3, 1.0], [2, step_tp * 1e3, step_tp / step_one]])


def _decode_step_time(llm, prompt: list[int], steps: int) -> float:
    from k3serve.sampling_params import SamplingParams

    eng = llm.engine
    eng.add_request("bench", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True))
    eng.step()  # prefill
    eng.step()
    times = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def k3_table(tokens: int, ranks: int) -> None:
    H, lat, k, item, n, T = 7168, 3584, 16, 2, ranks, tokens
    distinct = n * (1 - (1 - 1 / n) ** k)  # expected ranks holding >= 1 of a token's 16 experts (uniform)
    remote = distinct * (n - 1) / n  # of which not the token's own rank
    tp_rows = [("all_reduce", T * H), ("all_reduce", T * (lat + H))]
    tp_wire = sum(wire_bytes(nm, x, item, n) for nm, x in tp_rows)
    classic = 2 * wire_bytes("all_reduce", T * H, item, n)
    tep_rs = wire_bytes("reduce_scatter", T * H, item, n)
    tep_a2a = 2 * (T / n) * remote * lat * item  # dispatch + combine of the latent, per rank
    tep_ag = wire_bytes("all_gather", (T // n) * H, item, n)
    tep = tep_rs + tep_a2a + tep_ag
    mib = 1 / (1 << 20)
    print(f"\n2. K3 dimensions, one MoE layer, T={T} tokens, N={n} ranks, bf16 (wire MiB per rank)")
    print_table(["layout", "collectives", "MiB/rank", "ratio vs TP (2 all-reduce [T,H])"], [
        ["TP, 2 all-reduces of [T,H] (baseline)", "AR + AR", classic * mib, 1.0],
        ["ours: TP, AR [T,H] + AR [T,lat+H]", "AR + AR", tp_wire * mib, tp_wire / classic],
        ["TEP+SP (analytical, not implemented)", "RS + A2A x2 + AG", tep * mib, tep / classic],
    ])
    print(f"   TEP parts: reduce-scatter {tep_rs * mib:.1f}, all-to-all {tep_a2a * mib:.1f} "
          f"(a token reaches {distinct:.2f} ranks), all-gather {tep_ag * mib:.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="prefill tokens of the measured step")
    p.add_argument("--k3-tokens", type=int, default=8192, help="tokens of the K3-dimension table")
    p.add_argument("--ranks", type=int, default=8, help="ranks of the K3-dimension table")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed")
    a = p.parse_args(argv)
    measured(a.tokens, a.steps)
    k3_table(a.k3_tokens, a.ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
