#!/usr/bin/env bash
# Train the demo model in one call on the lent GPU (the `device` tool's `run`, carry [".whl"] holding
# fla_core-0.5.2-py3-none-any.whl; without it training uses the chunked PyTorch KDA):
#     bash scripts/train_demo_model_device.sh [DEADLINE_SECONDS]       (default 340; run with timeout_s 410)
# The training process gets DEADLINE seconds of wall clock (FLA's compiles included: they shorten the
# pretraining, measured after they happen) and is killed 20 s after it; whatever exists is copied to $OUT
# in any case. Writes $OUT/k3-demo-stdlib.tar (the model directory: checkpoint, tokenizer, results.json,
# README.md), $OUT/ckpt-*.pt + ckpt-meta.json (resume with RESUME=DIR) and $OUT/train.log. Import here with
#     tar -C models -xf /work/.device/N/k3-demo-stdlib.tar
# TRAIN_ARGS replaces the default training options below (batch, fine-tune length).
set -uo pipefail
DEADLINE=${1:-340}
TRAIN_ARGS=${TRAIN_ARGS:---batch 128 --sft-seconds 60 --sft-steps 600}
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/k3 . >/dev/null 2>&1
export PYTHONPATH=/tmp/k3:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
timeout $((DEADLINE + 20)) python3 scripts/train_demo_model.py --out /tmp/run --deadline "$DEADLINE" \
    --pretrain-seconds 100000 --save-every 60 ${RESUME:+--resume "$RESUME"} $TRAIN_ARGS 2>&1 \
    | grep -v -i "warn\|detach()\|err = float"
tar -C /tmp/run -cf "$OUT/k3-demo-stdlib.tar" k3-demo-stdlib
cp /tmp/run/ckpt-* /tmp/run/train.log "$OUT/"
ls -la "$OUT"
