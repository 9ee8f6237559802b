"""Train the demo model end to end: tokenizer, pretraining, chat fine-tune, MXFP4 export, evaluation.

    python scripts/train_demo_model.py --out DIR [--pretrain-seconds S | --pretrain-steps N] [--sft-steps M]
                                       [--resume DIR] [--deadline SECONDS]

Phases (one process; each writes progress to DIR/train.log):

1. text: the standard library's `*.py` files (`corpus.py`), split by file (~3% held out);
2. tokenizer: byte-level BPE (`bpe.py`) on the training files, `--vocab` ordinary ranks + 256 K3 specials;
3. pretraining: random windows of `--seq` tokens from the training files joined by `[EOS]`; next-token
   loss plus `--mtp-weight` x the MTP layer's loss (x_{t+2} from the detached target state h_t and x_{t+1});
   AdamW, warm-up then cosine; routed experts fake-quantized to MXFP4 for the last `--qat-frac` of it;
   the router's correction bias moves for load balance (aux-loss free, +-`--bias-rate` per step);
4. chat fine-tune (`chat_data.py`): loss on the assistant's tokens only, mixed with a pretraining batch;
5. export: `save_checkpoint` with MXFP4 experts (bf16 elsewhere) + tokenizer + generation_config into
   DIR/model; then `evaluate.py`'s figures on the exported weights, written to DIR/model/results.json.

Resumable: DIR/ckpt-*.pt (fp32 weights, bf16 Adam moments, step counters, RNG) are rewritten every
`--save-every` seconds and at the end of each phase; `--resume DIR2` continues from DIR2's checkpoint.
Given the same step counts (results.json records them), a run is deterministic up to GPU rounding.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from ..checkpoint import save_checkpoint
from ..config import K3Config, mxfp4_quantization_config
from ..init_weights import init_weights
from ..loader import load_model_weights
from ..spec import expected_weights
from . import forward as F
from .bpe import train_bpe, write_k3_tokenizer
from .card import write_model_card
from .chat_data import TOOLS, make_examples
from .corpus import extract_functions, split_files, stdlib_dir, stdlib_files
from .evaluate import function_body_parse_rate, heldout_perplexity, mtp_accuracy
from .log import Log

MODEL_NAME = "k3-demo-stdlib"


def demo_text_config(vocab_size: int, ids: dict) -> dict:
    """The demo architecture (hub spelling): every K3 layer type at ~7.5 MB."""
    return {
        "model_type": "kimi_linear", "vocab_size": vocab_size, "hidden_size": 192, "num_hidden_layers": 8,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 4096,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "intermediate_size": 384,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 3,
                               "head_dim": 64, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                               "use_full_rank_gate": True},
        "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": 96, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": True,
        "mla_use_output_gate": True, "rope_theta": 10000.0, "rope_scaling": None, "attn_res_block_size": 2,
        "num_experts": 16, "num_experts_per_token": 2, "num_expert_group": 1, "topk_group": 1,
        "use_grouped_topk": True, "topk_method": "noaux_tc", "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "moe_intermediate_size": 64,
        "num_shared_experts": 1, "routed_expert_hidden_size": 96, "latent_moe_use_norm": True,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 1,
        **ids,
    }


def configs(vocab_size: int, ids: dict, overrides: dict | None = None) -> tuple[K3Config, K3Config]:
    """(training config with float experts, export config with MXFP4 experts)."""
    text = demo_text_config(vocab_size, ids)
    text.update(overrides or {})
    train_cfg = K3Config.from_dict({"model_type": "kimi_k3", "text_config": text})
    q = dict(text, quantization_config=mxfp4_quantization_config())
    export_cfg = K3Config.from_dict({"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                                     "text_config": q})
    export_cfg.torch_dtype = "bfloat16"
    return train_cfg, export_cfg


def init_train_weights(cfg: K3Config, seed: int, device) -> dict[str, torch.Tensor]:
    w = init_weights(cfg, seed=seed, device="cpu", dtype=torch.float32)
    H = cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    w["model.embed_tokens.weight"] = torch.randn(w["model.embed_tokens.weight"].shape, generator=g) / math.sqrt(H)
    w.pop("lm_head.weight", None)  # tied: the embedding
    for k in w:
        if k.endswith("e_score_correction_bias"):
            w[k] = torch.zeros_like(w[k])  # moved by update_bias during training
    out = {}
    for k, v in w.items():
        t = v.float().to(device).clone()
        t.requires_grad_(not k.endswith("e_score_correction_bias"))
        out[k] = t
    return out


def with_tied(w: dict, cfg: K3Config) -> dict:
    if cfg.tie_word_embeddings:
        return {**w, "lm_head.weight": w["model.embed_tokens.weight"]}
    return w


def export_weights(w: dict, cfg_export: K3Config) -> dict[str, torch.Tensor]:
    from k3serve.kernels.reference.mxfp4 import mxfp4_quantize

    from ..loader import target_dtype

    specs = expected_weights(cfg_export)
    out = {}
    for name, spec in specs.items():
        if spec.default in ("absent", "tied"):
            continue
        if spec.kind == "uint8":
            if name.endswith("_packed"):
                base = name[: -len("_packed")]
                out[name], out[base + "_scale"] = mxfp4_quantize(w[base].detach().float().cpu())
            continue
        out[name] = w[name].detach().cpu().to(target_dtype(spec, torch.bfloat16))
    return out


# --------------------------------------------------------------------------------------------- checkpoint
CKPT_SHARD = 14 * 1024 * 1024


def save_state(out: Path, w: dict, opt: torch.optim.Optimizer, meta: dict) -> None:
    items: list[tuple[str, torch.Tensor]] = [(f"w/{k}", v.detach().cpu()) for k, v in w.items()]
    names = list(w)
    for k in names:
        st = opt.state.get(w[k], {})
        for s in ("exp_avg", "exp_avg_sq"):
            if s in st:
                items.append((f"opt/{k}/{s}", st[s].detach().to(torch.bfloat16).cpu()))
    shards, cur, size = [], {}, 0
    for key, t in items:
        nb = t.numel() * t.element_size()
        if cur and size + nb > CKPT_SHARD:
            shards.append(cur)
            cur, size = {}, 0
        cur[key] = t
        size += nb
    shards.append(cur)
    for old in out.glob("ckpt-*.pt"):
        old.unlink()
    for n, sh in enumerate(shards):
        torch.save(sh, out / f"ckpt-{n}.pt")
    meta = dict(meta, opt_step={k: int(opt.state.get(w[k], {}).get("step", 0)) for k in names if w[k] in opt.state})
    (out / "ckpt-meta.json").write_text(json.dumps(meta))


def load_state(src: Path, w: dict, opt: torch.optim.Optimizer, device) -> dict:
    meta = json.loads((src / "ckpt-meta.json").read_text())
    data = {}
    for f in sorted(src.glob("ckpt-*.pt")):
        data.update(torch.load(f, map_location="cpu"))
    with torch.no_grad():
        for k, t in w.items():
            t.copy_(data[f"w/{k}"].to(device))
    for k, t in w.items():
        if f"opt/{k}/exp_avg" in data:
            opt.state[t] = {"step": torch.tensor(float(meta["opt_step"].get(k, 0))),
                            "exp_avg": data[f"opt/{k}/exp_avg"].float().to(device),
                            "exp_avg_sq": data[f"opt/{k}/exp_avg_sq"].float().to(device)}
    return meta


# --------------------------------------------------------------------------------------------- training
def make_optimizer(w: dict, lr: float, wd: float) -> torch.optim.Optimizer:
    decay = [t for k, t in w.items() if t.requires_grad and t.dim() >= 2 and "norm" not in k]
    other = [t for k, t in w.items() if t.requires_grad and not (t.dim() >= 2 and "norm" not in k)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def update_bias(w: dict, cfg: K3Config, counts: dict, rate: float) -> None:
    with torch.no_grad():
        for i, c in counts.items():
            b = w[f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias"]
            load = c / c.sum().clamp_min(1)
            b -= rate * torch.sign(load - 1.0 / cfg.num_experts)


def pick_kda(requested: str, device: str, log, shape=(2, 128, 2, 64), single_config: bool = True) -> str:
    """'fla' when FLA's chunk_kda imports, agrees with `kda_chunked` and back-propagates finite gradients
    at `shape` (B, T, heads, head dim; the compile happens here), else 'chunked'."""
    if requested != "auto":
        return requested
    if not device.startswith("cuda"):
        return "chunked"
    try:
        if single_config:
            F.single_config_autotune()
        B, T, h, d = shape
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.nn.functional.normalize(torch.randn(B, T, h, d, device=device, generator=g), dim=-1) * d**-0.5
        k = torch.nn.functional.normalize(torch.randn(B, T, h, d, device=device, generator=g), dim=-1)
        v = torch.randn(B, T, h, d, device=device, generator=g).requires_grad_(True)
        gg = -5 * torch.sigmoid(torch.randn(B, T, h, d, device=device, generator=g))
        beta = torch.rand(B, T, h, device=device, generator=g)
        a = F._kda_fla(q, k, v, gg, beta).float()
        b = F.kda_chunked(q, k, v, gg, beta)
        err = float((a - b).norm() / b.norm())
        a.sum().backward()
        ok = err < 2e-2 and bool(torch.isfinite(v.grad).all())
        log(f"kda: FLA chunk_kda vs chunked torch rel err {err:.2e}, backward finite -> {'fla' if ok else 'chunked'}")
        return "fla" if ok else "chunked"
    except Exception as e:  # noqa: BLE001 - any import/compile failure means: use the portable path
        log(f"kda: FLA unavailable ({type(e).__name__}: {str(e)[:200]}) -> chunked")
        return "chunked"


CHAT_CHECKS = [
    ({"messages": [{"role": "user", "content": "Write a Python function `is_palindrome(s)` that returns True "
                                               "if the string s reads the same backwards."}]}),
    ({"messages": [{"role": "user", "content": "Write a function that returns the sum of a list of numbers."}],
      "thinking": False}),
    ({"messages": [{"role": "user", "content": "Look up `os.path.join` in the Python docs."}], "tools": TOOLS}),
]


@torch.no_grad()
def chat_check(w, cfg, tok, opt, dev, max_new: int) -> list[dict]:
    """Greedy answers to CHAT_CHECKS (rendered and parsed by k3serve.chat), for the log and results.json."""
    from k3serve.chat.parsers import parse_output
    from k3serve.chat.renderer import render_chat

    out = []
    for req in CHAT_CHECKS:
        kw = {k: v for k, v in req.items() if k != "messages"}
        r = render_chat(tok, req["messages"], **kw)
        seq = torch.tensor([r.token_ids], device=dev)
        new = []
        for _ in range(max_new):
            logits = F.lm_logits(w, cfg, F.hidden_states(w, cfg, seq, opt)[:, -1])
            t = int(logits.argmax(-1))
            new.append(t)
            if t == tok.eos_token_id:
                break
            seq = torch.cat([seq, torch.tensor([[t]], device=dev)], dim=1)
        p = parse_output(tok.decode(new), thinking=r.thinking, tools_enabled=bool(kw.get("tools")))
        out.append({"request": req["messages"][-1]["content"], "reasoning": p.reasoning, "content": p.content,
                    "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in p.tool_calls],
                    "finished": bool(new) and new[-1] == tok.eos_token_id, "tokens": len(new)})
    return out


def main(argv=None) -> int:  # noqa: C901
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default=None, help="a directory holding ckpt-*.pt + ckpt-meta.json")
    p.add_argument("--stdlib", default=None, help="default: this Python's standard library")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kda", choices=["auto", "fla", "chunked"], default="auto")
    p.add_argument("--fla-autotune", action="store_true", help="let FLA benchmark all its configs (slow start)")
    p.add_argument("--vocab", type=int, default=3328, help="ordinary BPE ranks (the 256 specials come on top)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--qat-frac", type=float, default=0.2)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--pretrain-steps", type=int, default=None)
    p.add_argument("--pretrain-seconds", type=float, default=300)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--sft-seconds", type=float, default=75, help="at most this long (steps fixed after 10)")
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--deadline", type=float, default=None, help="stop pretraining early to finish by then (s)")
    p.add_argument("--save-every", type=float, default=120)
    p.add_argument("--eval-functions", type=int, default=64, help="0: skip the ast.parse measurement")
    p.add_argument("--chat-tokens", type=int, default=200)
    p.add_argument("--sft-max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", default=None, help="JSON text-config overrides (tests: a smaller model)")
    args = p.parse_args(argv)
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "train.log")
    dev = args.device
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    # 1. text
    root = args.stdlib or stdlib_dir()
    files = stdlib_files(root)
    train_files, valid_files, held_files = split_files(files)
    nbytes = sum(len(t.encode()) for _, t in files)
    if not train_files or not held_files:
        raise SystemExit(f"train_demo_model: {root} gives {len(train_files)} training and {len(held_files)} "
                         "held-out files; both must be non-empty")
    log(f"text: {root}: {len(files)} files, {nbytes / 1e6:.1f} MB; train {len(train_files)}, "
        f"validation {len(valid_files)}, held-out {len(held_files)}")

    # 2. tokenizer
    model_dir = out / MODEL_NAME
    model_dir.mkdir(exist_ok=True)
    t = time.time()
    ranks = train_bpe([x for _, x in train_files], args.vocab)
    vocab_total = write_k3_tokenizer(str(model_dir), ranks)
    from k3serve.tokenizer import K3Tokenizer

    tok = K3Tokenizer.from_dir(str(model_dir))
    log(f"tokenizer: {len(ranks)} ranks + 256 specials = {vocab_total} ids in {time.time() - t:.1f}s")
    eos_sep = tok.special_id("[EOS]")

    def stream(fs):
        ids = tok._enc.encode_ordinary_batch([x for _, x in fs], num_threads=os.cpu_count() or 4)
        flat = []
        for x in ids:
            flat.extend(x)
            flat.append(eos_sep)
        return torch.tensor(flat, dtype=torch.long, device=dev)

    t = time.time()
    train_tok, held_tok = stream(train_files), stream(held_files)
    valid_tok = stream(valid_files) if valid_files else held_tok[:0]
    log(f"tokens: train {train_tok.numel()}, held-out {held_tok.numel()} "
        f"({nbytes / (train_tok.numel() + held_tok.numel()):.2f} bytes/token) in {time.time() - t:.1f}s")

    # 3. model
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    cfg, cfg_export = configs(vocab_total, ids, json.loads(args.override) if args.override else None)
    w = init_train_weights(cfg, args.seed, dev)
    nparams = sum(v.numel() for v in w.values())
    log(f"model: {nparams / 1e6:.2f} M parameters ({cfg.num_hidden_layers} layers + {cfg.num_nextn_predict_layers} MTP)")
    opt = make_optimizer(w, args.lr, args.wd)
    t = time.time()
    kda = pick_kda(args.kda, dev, log, (args.batch, args.seq, cfg.kda_num_heads, cfg.kda_head_dim),
                   not args.fla_autotune)
    log(f"kda: {kda} ({time.time() - t:.1f}s)")
    meta = {"phase": "pretrain", "step": 0, "sft_step": 0, "total": None, "history": [], "seconds": 0.0}
    if args.resume:
        meta = load_state(Path(args.resume), w, opt, dev)
        log(f"resumed from {args.resume}: phase {meta['phase']} step {meta['step']} sft_step {meta['sft_step']}")
    gen = torch.Generator(device=dev).manual_seed(args.seed * 7919 + meta["step"] + meta["sft_step"])

    def batch_windows(tokens, B, T):
        starts = torch.randint(0, tokens.numel() - T - 1, (B,), device=dev, generator=gen)
        return tokens[starts[:, None] + torch.arange(T + 1, device=dev)[None, :]]

    def lm_loss(chunk, opt_f, mtp=True):
        h = F.hidden_states(with_tied(w, cfg), cfg, chunk[:, :-1], opt_f)
        loss = F.cross_entropy(F.lm_logits(with_tied(w, cfg), cfg, h), chunk[:, 1:])
        mloss = None
        if mtp and cfg.num_nextn_predict_layers:
            ml, _ = F.mtp_hidden(with_tied(w, cfg), cfg, 0, h[:, :-1].detach(), chunk[:, 1:-1], opt_f)
            mloss = F.cross_entropy(ml, chunk[:, 2:])
        return loss, mloss

    if held_tok.numel() < args.seq + 3:
        raise SystemExit(f"train_demo_model: the held-out files give {held_tok.numel()} tokens, fewer than "
                         f"--seq + 3 = {args.seq + 3}")
    nval = min(32, (valid_tok.numel() - 1) // args.seq)
    val_windows = (valid_tok[torch.arange(nval, device=dev)[:, None] * args.seq
                             + torch.arange(args.seq + 1, device=dev)[None, :]] if nval else None)
    best: dict = {}  # the lowest-validation-loss pretraining snapshot (in memory only)
    last_save = time.time()

    def checkpoint():
        nonlocal last_save
        meta["seconds"] = meta.get("seconds", 0.0) + (time.time() - last_save)
        save_state(out, w, opt, meta)
        last_save = time.time()

    # 4. pretraining
    eval_reserve = 50.0  # time kept for export and evaluation (s)
    reserve = args.sft_seconds + eval_reserve + 10  # ... and for the fine-tune

    def left() -> float:
        """Seconds to the --deadline (inf without one), measured on the wall clock of this process: a
        slow first step (Triton compiling FLA's kernels) shortens training instead of overrunning it."""
        return math.inf if args.deadline is None else args.deadline - (time.time() - t_start)

    if meta["phase"] == "pretrain":
        t_phase = time.time()
        t_calib = None
        first = meta["step"]  # this process's first step (compiles happen there)
        while True:
            step = meta["step"]
            total = meta["total"] or args.pretrain_steps
            if total is not None and step >= total:
                break
            if left() < reserve and step > first and step + 1 != meta["total"]:
                log(f"pretrain: deadline reached at step {step} ({left():.0f}s left); this step is the last")
                meta["total"] = step + 1
            t_step = time.time()
            if step == 10:
                t_calib = time.time()
            if step == 40 and meta["total"] is None:
                per = (time.time() - t_calib) / 30
                budget = min(args.pretrain_seconds - (time.time() - t_phase), left() - reserve)
                meta["total"] = meta["planned"] = args.pretrain_steps or max(50, step + int(budget / per))
                log(f"pretrain: {per * 1000:.1f} ms/step -> {meta['total']} steps "
                    f"({args.batch}x{args.seq} tokens per step)")
            total = meta["total"] or args.pretrain_steps or 10**9
            for gparam in opt.param_groups:
                gparam["lr"] = lr_at(step, total, args.lr, args.warmup)
            counts: dict = {}
            qat = meta["total"] is not None and step >= (1 - args.qat_frac) * meta["total"]
            of = F.Options(kda=kda, fake_quant=qat, counts=counts)
            loss, mloss = lm_loss(batch_windows(train_tok, args.batch, args.seq), of)
            total_loss = loss + (args.mtp_weight * mloss if mloss is not None else 0)
            opt.zero_grad(set_to_none=True)
            total_loss.backward()
            gn = torch.nn.utils.clip_grad_norm_([t for t in w.values() if t.requires_grad], 1.0)
            opt.step()
            update_bias(w, cfg, counts, args.bias_rate)
            meta["step"] = step + 1
            if step == first:
                if dev.startswith("cuda"):
                    torch.cuda.synchronize()
                log(f"pretrain: first step {time.time() - t_step:.1f}s (compiles included), "
                    f"{left():.0f}s to the deadline")
            if step % 100 == 0 or step + 1 == total:
                rec = {"step": step, "loss": round(float(loss.detach()), 4),
                       "mtp": round(float(mloss.detach()), 4) if mloss is not None else None,
                       "gnorm": round(float(gn), 3), "qat": qat}
                if val_windows is not None:
                    with torch.no_grad():
                        vl, vm = lm_loss(val_windows, F.Options(kda=kda, fake_quant=qat))
                    rec.update(val=round(float(vl), 4), val_mtp=round(float(vm), 4) if vm is not None else None)
                    if float(vl) < best.get("val", float("inf")):
                        best = {"val": float(vl), "step": step + 1,
                                "w": {k: t.detach().clone() for k, t in w.items()}}
                meta["history"].append(rec)
                log(f"pretrain {json.dumps(rec)}")
            if time.time() - last_save > args.save_every:
                checkpoint()
        meta["pretrain_final"] = meta["history"][-1] if meta["history"] else None
        last_val = (meta["pretrain_final"] or {}).get("val")
        if best and last_val is not None and best["val"] < last_val - 0.01:
            with torch.no_grad():
                for k, t in w.items():
                    t.copy_(best["w"][k])
            meta["pretrain_restored"] = {"step": best["step"], "val": round(best["val"], 4)}
            log(f"pretrain: validation loss rose to {last_val}; restored the step-{best['step']} weights "
                f"(validation {best['val']:.4f})")
        best.clear()
        meta["phase"] = "sft"
        checkpoint()

    # 5. chat fine-tune
    if meta["phase"] == "sft":
        funcs = []
        for rel, text in train_files:
            mod = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
            funcs.extend((mod, f) for f in extract_functions(text, max_lines=20))
        random.Random(args.seed).shuffle(funcs)
        examples = make_examples(tok, funcs, seed=args.seed, max_tokens=args.sft_max_tokens)
        log(f"sft: {len(examples)} rendered chat examples from {len(funcs)} functions")
        rng = random.Random(args.seed + meta["sft_step"])
        pad = tok.pad_token_id
        for gparam in opt.param_groups:
            gparam["weight_decay"] = 0.0 if gparam["weight_decay"] == 0.0 else args.wd
        L = args.sft_max_tokens + 1  # one shape for every step (no recompiles): chat rows and text rows
        if train_tok.numel() < L + 2:
            raise SystemExit(f"train_demo_model: {train_tok.numel()} training tokens, fewer than "
                             f"--sft-max-tokens + 3 = {L + 2}")
        t_phase, s_first = time.time(), meta["sft_step"]
        t_sft = t_phase
        sft_total = meta.get("sft_total") or args.sft_steps
        while meta["sft_step"] < sft_total and examples:
            s = meta["sft_step"]
            if s == s_first + 2:
                t_sft = time.time()  # the first two steps compile; time the next ten
            if s == s_first + 12 and not meta.get("sft_total"):
                per = (time.time() - t_sft) / 10
                budget = min(args.sft_seconds - (time.time() - t_phase), left() - eval_reserve)
                sft_total = meta["sft_total"] = min(args.sft_steps, max(s + 1, s + int(budget / per)))
                log(f"sft: {per * 1000:.1f} ms/step -> {sft_total} steps")
            if left() < eval_reserve and s > s_first and s + 1 != sft_total:
                log(f"sft: deadline reached at step {s} ({left():.0f}s left); this step is the last")
                sft_total = meta["sft_total"] = s + 1
            for gparam in opt.param_groups:
                gparam["lr"] = args.sft_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / sft_total)))
            picked = [examples[rng.randrange(len(examples))] for _ in range(args.sft_batch)]
            Bs = len(picked)
            ids_t = torch.full((Bs, L), pad, dtype=torch.long)
            mask_t = torch.zeros((Bs, L), dtype=torch.float32)
            for r, (x, m) in enumerate(picked):
                ids_t[r, : len(x)] = torch.tensor(x)
                mask_t[r, : len(m)] = torch.tensor(m, dtype=torch.float32)
            # the text rows (pretraining windows of the same length) ride in the same forward pass
            ids_t = torch.cat([ids_t.to(dev), batch_windows(train_tok, max(1, args.batch // 4), L - 1)])
            mask_t = mask_t.to(dev)
            counts = {}
            of = F.Options(kda=kda, fake_quant=True, counts=counts)
            h = F.hidden_states(with_tied(w, cfg), cfg, ids_t[:, :-1], of)
            logits = F.lm_logits(with_tied(w, cfg), cfg, h)
            sft_loss = F.cross_entropy(logits[:Bs], ids_t[:Bs, 1:], mask_t[:, 1:])
            loss = F.cross_entropy(logits[Bs:], ids_t[Bs:, 1:])
            ml, _ = F.mtp_hidden(with_tied(w, cfg), cfg, 0, h[:, :-1].detach(), ids_t[:, 1:-1], of)
            sft_mtp = F.cross_entropy(ml[:Bs], ids_t[:Bs, 2:], mask_t[:, 2:])
            mloss = F.cross_entropy(ml[Bs:], ids_t[Bs:, 2:])
            total_loss = sft_loss + args.mtp_weight * sft_mtp + 0.5 * (loss + args.mtp_weight * mloss)
            opt.zero_grad(set_to_none=True)
            total_loss.backward()
            torch.nn.utils.clip_grad_norm_([t for t in w.values() if t.requires_grad], 1.0)
            opt.step()
            update_bias(w, cfg, counts, args.bias_rate)
            meta["sft_step"] = s + 1
            if s % 50 == 0 or s + 1 == sft_total:
                rec = {"sft_step": s, "sft_loss": round(float(sft_loss), 4), "sft_mtp": round(float(sft_mtp), 4),
                       "lm_loss": round(float(loss), 4)}
                meta["history"].append(rec)
                log(f"sft {json.dumps(rec)}")
            if time.time() - last_save > args.save_every:
                checkpoint()
        meta["phase"] = "done"
        meta["sft_final"] = meta["history"][-1] if meta["history"] else None
        checkpoint()

    # 6. export + evaluation (on the exported, MXFP4 weights)
    with torch.no_grad():
        exported = export_weights(w, cfg_export)
        save_checkpoint(cfg_export, exported, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    size = sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file())
    log(f"export: {model_dir} {size / 1e6:.2f} MB")
    ecfg, ew = load_model_weights(model_dir, dtype=torch.float32, device=dev)
    eo = F.Options(kda=kda)
    results: dict = {"name": MODEL_NAME, "stdlib": root, "files": len(files), "train_files": len(train_files),
                     "heldout_files": len(held_files), "valid_files": len(valid_files),
                     "pretrain_restored": meta.get("pretrain_restored"), "text_mb": round(nbytes / 1e6, 2),
                     "train_tokens": train_tok.numel(), "heldout_tokens": held_tok.numel(), "vocab": vocab_total,
                     "parameters": nparams, "size_bytes": size, "kda_impl": kda, "seq": args.seq,
                     "batch": args.batch, "pretrain_steps": meta["step"], "sft_steps": meta["sft_step"],
                     "lr": args.lr, "sft_lr": args.sft_lr, "seed": args.seed, "pretrain_final": meta.get("pretrain_final"),
                     "sft_final": meta.get("sft_final"), "train_seconds": round(meta.get("seconds", 0.0), 1),
                     "deadline": args.deadline, "pretrain_planned_steps": meta.get("planned")}
    ppl, n = heldout_perplexity(ew, ecfg, held_tok, args.seq, eo)
    results.update(heldout_perplexity=round(ppl, 3), heldout_scored_tokens=n)
    log(f"eval: held-out perplexity {ppl:.3f} over {n} tokens")
    acc, acc_given = mtp_accuracy(ew, ecfg, held_tok, args.seq, eo)
    results.update(mtp_top1=round(acc, 4), mtp_top1_given_target_right=round(acc_given, 4))
    log(f"eval: MTP top-1 {acc:.3f}, given the target's token right {acc_given:.3f}")
    if args.eval_functions > 0:
        held_funcs = []
        for _rel, text in held_files:
            held_funcs.extend(extract_functions(text))
        samples: list = []
        passed, ended, cases = function_body_parse_rate(ew, ecfg, tok, held_funcs, eo, limit=args.eval_functions,
                                                        device=dev, examples=samples)
        results.update(ast_parse_passed=passed, ast_parse_cases=cases, function_ended=ended,
                       ast_parse_rate=round(passed / max(cases, 1), 3), ast_samples=samples)
        log(f"eval: ast.parse {passed}/{cases}, function ended within budget {ended}/{cases}")
    results["chat"] = chat_check(ew, ecfg, tok, eo, dev, args.chat_tokens)
    for c in results["chat"]:
        log(f"eval: chat {json.dumps(c)[:400]}")
    results["fla_failed"] = F.FLA_FAILED
    results["wall_seconds"] = round(time.time() - t_start, 1)
    (model_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    shutil.copy(out / "train.log", model_dir / "train.log")
    write_model_card(model_dir)
    return 0
