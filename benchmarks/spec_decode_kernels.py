"""KDA rollback for speculative decoding: verify + commit cost and state memory of both schemes, per layer.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/spec_decode_kernels.py            # CPU, small shapes
    PYTHONSAFEPATH=1 python3 benchmarks/spec_decode_kernels.py --shapes demo,k3     # on a GPU

One KDA layer's speculative step for B requests with k drafts each (T = 1 + k tokens per request), in
the same run:
  * multi_slot (workers/engine/spec/rollback.py, design 6.1): the short conv and the chunked delta rule
    over the T tokens, exporting conv window + state after tokens 1..T-1 into k private blocks per request
    (the in-pass checkpoint path), then the commit: copy the accepted block into the running one;
  * recover_ssm (workers/engine/spec/recover_ssm.py, 6.2): the conv on a copy of the running windows and
    kernels/kda_recover.py's verify (records the corrections, writes no state), then the commit of all
    requests (`kda_recover_commit_rows`: the gate recomputed from the recorded raw gate, the state fold
    and the conv window of the accepted prefix; two Triton launches on CUDA);
  * baseline: the same layer's plain decode step of one token per request (conv + delta rule, no drafts).
Accepted lengths are drawn uniformly in 1..T per request (fixed seed). Times are medians (CUDA events on
a GPU); "x multi" is multi_slot's time over the scheme's. State memory = the speculation-only bytes one
request holds per KDA layer (multi_slot: k conv windows + k states; recover_ssm: the side buffers, T
tokens of corrections + key|gate + raw conv inputs), measured from the tensors allocated here.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table  # noqa: E402

from k3serve.kernels import ops  # noqa: E402
from k3serve.kernels.kda_recover import kda_recover_commit_rows, kda_recover_verify  # noqa: E402

SHAPES = {"demo": (3, 64), "small": (2, 16), "k3": (32, 128)}  # (KDA heads per rank, head dim)
CONV_K = 4


def _timer(dev):
    if dev.type == "cuda":
        def run(fn, iters):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            return statistics.median(times)
    else:
        def run(fn, iters):
            fn()
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e6)
            return statistics.median(times)
    return run


def case(H, d, B, k, dev, dt, iters, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, C = 1 + k, 3 * H * d
    sdt = torch.float64 if dt == torch.float64 else torch.float32

    def rnd(*shape, dtype=dt, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dtype)

    x = rnd(B * T, C)
    raw_g = rnd(B * T, H, d)
    b_logit = rnd(B * T, H)
    conv_w = rnd(C, CONV_K, dtype=sdt, scale=0.5)
    A_log, dt_bias = rnd(H, dtype=sdt, scale=0.3), rnd(H * d, dtype=sdt, scale=0.3)
    nslots = B * (1 + k)
    ssm = rnd(nslots, H, d, d, dtype=sdt, scale=0.1)
    conv = rnd(nslots, C, CONV_K - 1)
    run_slots = torch.arange(B, device=dev)
    spec_slots = B + torch.arange(B * k, device=dev).view(B, k)  # multi_slot's k private blocks per request
    cu = torch.arange(B + 1, device=dev) * T
    init = torch.ones(B, dtype=torch.bool, device=dev)
    rng = random.Random(seed)
    accepted = [rng.randint(1, T) for _ in range(B)]
    ck_seq = torch.arange(B, device=dev).repeat_interleave(k)
    ck_off = torch.arange(1, T, device=dev).repeat(B)
    ck_slots = spec_slots.reshape(-1)
    src = torch.tensor([B + r * k + a - 1 if a < T else r for r, a in enumerate(accepted)], device=dev)
    need = torch.tensor([a < T for a in accepted], device=dev)
    src, dst = src[need], run_slots[need]

    def qkvgb(y, rg, bl):
        q, kk, v = (t.reshape(-1, H, d) for t in y.split(H * d, dim=-1))
        return q, kk, v, ops.kda_gate(rg, A_log, dt_bias, -5.0), torch.sigmoid(bl.to(sdt))

    def multi_slot():
        y = ops.causal_conv1d_varlen(x, conv_w, conv, run_slots, cu, init, activation="silu",
                                     checkpoint_seq=ck_seq, checkpoint_offsets=ck_off, checkpoint_slots=ck_slots)
        q, kk, v, gg, beta = qkvgb(y, raw_g, b_logit)
        ops.kda_chunked(q, kk, v, gg, beta, ssm, run_slots, cu, init, scale=d ** -0.5,
                        checkpoint_seq=ck_seq, checkpoint_offsets=ck_off, checkpoint_slots=ck_slots)
        ssm[dst] = ssm[src]  # the commit: one block copy per request that rejected a draft
        conv[dst] = conv[src]

    corr = torch.zeros(B, T, H, d, dtype=sdt, device=dev)
    key_gate = torch.zeros(B, T, H, 2 * d, dtype=dt, device=dev)
    conv_in = torch.zeros(B, T, C, dtype=dt, device=dev)
    ar = torch.arange(B, device=dev)
    counts = torch.tensor(accepted, device=dev)
    seg = torch.arange(B + 1, device=dev)

    def recover():
        conv_in.copy_(x.view(B, T, C))
        window = conv[run_slots]
        y = ops.causal_conv1d_varlen(x, conv_w, window, ar, cu, init, activation="silu")
        q, kk, v, gg, beta = qkvgb(y, raw_g, b_logit)
        key_gate.copy_(torch.cat([kk, raw_g], dim=-1).view(B, T, H, 2 * d))
        kda_recover_verify(q, kk, v, gg, beta, ssm, run_slots, cu, init, corr, scale=d ** -0.5)
        # the commit of every request, as the scheme's end_verify does: gate + state fold + conv window
        kda_recover_commit_rows(ssm, conv, run_slots, init, ar, seg, key_gate, corr, conv_in, A_log, dt_bias,
                                -5.0, counts, run_slots)

    x1, g1, b1 = x.view(B, T, C)[:, 0].contiguous(), raw_g.view(B, T, H, d)[:, 0].contiguous(), \
        b_logit.view(B, T, H)[:, 0].contiguous()
    cu1 = torch.arange(B + 1, device=dev)

    def plain():
        y = ops.causal_conv1d_varlen(x1, conv_w, conv, run_slots, cu1, init, activation="silu")
        q, kk, v, gg, beta = qkvgb(y, g1, b1)
        ops.kda_chunked(q, kk, v, gg, beta, ssm, run_slots, cu1, init, scale=d ** -0.5)

    timer = _timer(dev)
    t_multi, t_rec, t_plain = timer(multi_slot, iters), timer(recover, iters), timer(plain, iters)
    item, sitem = torch.empty((), dtype=dt).element_size(), torch.empty((), dtype=sdt).element_size()
    mem_multi = k * (H * d * d * sitem + C * (CONV_K - 1) * item)
    mem_rec = (corr.numel() * sitem + key_gate.numel() * item + conv_in.numel() * item) // B
    return t_plain, t_multi, t_rec, mem_multi, mem_rec, sum(accepted) / B


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="activation dtype (default bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--batch", default=None, help="comma list of batch sizes")
    ap.add_argument("--k", default="1,3", help="comma list of draft counts")
    ap.add_argument("--iters", type=int, default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dt = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if cuda else torch.float32)
    shapes = (a.shapes or ("demo,k3" if cuda else "small,demo")).split(",")
    batches = [int(b) for b in (a.batch or ("1,8,64" if cuda else "1,4")).split(",")]
    iters = a.iters or (50 if cuda else 5)
    rows = []
    for name in shapes:
        H, d = SHAPES[name]
        for B in batches:
            for k in [int(v) for v in a.k.split(",")]:
                tp, tm, tr, mm, mr, acc = case(H, d, B, k, dev, dt, iters)
                rows.append([name, H, d, B, k, acc, tp, tm, tr, tm / tr, mm, mr, mm / mr])
                # progress as each case finishes (a run stopped at a time limit still reports these)
                print(f"# {name} batch {B} k {k}: plain {tp:.1f} us, multi_slot {tm:.1f} us, recover_ssm {tr:.1f} us",
                      file=sys.stderr, flush=True)
    print(f"# device {dev} ({torch.cuda.get_device_name(dev) if cuda else 'cpu'}), activations {dt}, "
          f"one KDA layer, median of {iters}")
    print_table(["shape", "H", "d", "batch", "k", "mean kept", "plain us", "multi_slot us", "recover_ssm us",
                 "x multi", "multi B/req", "recover B/req", "mem x"], rows)


if __name__ == "__main__":
    main()
