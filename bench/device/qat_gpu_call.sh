#!/usr/bin/env bash
# One device call of issue #9's GPU measurements (see bench/suites/qat_gpu.py and bench/device/stage_gpu_data.sh).
# Usage on the device: bash bench/device/qat_gpu_call.sh TAG [EXPERIMENT...] [-- qat_gpu.py options]
#   merges .devdata/TAG (if carried) into /tmp/dd, installs .devsite.tar.xz once into /tmp/site, runs the experiments,
#   writes $OUT/qat_gpu_TAG.json and $OUT/TAG.log.
set -u
tag=$1; shift
OUT=${OUT:-/tmp/qat-gpu-out}; mkdir -p "$OUT"
. bench/device/stage.sh; stage_devsite  # wheels, data merge, PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 bench/suites/qat_gpu.py --data /tmp/dd --json "$OUT/qat_gpu_$tag.json" "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/$tag.log" | grep -E "^===|qdeploy qat:|r50-train:|Error|error" | tail -60
