#!/usr/bin/env bash
# One device call of bench/suites/gpu_reference.py (issues 22, 35), one or more models, after bench/device/stage_gpu_reference.sh:
#   run(command="bash bench/device/gpu_reference_call.sh hf_vit", carry=[".devgr"])   (GR_ARGS=--skip-max-autotune: without it)
# DEVGR=.devgr2 reads another staging (stage_gpu_reference.sh with DEST=.devgr2): the next call is staged while one runs.
# Writes $OUT/<model>.log, $OUT/<model>.optimize.json and $OUT/gpu_reference.json (this call's rows); at most 8 files
# come back, so at most 3 models per call.
set -u
DEVGR=${DEVGR:-.devgr}
OUT=${OUT:-/tmp/gr-out}; mkdir -p "$OUT"
. bench/device/stage.sh; install_wheels /tmp/site "$DEVGR"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QDEPLOY_CACHE=/tmp/qdeploy-cache COLUMNS=200 HF_HUB_OFFLINE=1
python3 bench/device/unpack_image_npz.py "$DEVGR"/cifar-test.npz /tmp/dd/cifar-test || exit 1
cp "$DEVGR"/*.pt bench/weights/*.pt /tmp/dd/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader; nproc; lscpu | grep 'Model name'
python3 -c "import torch, timm, transformers; print('torch', torch.__version__, 'timm', timm.__version__, 'transformers', transformers.__version__)"
python3 -c "import qdeploy.cli" || exit 2
for m in "$@"; do
  t0=$(date +%s)
  python3 bench/suites/gpu_reference.py "$m" ${GR_ARGS:-} --data /tmp/dd --out /tmp/gr --json "$OUT/gpu_reference.json" > "$OUT/$m.log" 2>&1
  echo "$m exit $? in $(( $(date +%s) - t0 )) s"
  grep -E "^ROW|optimize: (chosen|confirm|load_model)|Error|error|optimize exit|^(eager|CUDA|torch.compile|qdeploy) " "$OUT/$m.log" | cut -c1-400 | head -30
  cp /tmp/gr/$m/optimize.json "$OUT/$m.optimize.json" 2>/dev/null
done
