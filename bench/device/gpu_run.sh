#!/usr/bin/env bash
# Everything measured on the GPU machine in one call (see docs/gpu.md).
# Expects: wheels for missing packages in .whl/, data/weights in .devdata/ (prepared by bench/device/prepare_devdata.sh).
# Usage on the device: bash bench/device/gpu_run.sh [harness|resnet50|camvid|tests|all]...
set -u
OUT=${OUT:-/tmp/qdeploy-gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  . bench/device/stage.sh; install_wheels /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 QDEPLOY_CACHE=/tmp/qdeploy-cache COLUMNS=160
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m qdeploy.cli doctor | tee -a "$OUT/gpu.txt"
steps=${*:-all}
for step in $steps; do
  case $step in
    harness|all) python3 bench/suites/harness_overhead.py --out "$OUT/harness.json" 2>&1 | tee "$OUT/harness.log" ;;&
    compile) python3 bench/suites/harness_overhead.py --repeats 1 --batch-sizes 1 --compile --out "$OUT/compile.json" > "$OUT/compile.log" 2>&1; tail -4 "$OUT/compile.log" ;;&
    resnet50|all) python3 -m qdeploy.cli --quiet bench bench/configs/gpu_resnet50.yaml --out "$OUT/resnet50" 2>&1 | tail -30 ;;&
    camvid|all) python3 -m qdeploy.cli --quiet run bench/configs/gpu_camvid_deeplabv3.yaml --out "$OUT/camvid" 2>&1 | tail -30 ;;&
    calib) python3 bench/suites/gpu_calibration.py --data .devdata2/cifar-train --model-file .devdata2/cifar_resnet.py --weights .devdata2/resnet20.pt --out "$OUT/calib.json" 2>&1 | grep -v "^W1121\|warn" | tail -6 ;;&
    tests|all) python3 -m pytest -q -ra tests -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -15 ;;&
    *) ;;
  esac
done
