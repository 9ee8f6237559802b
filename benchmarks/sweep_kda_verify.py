"""One KDA layer of a speculative verify step: the short-chunk kernel against the paths it replaces, in one run.

    PYTHONSAFEPATH=1 python3 benchmarks/sweep_kda_verify.py                      # on a GPU, < 60 s on an H200
    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/sweep_kda_verify.py --k 3     # CPU: the check only (every op
                                                                                 # under Triton's interpreter)

B requests of T = 1 + k tokens each (the static verify batch: workers/engine/spec/static_verify.py), bf16
activations, fp32 states, multi-slot exports after 1..k tokens into k private blocks per request, and the
layer's gated output norm; per (shape, B, k), in the same run:
  * ours:     ops.kda_verify with gate + o_norm_weight: kernels/triton/kda_verify.py, one launch, no host
              sync; timed as a CUDA graph of 8 layers (us per layer, as the engine replays it) and eagerly;
  * chunked:  the path before it (workers/engine/k3_forward.py's general KDA branch): the short conv with
              exports, the gate, kda_chunked with exports, rms_norm, the output gate; eager (its chunk plan
              reads cu_seqlens and the slots back to the host, so it cannot be captured);
  * decode:   T plain one-token steps of the fused decode kernel (ops.kda_decode) in a CUDA graph, the cost of
              producing the same T tokens without speculation (no exports).
Before timing, ours is checked against the chunked path on the same inputs (output, states, windows).
"x chunked" = chunked eager / ours eager; "x decode" = T decode steps / ours (both graphs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():  # the Triton kernels under the interpreter (set before triton loads): a check
    os.environ.setdefault("TRITON_INTERPRET", "1")  # of the script and the kernel, not a speed figure
    os.environ.setdefault("K3SERVE_KERNELS", "triton")

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table  # noqa: E402

from k3serve.kernels import ops  # noqa: E402

SHAPES = {"small": (2, 16), "demo": (3, 64), "k3": (32, 128)}  # (KDA heads per rank, head dim)
CONV_K = 4
LAYERS = 8  # calls per captured graph


def _inputs(H, d, B, k, dev, dt, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, C = 1 + k, 3 * H * d

    def rnd(*shape, dtype=dt, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dtype)

    nslots = B * (1 + k)
    x = dict(qkv=rnd(B * T, C), conv_weight=rnd(C, CONV_K, dtype=torch.float32, scale=0.5),
             conv_states=rnd(nslots, C, CONV_K - 1), raw_g=rnd(B * T, H, d),
             A_log=rnd(H, dtype=torch.float32, scale=0.3), dt_bias=rnd(H * d, dtype=torch.float32, scale=0.3),
             beta_logit=rnd(B * T, H), state_pool=rnd(nslots, H, d, d, dtype=torch.float32, scale=0.1),
             state_indices=torch.arange(B, device=dev), cu_seqlens=torch.arange(B + 1, device=dev) * T,
             has_initial_state=torch.ones(B, dtype=torch.bool, device=dev))
    ck = dict(checkpoint_seq=torch.arange(B, device=dev).repeat_interleave(k),
              checkpoint_offsets=torch.arange(1, T, device=dev).repeat(B),
              checkpoint_slots=B + torch.arange(B * k, device=dev))
    gate, onw = rnd(B * T, H * d), rnd(d, dtype=torch.float32, scale=0.2) + 1.0
    return x, ck, gate, onw


def _ours(x, ck, gate, onw, d):
    return ops.kda_verify(*x.values(), lower_bound=-5.0, scale=d ** -0.5, **ck, gate=gate, o_norm_weight=onw)


def _chunked(x, ck, gate, onw, d):
    T, H, _ = x["raw_g"].shape
    y = ops.causal_conv1d_varlen(x["qkv"], x["conv_weight"], x["conv_states"], x["state_indices"], x["cu_seqlens"],
                                 x["has_initial_state"], activation="silu", **ck)
    q, k, v = (t.reshape(T, H, d) for t in y.split(H * d, dim=-1))
    g = ops.kda_gate(x["raw_g"], x["A_log"], x["dt_bias"], -5.0)
    beta = torch.sigmoid(x["beta_logit"].float())
    o = ops.kda_chunked(q, k, v, g, beta, x["state_pool"], x["state_indices"], x["cu_seqlens"],
                        x["has_initial_state"], scale=d ** -0.5, use_qk_l2norm=True, **ck)
    o = ops.rms_norm(o.float(), onw, 1e-5)
    return (o * torch.sigmoid(gate.view(T, H, d).float())).to(x["qkv"].dtype)


def _decode_steps(x, gate, onw, d, B, T):
    """T one-token decode steps of the same B requests (the plain decode graph's KDA layer, T times)."""
    rows = [torch.arange(B, device=x["qkv"].device) * T + t for t in range(T)]
    per = [(x["qkv"][r].contiguous(), x["raw_g"][r].contiguous(), x["beta_logit"][r].contiguous(),
            gate[r].contiguous()) for r in rows]

    def run():
        for qkv, rg, bl, gt in per:
            ops.kda_decode(qkv, x["conv_weight"], x["conv_states"], rg, x["A_log"], x["dt_bias"], bl, gt, onw,
                           x["state_pool"], x["state_indices"], x["has_initial_state"], lower_bound=-5.0,
                           scale=d ** -0.5)
    return run


def _time_eager(fn, iters, cuda):
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def _time_graph(fn, iters):
    """us per call of `fn` replayed LAYERS times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    return _time_eager(graph.replay, iters, True) / LAYERS


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def case(name, B, k, dev, dt, iters):
    H, d = SHAPES[name]
    T = 1 + k
    cuda = dev.type == "cuda"
    x, ck, gate, onw = _inputs(H, d, B, k, dev, dt)
    # the check: ours == the chunked path on the same inputs
    xa = {n: t.clone() for n, t in x.items()}
    xb = {n: t.clone() for n, t in x.items()}
    oa, ob = _ours(xa, ck, gate, onw, d), _chunked(xb, ck, gate, onw, d)
    err = max(_rel(oa, ob), _rel(xa["state_pool"], xb["state_pool"]), _rel(xa["conv_states"], xb["conv_states"]))
    if err > 2e-2:
        raise SystemExit(f"{name} B={B} k={k}: kda_verify differs from the chunked path (rel {err:.3g})")
    t_eager = _time_eager(lambda: _ours(x, ck, gate, onw, d), iters, cuda)
    t_chunk = _time_eager(lambda: _chunked(x, ck, gate, onw, d), iters, cuda)
    if cuda:
        t_graph = _time_graph(lambda: _ours(x, ck, gate, onw, d), iters)
        t_dec = _time_graph(_decode_steps(x, gate, onw, d, B, T), iters)
    else:
        t_graph = t_dec = float("nan")
    return [name, H, d, B, k, f"{err:.1e}", t_graph, t_eager, t_chunk, t_dec, t_chunk / t_eager, t_dec / t_graph]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--batch", default=None, help="comma list of batch sizes")
    ap.add_argument("--k", default="3,7", help="comma list of draft counts")
    ap.add_argument("--iters", type=int, default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    shapes = (a.shapes or ("demo,k3" if cuda else "small")).split(",")
    batches = [int(b) for b in (a.batch or ("1,8,64" if cuda else "1")).split(",")]
    iters = a.iters or (50 if cuda else 2)
    rows = []
    for name in shapes:
        for B in batches:
            for k in [int(v) for v in a.k.split(",")]:
                rows.append(case(name, B, k, dev, dt, iters))
                print("# " + " ".join(str(c) for c in rows[-1]), file=sys.stderr, flush=True)
    print(f"# device {dev} ({torch.cuda.get_device_name(dev) if cuda else 'cpu, Triton interpreter'}), "
          f"activations {dt}, one KDA layer, median of {iters}, us")
    print_table(["shape", "H", "d", "batch", "k", "check", "ours graph", "ours eager", "chunked eager",
                 "decode x T graph", "x chunked", "x decode"], rows)


if __name__ == "__main__":
    main()
