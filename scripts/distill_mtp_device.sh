#!/usr/bin/env bash
# Distil the demo model's MTP drafter layer in one call on the lent GPU (the `device` tool's `run`, carry
# [".whl"] holding fla_core-0.5.2-py3-none-any.whl for the frozen target's KDA layers):
#     bash scripts/distill_mtp_device.sh [SECONDS_PER_VARIANT] [VARIANTS]     (defaults 22, data:1,data:3,greedy:3,mix:3)
# Every variant (DATA:UNROLL, workers/model/train/distill_mtp.py) trains from the committed MTP layer for the
# same time; each one's acceptance replay on held-out code is logged. The Python process is stopped after
# DEADLINE s (default 200); whatever exists then is copied to $OUT: distill.log, and distill.tar (compare.json,
# distill.json = the best variant's record, v-DATA-uUNROLL/{mtp.safetensors,distill.json}). Import one here with
#     tar -C /tmp/d -xf /work/.device/N/distill.tar
#     python scripts/train_demo_model.py --distill-mtp --init models/k3-demo-stdlib --out DIR \
#         --apply-mtp /tmp/d/v-mix-u3/mtp.safetensors --record /tmp/d/v-mix-u3/distill.json
# DISTILL_ARGS adds options (e.g. --batch, --lr, --greedy-seconds).
set -uo pipefail
PER=${1:-22}
VARIANTS=${2:-data:1,data:3,greedy:3,mix:3}
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/k3 . >/dev/null 2>&1
export PYTHONPATH=/tmp/k3:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/d
timeout "${DEADLINE:-200}" python3 scripts/train_demo_model.py --distill-mtp --init models/k3-demo-stdlib --out /tmp/d \
    --variants "$VARIANTS" --seconds "$PER" --greedy-seconds 12 --save-every 1000 ${DISTILL_ARGS:---greedy-prompt 64} 2>&1 \
    | grep -v -i "warn\|detach()\|err = float"
cp /tmp/d/distill.log "$OUT/"
(cd /tmp/d && tar -cf "$OUT/distill.tar" --exclude='*.pt' --exclude='k3-demo-stdlib' $(ls -d compare.json distill.json v-* 2>/dev/null))
ls -la "$OUT"
