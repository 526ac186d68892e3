#!/usr/bin/env bash
# One device call of issue #11's GPU measurements (bench/suites/optimize_gpu.py), staged like bench/device/qat_gpu_call.sh:
#   bash bench/device/optimize_gpu_call.sh TAG [EXPERIMENT...]
# merges .devdata/TAG (if carried) into /tmp/dd, installs .devsite.tar.xz once into /tmp/site, runs the experiments
# (none: stage only), writes $OUT/optimize_gpu.json, $OUT/TAG.log and the optimize.json/html of each run.
set -u
tag=$1; shift
OUT=${OUT:-/tmp/optimize-gpu-out}; mkdir -p "$OUT"
. bench/device/stage.sh; stage_devsite  # wheels, data merge, PYTHONPATH
[ $# -eq 0 ] && exit 0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
[ -f /tmp/optimize_gpu.json ] && cp /tmp/optimize_gpu.json "$OUT/"
python3 bench/suites/optimize_gpu.py "$@" --data /tmp/dd --out /tmp/opt-runs --json "$OUT/optimize_gpu.json" 2>&1 | grep -v -i "warn" \
  | tee "$OUT/$tag.log" | grep -E "^===|optimize: (fallback|QAT|chosen|confirm|no PTQ)|Error|error" | tail -60
cp "$OUT/optimize_gpu.json" /tmp/optimize_gpu.json 2>/dev/null
for d in /tmp/opt-runs/*/; do n=$(basename $d); cp $d/optimize.json "$OUT/$n.optimize.json" 2>/dev/null; cp $d/optimize.html "$OUT/$n.optimize.html" 2>/dev/null; done
