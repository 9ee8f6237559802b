"""Self-distillation of a checkpoint's MTP drafter layer against its own frozen target.

    python scripts/train_demo_model.py --distill-mtp --init models/k3-demo-stdlib --out DIR \
        [--data data|greedy|mix] [--unroll 3] [--steps N | --seconds S] [--resume DIR]

A draft is accepted when it equals the TARGET's greedy token, so the MTP layer learns the target's own
next-token distribution rather than the data's: at anchor position p the layer sees the target's hidden
state h_p and the token x_{p+1} (workers/model/mtp.py) and is trained by KL divergence to the target's
softmax at position p+1 (the distribution of x_{p+2}). Only the MTP layer's tensors train; the target's
stay bit-identical (they are copied from the `--init` safetensors unchanged; the MTP layer's MXFP4 experts
train through fake quantization and are quantized again at export).

Recursive use (`--unroll U`): draft step s >= 1 feeds the layer its own previous output state
(`mtp_propose`: the pair (h'_{s-1}, d_{s-1}) at position p+s), so training unrolls U steps in one pass
with the attention pattern that drafting has (`mtp_unrolled`): the step-s query of anchor p attends to
the target pairs at anchors 0..p and to the anchor's own step-1..s pairs. The step-s token is the
sequence's x_{p+1+s} (a draft that was accepted equals it on the target's greedy sequences) and its
teacher the target's distribution at p+1+s.

Data (`--data`): `data` = random windows of the training split (the target's distribution on real
text); `greedy` = the target's own greedy continuations of training-split windows (its decode
distribution: what speculative decoding drafts against), loss on the generated part; `mix` = half each.

Evaluation, on the exported checkpoint before and after (`results.json`'s "mtp_distill"):
* teacher-forced step-0 top-1 on held-out windows: against the target's argmax and against x_{t+2};
* `simulate_acceptance`: greedy speculative decoding replayed on the target's greedy continuations of
  held-out code prompts (those of benchmarks/spec_decode.py): per k, the mean accepted length per verify
  step and the per-position acceptance, exactly as the engine counts them (its drafts are the reference
  drafter's, workers/engine/spec/proposers.py).

Outputs: DIR/<name>/ (the full model directory: `--init`'s files with the new safetensors, results.json
and README.md), DIR/mtp.safetensors (the MTP layer's tensors alone; `--apply-mtp FILE` rebuilds the
model directory from `--init` and such a file), DIR/ckpt-distill.pt (resume), DIR/distill.log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch

from ..config import K3Config
from ..functional import LayerWeights, acc_dtype, linear, rms_norm
from . import forward as F
from .log import Log

SINGLE_FILE = "model.safetensors"


# ------------------------------------------------------------------------------------------- weights
def mtp_prefixes(cfg: K3Config) -> list[str]:
    return [f"model.layers.{cfg.num_hidden_layers + j}." for j in range(cfg.num_nextn_predict_layers)]


def is_mtp_name(name: str, cfg: K3Config) -> bool:
    return name.startswith(tuple(mtp_prefixes(cfg)))


def trainable_mtp(w: dict[str, torch.Tensor], cfg: K3Config) -> list[str]:
    """Make the MTP layers' tensors float32 leaves that require grad (MXFP4 experts dequantized to float
    stacks `experts.w13` / `experts.w2`, trained through fake quantization); everything else is frozen.
    Returns the trainable names. The router's correction bias stays fixed."""
    from k3serve.kernels.reference.mxfp4 import mxfp4_dequantize

    names = []
    for pre in mtp_prefixes(cfg):
        for which in ("w13", "w2"):
            packed = f"{pre}block_sparse_moe.experts.{which}_packed"
            if packed in w:
                w[f"{pre}block_sparse_moe.experts.{which}"] = mxfp4_dequantize(
                    w.pop(packed), w.pop(f"{pre}block_sparse_moe.experts.{which}_scale"), torch.float32)
        for k in [k for k in w if k.startswith(pre)]:
            t = w[k].detach().float().clone()
            if not k.endswith("e_score_correction_bias"):
                t.requires_grad_(True)
                names.append(k)
            w[k] = t
    for k, t in w.items():
        if not is_mtp_name(k, cfg):
            t.requires_grad_(False)
    return names


def mtp_disk_tensors(w: dict[str, torch.Tensor], cfg: K3Config, original: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """The MTP layers' tensors in the on-disk spelling and the dtypes of `original` (the `--init`
    safetensors): float expert stacks quantized to MXFP4 again, other tensors cast back."""
    from k3serve.kernels.reference.mxfp4 import mxfp4_quantize

    from ..checkpoint import disk_tensors

    canon = {}
    for k, t in w.items():
        if not is_mtp_name(k, cfg):
            continue
        t = t.detach().float().cpu()
        if k.endswith(("experts.w13", "experts.w2")) and cfg.experts_mxfp4:
            canon[k + "_packed"], canon[k + "_scale"] = mxfp4_quantize(t)
        else:
            canon[k] = t
    disk = disk_tensors(cfg, canon)
    want = {k for k in original if is_mtp_name(k, cfg)}
    if set(disk) != want:
        raise ValueError(f"distill_mtp: MTP tensors {sorted(set(disk) ^ want)[:6]} differ from the checkpoint's")
    return {k: t.to(original[k].dtype).contiguous() for k, t in disk.items()}


def write_model_dir(init_dir: Path, mtp: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """`init_dir`'s files in `out_dir`, its safetensors with the MTP tensors replaced by `mtp` (every
    other tensor copied bit for bit)."""
    from safetensors.torch import load_file, save_file

    if not (init_dir / SINGLE_FILE).is_file():
        raise SystemExit(f"distill_mtp: {init_dir} has no {SINGLE_FILE} (a sharded --init is not supported)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in init_dir.iterdir():
        if f.is_file() and f.name != SINGLE_FILE and f.resolve() != (out_dir / f.name).resolve():
            shutil.copy(f, out_dir / f.name)
    orig = load_file(str(init_dir / SINGLE_FILE))
    extra = set(mtp) - set(orig)
    if extra:
        raise ValueError(f"distill_mtp: tensors {sorted(extra)[:4]} are not in {init_dir / SINGLE_FILE}")
    merged = {k: (mtp[k] if k in mtp else t) for k, t in orig.items()}
    tmp = out_dir / (SINGLE_FILE + ".tmp")
    save_file(merged, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / SINGLE_FILE)
    return out_dir


# ------------------------------------------------------------------------------------------- forward
def mtp_unrolled(w, cfg: K3Config, h: torch.Tensor, ids: torch.Tensor, steps: int,
                 opt: F.Options | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`steps` draft steps of the MTP layers at every anchor at once, as `mtp.mtp_propose` drafts.

    h `[B, T, H]` the target's pre-norm hidden states over ids `[B, T]`. Anchors p = 0..N-1 with
    N = T - steps. Step s (layer s % num_nextn_predict_layers) at anchor p takes the pair at position
    p+s: (h_p, x_{p+1}) for s = 0, (its own step s-1 output state, x_{p+1+s}) after; its query attends
    to the layer's keys of the pairs at anchors 0..p of step 0 and of anchor p's steps 1..s.
    Returns (logits `[B, N, V]` per step: step s predicts x_{p+2+s}, output states `[B, N, H]` per step).
    """
    opt = opt or F.Options()
    n_mtp = cfg.num_nextn_predict_layers
    if n_mtp < 1:
        raise ValueError("the model has no MTP layer (num_nextn_predict_layers = 0)")
    B, T, _ = h.shape
    N = T - steps
    if N < 1 or steps < 1:
        raise ValueError(f"mtp_unrolled: {steps} steps need more than {steps} positions (got {T})")
    from ..mtp import mtp_embed_weight, mtp_head_weight

    eps = cfg.rms_norm_eps
    dev = h.device
    anchors = torch.arange(N, device=dev)
    hidden_in = [h[:, :N]]  # the pair inputs' hidden states, step by step
    cache: dict[tuple[int, int], tuple] = {}  # (layer j, pair i) -> (u, x, q, k, v)
    logits_out, states = [], []
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    causal = anchors[None, :] <= anchors[:, None]  # [query anchor, key anchor]
    for s in range(steps):
        j = s % n_mtp
        i_layer = cfg.num_hidden_layers + j
        lw = LayerWeights(w, f"model.layers.{i_layer}.")
        for i in range(s + 1):
            if (j, i) in cache:
                continue
            e = mtp_embed_weight(w, cfg, j)[ids[:, 1 + i: N + 1 + i]].to(h.dtype)
            if i == 0:
                e = torch.cat([torch.zeros_like(e[:, :1]), e[:, 1:]], dim=1)  # position 0 is zeroed
            u = linear(torch.cat([rms_norm(e, lw["enorm.weight"], eps),
                                  rms_norm(hidden_in[i], lw["hnorm.weight"], eps)], -1), lw["eh_proj.weight"])
            x = rms_norm(u, lw["input_layernorm.weight"], eps)
            cache[(j, i)] = (u, x, *F.mla_qkv(x, lw.sub("self_attn."), cfg, anchors + i))
        u, x, q, _k, _v = cache[(j, s)]
        acc = acc_dtype(q.dtype) if q.dtype != torch.bfloat16 else torch.float32
        k0, v0 = cache[(j, 0)][3], cache[(j, 0)][4]
        sc0 = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), k0.to(acc)) * scale
        sc0 = sc0.masked_fill(~causal, float("-inf"))
        diag = [(q.to(acc) * cache[(j, i)][3].to(acc)).sum(-1, keepdim=True) * scale for i in range(1, s + 1)]
        p_all = torch.softmax(torch.cat([sc0, *diag], dim=-1), dim=-1)
        o = p_all[..., :N] @ v0.to(acc)
        for i in range(1, s + 1):
            o = o + p_all[..., N + i - 1: N + i] * cache[(j, i)][4].to(acc)
        o = o.transpose(1, 2).reshape(B, N, -1).to(h.dtype)
        v = u + F.mla_out(o, x, lw.sub("self_attn."), cfg)
        v = v + F._mlp(w, cfg, i_layer, rms_norm(v, lw["post_attention_layernorm.weight"], eps), opt)
        logits_out.append(linear(rms_norm(v, lw["shared_head.norm.weight"], eps), mtp_head_weight(w, cfg, j)))
        states.append(v)
        hidden_in.append(v)
    return logits_out, states


@torch.no_grad()
def teacher(w, cfg: K3Config, ids: torch.Tensor, opt: F.Options, batch: int = 64):
    """The frozen target over ids `[B, T]`: (pre-norm hidden `[B, T, H]`, logits `[B, T, V]`)."""
    hs, ls = [], []
    for b in range(0, ids.shape[0], batch):
        h = F.hidden_states(w, cfg, ids[b: b + batch], opt)
        hs.append(h)
        ls.append(F.lm_logits(w, cfg, h))
    return torch.cat(hs), torch.cat(ls)


@torch.no_grad()
def greedy_extend(w, cfg: K3Config, prompts: torch.Tensor, new: int, opt: F.Options, batch: int = 256,
                  pad: int = 0) -> torch.Tensor:
    """The target's greedy continuation of each prompt row `[B, P]` by `new` tokens -> `[B, P + new]`
    (no caches: every step runs the whole fixed-length buffer, causal, so later pad tokens are unseen)."""
    B, P = prompts.shape
    out = []
    for b in range(0, B, batch):
        buf = torch.full((min(batch, B - b), P + new), pad, dtype=torch.long, device=prompts.device)
        buf[:, :P] = prompts[b: b + batch]
        for g in range(new):
            hcur = F.hidden_states(w, cfg, buf, opt)[:, P - 1 + g]
            buf[:, P + g] = F.lm_logits(w, cfg, hcur).argmax(-1)
        out.append(buf)
    return torch.cat(out)


# ------------------------------------------------------------------------------------------- loss
def distill_loss(student: list[torch.Tensor], tlogits: torch.Tensor, weights: list[float],
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float], list[float]]:
    """sum_s weights[s] * mean KL(target at p+1+s || step s at p) over the anchors (mask `[B, N]`).
    Returns (loss, KL per step, top-1 agreement with the target's argmax per step)."""
    N = student[0].shape[1]
    total = 0.0
    kls, agree = [], []
    for s, sl in enumerate(student):
        t = tlogits[:, 1 + s: N + 1 + s].float()
        lt = torch.log_softmax(t, -1)
        ls = torch.log_softmax(sl.float(), -1)
        kl = (lt.exp() * (lt - ls)).sum(-1)
        ok = (sl.argmax(-1) == t.argmax(-1)).float()
        if mask is not None:
            m = mask.float()
            kl_m = (kl * m).sum() / m.sum().clamp_min(1)
            ag = float((ok * m).sum() / m.sum().clamp_min(1))
        else:
            kl_m, ag = kl.mean(), float(ok.mean())
        total = total + weights[s] * kl_m
        kls.append(round(float(kl_m.detach()), 4))
        agree.append(round(ag, 4))
    return total, kls, agree


# ------------------------------------------------------------------------------------------- evaluation
def _leads(student: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """[B, N - 1]: how many leading drafts of each anchor equal the sequence's tokens x_{p+2+s} (the
    last anchor's last draft has no token to compare with)."""
    N = student[0].shape[1] - 1
    ok = torch.stack([sl[:, :N].argmax(-1) == ids[:, 2 + s: N + 2 + s] for s, sl in enumerate(student)], -1)
    return ok.long().cumprod(-1).sum(-1)


@torch.no_grad()
def simulate_acceptance(w, cfg: K3Config, seqs: torch.Tensor, prompt_len: int, ks, opt: F.Options,
                        max_tokens: int | None = None, batch: int = 64) -> dict:
    """Greedy speculative decoding with the MTP drafter replayed on the target's greedy sequences
    `seqs` `[B, L]` (prompt `[:prompt_len]`, the rest the target's greedy tokens): after the prompt's
    first token the drafter drafts k at anchor p (the last verified pair), the target accepts the
    leading drafts that equal its tokens (a) plus one of its own, and the next anchor is p + 1 + a; drafts
    are capped at the tokens left - 1 (no drafts for the last one), as workers/engine/scheduler.py does.
    Per k: mean accepted length (tokens per verify step), per-position acceptance, verify steps."""
    K = max(ks)
    L = seqs.shape[1]
    # K + 1 filler tokens: the anchors near the end get all K drafts; the ones compared with filler
    # are never used (a verify step never accepts past the last token: a <= tokens left - 1)
    padded = torch.cat([seqs, seqs[:, -1:].expand(-1, K + 1)], 1)
    leads = []
    for b in range(0, seqs.shape[0], batch):
        chunk = padded[b: b + batch]
        h = F.hidden_states(w, cfg, chunk, opt)
        student, _ = mtp_unrolled(w, cfg, h, chunk, K, opt)
        leads.append(_leads(student, chunk).cpu())
    lead = torch.cat(leads)  # [B, L]
    end = L if max_tokens is None else min(L, prompt_len + max_tokens)
    out = {}
    for k in ks:
        steps, accepted, pos = 0, 0, [0] * k
        for row in lead.tolist():
            p, produced = prompt_len - 1, 1  # the prefill produced x_P; anchor P-1
            while prompt_len + produced < end:
                cap = min(k, end - (prompt_len + produced) - 1)  # as the scheduler caps drafts (_drafts)
                if cap <= 0:  # the last token: a plain decode step, no drafts
                    break
                a = min(row[p], cap)
                steps += 1
                accepted += a
                for i in range(a):
                    pos[i] += 1
                produced += 1 + a
                p += 1 + a
        out[k] = {"accept_len": round(1 + accepted / max(steps, 1), 3),
                  "per_position": [round(x / max(steps, 1), 3) for x in pos], "steps": steps}
    return out


@torch.no_grad()
def teacher_forced_top1(w, cfg: K3Config, windows: torch.Tensor, opt: F.Options, batch: int = 64) -> dict:
    """Step-0 top-1 on windows `[B, T]`: against the target's argmax at p+1 and against x_{p+2}."""
    vs_target, vs_data, n = 0.0, 0.0, 0
    for b in range(0, windows.shape[0], batch):
        chunk = windows[b: b + batch]
        h, tl = teacher(w, cfg, chunk, opt)
        (sl,), _ = mtp_unrolled(w, cfg, h, chunk, 1, opt)
        pred = sl[:, :-1].argmax(-1)  # anchors 0..T-3: x_{p+2} is in the window
        N = pred.shape[1]
        vs_target += float((pred == tl[:, 1: N + 1].argmax(-1)).float().sum())
        vs_data += float((pred == chunk[:, 2: N + 2]).float().sum())
        n += pred.numel()
    return {"vs_target_argmax": round(vs_target / n, 4), "vs_data": round(vs_data / n, 4)}


def code_prompt_ids(tok, files, length: int, per_file: int) -> list[list[int]]:
    """The last `length` tokens before a function body (as benchmarks/spec_decode.py's code prompts),
    up to `per_file` functions per file."""
    from .corpus import extract_functions

    out = []
    for _path, text in files:
        got = 0
        for f in extract_functions(text):
            ids = tok.encode(f.prefix + f.header)
            if len(ids) >= length:
                out.append(ids[-length:])
                got += 1
                if got >= per_file:
                    break
    return out


# ------------------------------------------------------------------------------------------- run
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_demo_model.py --distill-mtp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--distill-mtp", action="store_true", help="(the mode switch of scripts/train_demo_model.py)")
    p.add_argument("--init", required=True, help="the model directory whose MTP layer is distilled")
    p.add_argument("--out", required=True)
    p.add_argument("--name", default=None, help="model directory name under --out (default: --init's)")
    p.add_argument("--apply-mtp", default=None, help="only rebuild DIR/<name> from --init and this MTP file")
    p.add_argument("--record", default=None, help="with --apply-mtp: the run's distill.json (results.json, card)")
    p.add_argument("--resume", default=None, help="a directory holding ckpt-distill.pt")
    p.add_argument("--stdlib", default=None, help="default: this Python's standard library")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kda", choices=["auto", "fla", "chunked"], default="auto")
    p.add_argument("--data", choices=["data", "greedy", "mix"], default="mix")
    p.add_argument("--unroll", type=int, default=3, help="draft steps trained at once")
    p.add_argument("--variants", default=None,
                   help="compare: comma-separated DATA:UNROLL pairs (e.g. data:1,mix:3), each trained from --init's "
                        "MTP layer for --seconds into DIR/v-DATA-uUNROLL/ (mtp.safetensors, distill.json)")
    p.add_argument("--step-weights", default="1,0.7,0.5,0.4,0.3", help="loss weight of draft step 1, 2, ...")
    p.add_argument("--seq", type=int, default=256, help="window / sequence length (one shape everywhere)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seconds", type=float, default=60, help="training time when --steps is not given")
    p.add_argument("--greedy-seqs", type=int, default=512, help="greedy training sequences (greedy, mix)")
    p.add_argument("--greedy-seconds", type=float, default=None, help="... or as many batches of 256 as fit in this")
    p.add_argument("--greedy-prompt", type=int, default=128, help="their prompt length (the rest generated)")
    p.add_argument("--greedy-cache", default=None, help="a file keeping the greedy sequences between runs")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out code prompts for the acceptance replay")
    p.add_argument("--eval-prompt-len", type=int, default=128)
    p.add_argument("--eval-max-tokens", type=int, default=48, help="as benchmarks/spec_decode.py --max-tokens")
    p.add_argument("--eval-ks", default="1,2,3,4,5")
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--save-every", type=float, default=60)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def evaluate(model_dir: Path, dev: str, kda: str, held_windows, code_seqs, args, ks) -> dict:
    from ..loader import load_model_weights

    cfg, w = load_model_weights(model_dir, dtype=torch.float32, device=dev)
    opt = F.Options(kda=kda)
    r = {"teacher_forced_top1": teacher_forced_top1(w, cfg, held_windows, opt)}
    sim = simulate_acceptance(w, cfg, code_seqs, args.eval_prompt_len, ks, opt, max_tokens=args.eval_max_tokens)
    r["replay"] = {str(k): v for k, v in sim.items()}
    return r


def write_card(model_dir: Path) -> None:
    """README.md = the training card (card.py, from results.json) + the distillation section."""
    from .card import model_card

    results = json.loads((model_dir / "results.json").read_text())
    text = model_card(results)
    if results.get("mtp_distill"):  # card.py's MTP line measured the pretrained layer
        text = text.replace("* MTP layer, teacher-forced top-1", "* MTP layer as pretrained (before the "
                            "distillation below), teacher-forced top-1")
        text += "\n" + distill_card(results["mtp_distill"])
    (model_dir / "README.md").write_text(text)


def _replay_line(r: dict, k: str) -> str:
    x = r["replay"][k]
    return f"accepted length {x['accept_len']}, per position {' / '.join(str(v) for v in x['per_position'])}"


def distill_card(rec: dict) -> str:
    """The model card's section on the distilled MTP layer (from results.json's "mtp_distill")."""
    b, a = rec["before"], rec["after"]
    fin = rec.get("final") or {}
    data = {"data": "random windows of the training split",
            "greedy": f"the target's greedy continuations of {rec.get('greedy_seqs')} training-split prompts of "
                      f"{rec.get('greedy_prompt')} tokens (loss on the generated part)",
            "mix": f"half random training-split windows, half the target's greedy continuations of "
                   f"{rec.get('greedy_seqs')} training-split prompts of {rec.get('greedy_prompt')} tokens"}[rec["data"]]
    ks = sorted(a["replay"], key=int)
    greedy_opts = (f" --greedy-seqs {rec['greedy_seqs']} --greedy-prompt {rec['greedy_prompt']}"
                   if rec.get("greedy_prompt") else "")
    lines = [
        "## MTP drafter: self-distilled",
        "",
        "The MTP layer was trained again with the target frozen (its tensors are bit-identical to the "
        "pretrained checkpoint's): KL divergence to the target's own next-token distribution, "
        f"unrolled over {rec['unroll']} recursive draft steps (step weights {rec['step_weights']}), as "
        "workers/model/train/distill_mtp.py describes. Reproduce: `bash scripts/distill_mtp_device.sh` on the lent "
        "H200 (its header: the variants, then `--apply-mtp` here), or `python scripts/train_demo_model.py "
        f"--distill-mtp --init models/k3-demo-stdlib --out DIR --data {rec['data']} --unroll {rec['unroll']} "
        f"--steps {rec['steps']}{greedy_opts}` "
        "on any GPU (the same recipe; its random batches differ from a --variants run's).",
        f"* Data: {data}; {rec['steps']} steps of {rec['batch']}x{rec['seq']} tokens, AdamW lr {rec['lr']} "
        f"(warm-up, cosine), {rec['train_seconds']} s (KDA: {rec['kda_impl']}).",
        f"* Final KL per draft step {fin.get('kl')}, top-1 agreement with the target per step "
        f"{fin.get('top1_vs_target')} (training batch).",
        f"* Teacher-forced top-1 of draft step 1 on held-out windows, before -> after: against the target's argmax "
        f"{b['teacher_forced_top1']['vs_target_argmax']} -> **{a['teacher_forced_top1']['vs_target_argmax']}**; "
        f"against the data's x(t+2) {b['teacher_forced_top1']['vs_data']} -> {a['teacher_forced_top1']['vs_data']}.",
        f"* Greedy speculative decoding replayed on the target's continuations of {rec['eval_prompts']} held-out code "
        f"prompts ({rec['eval_prompt_len']} tokens, {rec['eval_max_tokens']} new; `simulate_acceptance`, which counts "
        "what the engine counts):",
        "",
        "| k | accepted length before | after | per position after |",
        "| --- | --- | --- | --- |",
    ]
    for k in ks:
        lines.append(f"| {k} | {b['replay'][k]['accept_len']} | **{a['replay'][k]['accept_len']}** | "
                     f"{' / '.join(str(v) for v in a['replay'][k]['per_position'])} |")
    if rec.get("compare"):
        lines += ["", "Variants trained for the same time from the pretrained MTP layer (data, unrolled steps): "
                  "replayed accepted length at k = 3 (held-out code):", ""]
        lines += [f"* {v['data']}, unroll {v['unroll']}: {v['steps']} steps, {_replay_line(v['after'], '3')}"
                  for v in rec["compare"]]
    lines += [f"* {n}" for n in rec.get("notes", [])]
    if rec.get("cpu_benchmark"):
        lines += ["", rec["cpu_benchmark"]["text"], "", *rec["cpu_benchmark"]["table"]]
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:  # noqa: C901
    from safetensors.torch import load_file, save_file

    from k3serve.tokenizer import K3Tokenizer

    from ..loader import load_model_weights
    from .corpus import split_files, stdlib_dir, stdlib_files
    from .run import make_optimizer, pick_kda

    args = parse_args(argv)
    t_start = time.time()
    init = Path(args.init)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or init.name
    log = Log(out / "distill.log")
    dev = args.device
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    orig = load_file(str(init / SINGLE_FILE))
    results = json.loads((init / "results.json").read_text()) if (init / "results.json").is_file() else {}
    results.pop("mtp_distill", None)

    def finish(model_dir: Path, record: dict | None) -> None:
        if record is not None:
            (model_dir / "results.json").write_text(json.dumps(dict(results, mtp_distill=record), indent=2) + "\n")
            if (model_dir / "README.md").is_file():
                write_card(model_dir)

    if args.apply_mtp:
        mtp = load_file(args.apply_mtp)
        model_dir = write_model_dir(init, mtp, out / name)
        finish(model_dir, json.loads(Path(args.record).read_text()) if args.record else None)
        log(f"apply: {model_dir} = {init} with the MTP tensors of {args.apply_mtp}")
        return 0

    variants = ([(d, int(u)) for d, u in (v.split(":") for v in args.variants.split(","))] if args.variants
                else [(args.data, args.unroll)])
    for d, u in variants:
        if d not in ("data", "greedy", "mix") or u < 1:
            raise SystemExit(f"distill_mtp: bad variant {d}:{u} (DATA in data, greedy, mix; UNROLL >= 1)")
    weights_s = [float(x) for x in args.step_weights.split(",")]
    if len(weights_s) < max(u for _, u in variants):
        raise SystemExit(f"distill_mtp: --step-weights has {len(weights_s)} weights for {max(u for _, u in variants)} "
                         "unrolled steps")
    if args.resume and len(variants) > 1:
        raise SystemExit("distill_mtp: --resume continues one variant, not --variants")

    cfg, w = load_model_weights(init, dtype=torch.float32, device=dev)
    if cfg.num_nextn_predict_layers < 1:
        raise SystemExit(f"distill_mtp: {init} has no MTP layer (num_nextn_predict_layers = 0)")
    names = trainable_mtp(w, cfg)
    params = {k: w[k] for k in names}
    start = {k: t.detach().clone() for k, t in params.items()}
    log(f"init {init}: {sum(t.numel() for t in params.values()) / 1e6:.3f} M trainable MTP parameters "
        f"({len(names)} tensors); the target's {len(orig) - sum(is_mtp_name(k, cfg) for k in orig)} tensors frozen")
    tok = K3Tokenizer.from_dir(str(init))
    root = args.stdlib or stdlib_dir()
    train_files, _valid, held_files = split_files(stdlib_files(root))
    if not train_files or not held_files:
        raise SystemExit(f"distill_mtp: {root} gives {len(train_files)} training and {len(held_files)} held-out files")
    eos = tok.special_id("[EOS]")

    def stream(fs):
        flat = []
        for x in tok._enc.encode_ordinary_batch([t for _, t in fs], num_threads=os.cpu_count() or 4):
            flat.extend(x)
            flat.append(eos)
        return torch.tensor(flat, dtype=torch.long, device=dev)

    train_tok, held_tok = stream(train_files), stream(held_files)
    L = args.seq
    if train_tok.numel() < L + 2 or held_tok.numel() < L + 2:
        raise SystemExit(f"distill_mtp: too little text ({train_tok.numel()} training, {held_tok.numel()} held-out "
                         f"tokens) for --seq {L}")
    log(f"text {root}: train {len(train_files)} files / {train_tok.numel()} tokens, held-out {len(held_files)} "
        f"files / {held_tok.numel()} tokens")
    kda = pick_kda(args.kda, dev, log, (args.batch, L, cfg.kda_num_heads, cfg.kda_head_dim))
    fopt = F.Options(kda=kda)  # frozen target passes
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    ks = [int(x) for x in args.eval_ks.split(",")]

    def windows(tokens, B, T):
        starts = torch.randint(0, tokens.numel() - T, (B,), device=dev, generator=gen)
        return tokens[starts[:, None] + torch.arange(T, device=dev)[None, :]]

    # evaluation sets (the held-out files only): windows, and greedy continuations of code prompts
    nwin = min(args.eval_windows, (held_tok.numel() - 1) // L)
    held_windows = held_tok[torch.arange(nwin, device=dev)[:, None] * L + torch.arange(L, device=dev)[None, :]]
    per_file = max(1, math.ceil(args.eval_prompts / len(held_files)))
    prompts = code_prompt_ids(tok, held_files, args.eval_prompt_len, per_file)[: args.eval_prompts]
    if not prompts:
        raise SystemExit(f"distill_mtp: no held-out function with {args.eval_prompt_len} tokens before its body")
    t = time.time()
    code_seqs = greedy_extend(w, cfg, torch.tensor(prompts, device=dev), L - args.eval_prompt_len, fopt,
                              pad=tok.pad_token_id)
    log(f"eval set: {nwin} held-out windows, {len(prompts)} held-out code prompts continued greedily to {L} "
        f"tokens ({time.time() - t:.1f}s)")
    base = {"init": str(init), "seq": L, "batch": args.batch, "lr": args.lr, "kda_impl": kda, "stdlib": root,
            "eval_prompts": len(prompts), "eval_prompt_len": args.eval_prompt_len,
            "eval_max_tokens": args.eval_max_tokens}
    t = time.time()
    before = evaluate(init, dev, kda, held_windows, code_seqs, args, ks)
    log(f"before: {json.dumps(before)} ({time.time() - t:.1f}s)")

    # greedy training sequences (time-boxed batches of 256 with --greedy-seconds)
    greedy = None
    if any(d in ("greedy", "mix") for d, _ in variants):
        cache = Path(args.greedy_cache) if args.greedy_cache else None
        if cache is not None and cache.is_file():
            greedy = torch.load(cache, map_location=dev)
            log(f"greedy: {greedy.shape[0]} sequences from {cache}")
        else:
            t = time.time()
            parts = []
            while True:
                n = 256 if args.greedy_seconds is not None else args.greedy_seqs
                parts.append(greedy_extend(w, cfg, windows(train_tok, n, args.greedy_prompt),
                                           L - args.greedy_prompt, fopt, pad=tok.pad_token_id))
                if args.greedy_seconds is None or time.time() - t > args.greedy_seconds * len(parts) / (len(parts) + 1):
                    break
            greedy = torch.cat(parts)
            log(f"greedy: {greedy.shape[0]} training-split prompts of {args.greedy_prompt} tokens continued to {L} "
                f"({time.time() - t:.1f}s)")
            if cache is not None:
                torch.save(greedy.cpu(), cache)

    def train(data: str, U: int, vout: Path) -> dict:
        """One variant from the init MTP weights (or --resume) -> its record; writes vout/mtp.safetensors."""
        with torch.no_grad():
            for k, t_ in params.items():
                t_.copy_(start[k])
        vlog = Log(vout / "distill.log") if vout != out else log
        rec = dict(base, data=data, unroll=U, step_weights=weights_s[:U], before=before)
        if greedy is not None and data != "data":
            rec.update(greedy_seqs=int(greedy.shape[0]), greedy_prompt=args.greedy_prompt)
        N = L - U
        greedy_mask = (torch.arange(N, device=dev) >= args.greedy_prompt - 1)[None, :]
        opt = make_optimizer(params, args.lr, 0.0)
        meta = {"step": 0, "total": args.steps, "history": [], "seconds": 0.0}
        if args.resume:
            ck = torch.load(Path(args.resume) / "ckpt-distill.pt", map_location=dev)
            with torch.no_grad():
                for k, t_ in params.items():
                    t_.copy_(ck["w"][k])
            opt.load_state_dict(ck["opt"])
            meta = ck["meta"]
            vlog(f"resumed from {args.resume}: step {meta['step']} of {meta['total']}")

        def save():
            torch.save({"w": {k: t_.detach().cpu() for k, t_ in params.items()}, "opt": opt.state_dict(),
                        "meta": meta}, vout / "ckpt-distill.pt.tmp")
            os.replace(vout / "ckpt-distill.pt.tmp", vout / "ckpt-distill.pt")

        train_opt = F.Options(kda=kda, fake_quant=True)
        last_save, t_phase, t_cal = time.time(), time.time(), time.time()
        first = meta["step"]
        while meta["total"] is None or meta["step"] < meta["total"]:
            s = meta["step"]
            if s == first + 2:
                if dev.startswith("cuda"):
                    torch.cuda.synchronize()
                t_cal = time.time()
            if meta["total"] is None and s == first + 7:
                if dev.startswith("cuda"):
                    torch.cuda.synchronize()
                per = (time.time() - t_cal) / 5
                meta["total"] = max(s + 1, s + int((args.seconds - (time.time() - t_phase)) / per))
                vlog(f"train {data}:{U}: {per * 1000:.0f} ms/step -> {meta['total']} steps")
            total = meta["total"] or 10**9
            lr = args.lr * min(1.0, (s + 1) / args.warmup) * (
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
            for gp in opt.param_groups:
                gp["lr"] = lr
            parts = []
            if data in ("data", "mix"):
                parts.append((windows(train_tok, args.batch if data == "data" else args.batch // 2, L), None))
            if data in ("greedy", "mix"):
                nb = args.batch if data == "greedy" else args.batch - args.batch // 2
                rows = torch.randint(0, greedy.shape[0], (nb,), device=dev, generator=gen)
                parts.append((greedy[rows], greedy_mask.expand(nb, N)))
            ids = torch.cat([p_ for p_, _ in parts])
            mask = None
            if any(m is not None for _, m in parts):
                mask = torch.cat([m if m is not None else torch.ones(p_.shape[0], N, dtype=torch.bool, device=dev)
                                  for p_, m in parts])
            h, tl = teacher(w, cfg, ids, fopt, batch=ids.shape[0])
            student, _ = mtp_unrolled(w, cfg, h, ids, U, train_opt)
            loss, kls, agree = distill_loss(student, tl, weights_s, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
            opt.step()
            meta["step"] = s + 1
            if s % 50 == 0 or s + 1 == total:
                r = {"step": s, "loss": round(float(loss.detach()), 4), "kl": kls, "top1_vs_target": agree,
                     "gnorm": round(float(gn), 3), "lr": round(lr, 6)}
                meta["history"].append(r)
                vlog(f"train {data}:{U} {json.dumps(r)}")
            if time.time() - last_save > args.save_every:
                meta["seconds"] += time.time() - last_save
                save()
                last_save = time.time()
        meta["seconds"] += time.time() - last_save
        save()
        rec.update(steps=meta["step"], train_seconds=round(meta["seconds"], 1),
                   final=meta["history"][-1] if meta["history"] else None)
        mtp = mtp_disk_tensors(w, cfg, orig)
        save_file(mtp, str(vout / "mtp.safetensors"), metadata={"format": "pt"})
        model_dir = write_model_dir(init, mtp, vout / name)
        t0 = time.time()
        rec["after"] = evaluate(model_dir, dev, kda, held_windows, code_seqs, args, ks)
        vlog(f"after {data}:{U}: {json.dumps(rec['after'])} ({time.time() - t0:.1f}s)")
        (vout / "distill.json").write_text(json.dumps(rec, indent=2) + "\n")
        finish(model_dir, rec)
        return rec

    if len(variants) == 1:
        train(*variants[0], out)
    else:
        recs = []
        for d, u in variants:
            vout = out / f"v-{d}-u{u}"
            vout.mkdir(exist_ok=True)
            recs.append(train(d, u, vout))
        summary = [{k: r[k] for k in ("data", "unroll", "steps", "train_seconds", "after")} for r in recs]
        (out / "compare.json").write_text(json.dumps(summary, indent=2) + "\n")
        best = max(recs, key=lambda r: r["after"]["replay"].get("3", next(iter(r["after"]["replay"].values())))
                   ["accept_len"])
        log(f"compare: {[(r['data'], r['unroll'], r['after']['replay']) for r in recs]}; best {best['data']}:"
            f"{best['unroll']}")
        (out / "distill.json").write_text(json.dumps(dict(best, compare=summary), indent=2) + "\n")
    log(f"done ({time.time() - t_start:.1f} s)")
    return 0
