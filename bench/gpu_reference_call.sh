#!/usr/bin/env bash
# One device call of issue #22's goal (bench/gpu_reference.py), one or more models:
#   bash bench/gpu_reference_call.sh convnext [deit effnet]
# carries .whl (pydantic: the GPU machine lacks it) and .devdata/g22/cifar-test.tar + the models' .pt files (prepared
# by: mkdir -p .devdata/g22 && tar -C ../shared/data/cifar10 -cf .devdata/g22/cifar-test.tar test && cp <weights> .devdata/g22/).
# Writes $OUT/<model>.log, $OUT/<model>.optimize.json and $OUT/gpu_reference.json (rows of this call).
set -u
OUT=${OUT:-/tmp/gr-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QDEPLOY_CACHE=/tmp/qdeploy-cache COLUMNS=200
mkdir -p /tmp/dd && tar -C /tmp/dd -xf .devdata/g22/cifar-test.tar && rm -rf /tmp/dd/cifar-test && mv /tmp/dd/test /tmp/dd/cifar-test
cp .devdata/g22/*.pt /tmp/dd/
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; nproc
python3 -c "import torch, timm, onnx, onnxruntime; print('torch', torch.__version__, 'timm', timm.__version__)"
python3 -c "import qdeploy.cli" || exit 2
for m in "$@"; do
  python3 bench/gpu_reference.py "$m" --data /tmp/dd --out /tmp/gr --json "$OUT/gpu_reference.json" > "$OUT/$m.log" 2>&1
  echo "$m exit $?"; grep -E "^ROW|optimize: (chosen|confirm|load_model)|Error|error|optimize exit" "$OUT/$m.log" | head -30
  cp /tmp/gr/$m/optimize.json "$OUT/$m.optimize.json" 2>/dev/null
done
