"""The demo model's card (README.md in the model directory), written from the run's results.json."""

from __future__ import annotations

import json
from pathlib import Path

LICENSE_NOTE = (
    "The training text is the Python standard library of the training machine's CPython "
    "(its `Lib/` `*.py` files), distributed under the Python Software Foundation License Version 2 "
    "(PSF-2.0, https://docs.python.org/3/license.html). The weights are a derivative of that text."
)


def model_card(results: dict) -> str:
    r = results
    pf, sf = r.get("pretrain_final") or {}, r.get("sft_final") or {}
    lines = [
        f"# {r['name']}: a small trained K3-architecture demo model",
        "",
        "Every K3 layer type: KDA (6 layers) and MLA (2 layers, NoPE, output gate) in a 3:1 pattern, Block",
        "Attention Residuals (block 2), LatentMoE (16 routed experts, top-2, latent 96, MXFP4, one shared",
        "expert), SiTU, tied embeddings, plus one MTP drafter layer. Hidden size 192. Config: `config.json`.",
        "",
        f"Reproduce: `python scripts/train_demo_model.py --out DIR --batch {r['batch']} --seq {r['seq']} "
        f"--pretrain-steps {r['pretrain_steps']} --sft-steps {r['sft_steps']}` on a GPU (FLA's `chunk_kda` when "
        "installed, else a chunked PyTorch KDA), or `bash scripts/train_demo_model_device.sh"
        f"{' ' + str(int(r['deadline'])) if r.get('deadline') else ''}` on the lent H200.",
        *([f"This run was time-boxed (`--deadline {r['deadline']:g}`): its cosine schedule was planned for "
           f"{r['pretrain_planned_steps']} pretraining steps and the deadline ended it at {r['pretrain_steps']}, "
           "so a rerun by step counts matches it up to that schedule horizon and GPU rounding."]
          if r.get("pretrain_planned_steps") not in (None, r["pretrain_steps"]) else []),
        "",
        "## Data",
        f"* {r['files']} files, {r['text_mb']} MB, from `{r['stdlib']}`; split by a hash of the path: "
        f"{r['train_files']} training files ({r['train_tokens']} tokens), {r.get('valid_files', 0)} validation files "
        f"(they pick the pretraining snapshot), {r['heldout_files']} held-out files ({r['heldout_tokens']} tokens, "
        "read only by the evaluation below).",
        f"* Tokenizer: byte-level BPE trained on the training files, {r['vocab']} ids (incl. K3's 256 specials), "
        "tiktoken format (`tiktoken.model`, `tokenizer_config.json`).",
        f"* License: {LICENSE_NOTE}",
        "* Chat fine-tune: examples built from training-file functions and rendered by the K3 chat program "
        "(write-a-function, explain, tool calls), loss on the assistant's tokens.",
        "",
        "## Training",
        f"* Pretraining: {r['pretrain_steps']} steps of {r['batch']}x{r['seq']} tokens, AdamW lr {r['lr']} "
        f"(warm-up, cosine); final train loss {pf.get('loss')}, validation loss {pf.get('val')}, "
        f"MTP loss {pf.get('mtp')}; routed experts fake-quantized to MXFP4 at the end.",
        *([f"* The validation loss rose at the end of pretraining: the step-{r['pretrain_restored']['step']} "
           f"weights (validation {r['pretrain_restored']['val']}) were restored before the fine-tune."]
          if r.get("pretrain_restored") else []),
        f"* Chat fine-tune: {r['sft_steps']} steps, lr {r['sft_lr']}; final assistant-token loss "
        f"{sf.get('sft_loss')}.",
        f"* KDA implementation used in training: {r['kda_impl']}; wall time {r.get('wall_seconds')} s.",
        "",
        "## Evaluation (on the exported MXFP4 checkpoint)",
        f"* Held-out perplexity: **{r['heldout_perplexity']}** over {r['heldout_scored_tokens']} tokens "
        f"(windows of {r['seq']}).",
    ]
    if "ast_parse_cases" in r:
        lines.append(f"* Greedy completions of held-out function bodies that parse (`ast.parse`): "
                     f"**{r['ast_parse_passed']}/{r['ast_parse_cases']}** ({r['ast_parse_rate']:.0%}); the function "
                     f"ended within 128 new tokens in {r['function_ended']}/{r['ast_parse_cases']} "
                     "(definition: workers/model/train/evaluate.py).")
    lines.append(f"* MTP layer, teacher-forced top-1 on x(t+2): {r['mtp_top1']}; where the target's own next token "
                 f"is right: {r['mtp_top1_given_target_right']}.")
    lines += ["", "## Chat checks (greedy)", ""]
    for c in r.get("chat", []):
        lines.append(f"* {json.dumps(c['request'])}: content {json.dumps((c['content'] or '')[:160])}, "
                     f"reasoning {json.dumps((c['reasoning'] or '')[:80])}, tool calls {json.dumps(c['tool_calls'])}, "
                     f"finished {c['finished']}")
    lines.append("")
    return "\n".join(lines)


def write_model_card(model_dir: str | Path) -> Path:
    d = Path(model_dir)
    results = json.loads((d / "results.json").read_text())
    path = d / "README.md"
    path.write_text(model_card(results))
    return path
