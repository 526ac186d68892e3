#!/usr/bin/env bash
# One device call for issue 37 on the GPU, after bench/device/stage_detection_gpu.sh (DEST=.devdet):
#   run(command="bash bench/device/detection_gpu_call.sh", carry=[".devdet"])
# 1. `qdeploy optimize --target torch-cuda` (max_drop 1.0 mAP points) on the BCCD YOLO detector of the repo
#    (bench/weights/bccd_yolo.pt), the confirm split of BCCD's test split; its log and optimize.json come back.
# 2. bench/train/train_bccd.py ssdlite on the GPU (torchvision's SSDlite320-MobileNetV3-Large from scratch) in what is left of
#    the call (SSD_S seconds at most), its FP16 weights + .json come back.
set -u
DEVDET=${DEVDET:-.devdet}
OUT=${OUT:-/tmp/det-out}; mkdir -p "$OUT"
T0=$(date +%s)
. bench/device/stage.sh; install_wheels /tmp/site "$DEVDET"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QDEPLOY_CACHE=/tmp/qdeploy-cache COLUMNS=200
mkdir -p /tmp/dd && tar -C /tmp/dd -xzf "$DEVDET"/bccd.tgz || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; lscpu | grep 'Model name'
python3 -c "import torch, torchvision, pycocotools; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
python3 -c "import qdeploy.cli, qdeploy.tasks.detection_metrics" || exit 2
sed -e "s#\.\./bench/#$PWD/bench/#g; s#\.\./\.\./shared/data/detection/bccd#/tmp/dd/bccd#g" examples/detection_bccd.yaml |
  python3 -c "
import sys, yaml
c = yaml.safe_load(sys.stdin); c['variants'] = [{'engine': 'torch', 'precision': 'fp32'}]
c['optimize'] = {'target': 'torch-cuda', 'budget': {'max_drop': 1.0}}
yaml.safe_dump(c, open('/tmp/bccd_cuda.yaml', 'w'))" || exit 2
if [ "${SKIP_OPT:-0}" != 1 ]; then
  python3 -m qdeploy optimize /tmp/bccd_cuda.yaml --out /tmp/opt-yolo > "$OUT/optimize_yolo.log" 2>&1
  echo "optimize torch-cuda exit $? in $(( $(date +%s) - T0 )) s"
  grep -E "chosen|confirm|budget|p50 at|Error|error" "$OUT/optimize_yolo.log" | cut -c1-300 | tail -25
  cp /tmp/opt-yolo/optimize.json "$OUT/optimize_yolo.json" 2>/dev/null
fi
LEFT=$(( ${CALL_S:-570} - ($(date +%s) - T0) - 45 ))
SSD_S=$(( LEFT < ${SSD_S:-400} ? LEFT : ${SSD_S:-400} ))
echo "ssdlite: $SSD_S s of training"
[ "$SSD_S" -gt 60 ] && python3 bench/train/train_bccd.py ssdlite --data /tmp/dd/bccd --out "$OUT/bccd_ssdlite.pt" --epochs 2000 \
  --time-limit "$SSD_S" --device cuda ${SSD_INIT:+--init "$SSD_INIT"} ${SSD_LR:+--lr "$SSD_LR"} > "$OUT/train_ssdlite.log" 2>&1
echo "train exit $?"; tail -4 "$OUT/train_ssdlite.log"
