#!/usr/bin/env bash
# One call on the lent GPU machine (the `device` tool), carrying `.whl` (fla_core). Steps, in order given:
#   tests      tests/gpu (kernels vs references, the engine end to end on CUDA, the small preset)
#   roofline   benchmarks/decode_roofline.py (ROOFLINE_ARGS, default --profile: CUDA graphs, then eager)
#   profile    benchmarks/kernel_profile.py (per-kernel breakdown)
#   sweeps     every benchmarks/sweep_*.py, or the files in SWEEPS (kernel variants and knobs; each stopped after
#              SWEEP_TIMEOUT s, default 100; SWEEP_ARGS adds arguments)
#   bench      benchmarks/kernels.py (full table; BENCH_ARGS adds arguments)
#   vs         benchmarks/vs_transformers.py --device cuda (VS_ARGS, default: 32 and 64 prompts, 2 repeats, the 6
#              slowest steps)
#   gpumodel   the vs-transformers model's decode steps: vs_transformers.py --save-model /tmp/gm once, then
#              decode_roofline.py --model /tmp/gm (GPUMODEL_ARGS, default: B = 32 64 1, graphs, --breakdown; add
#              e.g. --set k3serve.workers.engine.k3_forward.FUSED_ADD_NORM=0 for the other side of a knob)
#   gpumixed   the same model's prefill and mixed steps: mixed_step.py --model /tmp/gm (GPUMIXED_ARGS, default: a
#              16384-token chunk beside 8 decodes, 2 repeats, the top 30 kernels of each step)
#   moeprefill benchmarks/sweep_moe_prefill.py (MOEPREFILL_ARGS): the MoE on unpacked bf16 experts at prefill sizes,
#              16-row dot vs 64-row dense with the atomic and the per-pair combine
# Logs go to $OUT/<step>.log.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/k3 . >/dev/null
export PYTHONPATH=/tmp/k3:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 K3SERVE_HOME=/tmp/k3home
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
gpu_model() {  # the vs-transformers comparison's checkpoint, written once a call
  [ -f /tmp/gm/config.json ] || python3 benchmarks/vs_transformers.py --device cuda --size gpu --save-model /tmp/gm \
    >/dev/null 2>&1
}
for step in "$@"; do
  t=$(date +%s)
  case $step in
    tests) python3 -m pytest ${TESTS:-tests/gpu} -q -p no:cacheprovider --timeout 300 -rs -s --durations=12 2>&1 | tee "$OUT/tests.log" | grep -v "^$" | tail -40 ;;
    roofline) python3 benchmarks/decode_roofline.py ${ROOFLINE_ARGS:---profile} 2>&1 | tee "$OUT/roofline.log" ;;
    profile) python3 benchmarks/kernel_profile.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" ;;
    sweeps) for f in ${SWEEPS:-benchmarks/sweep_*.py}; do n=$(basename "$f" .py); echo "## $n";
              timeout ${SWEEP_TIMEOUT:-100} python3 "$f" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/$n.log"; done ;;
    bench) python3 benchmarks/kernels.py --tsv "$OUT/bench.tsv" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" ;;
    vs) python3 benchmarks/vs_transformers.py --device cuda ${VS_ARGS:---num-prompts 32 64 --repeats 2 --slow-steps 6} \
          2>&1 | grep -v "Warning\|warn(" | tee "$OUT/vs.log" ;;
    gpumodel) gpu_model
              python3 benchmarks/decode_roofline.py --model /tmp/gm \
                ${GPUMODEL_ARGS:---batches 32 64 1 --prompt 512 --steps 32 --modes graphs --breakdown} 2>&1 \
                | grep -v "Warning\|warn(" | tee -a "$OUT/gpumodel.log" ;;
    gpumixed) gpu_model
              python3 benchmarks/mixed_step.py --model /tmp/gm \
                ${GPUMIXED_ARGS:---chunk 16384 --decodes 8 --context 512 --repeats 2 --top 30} 2>&1 \
                | grep -v "Warning\|warn(" | tee -a "$OUT/gpumixed.log" ;;
    moeprefill) python3 benchmarks/sweep_moe_prefill.py ${MOEPREFILL_ARGS:-} 2>&1 | grep -v "Warning\|warn(" \
                  | tee "$OUT/moeprefill.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "# step $step: $(( $(date +%s) - t )) s"
done
