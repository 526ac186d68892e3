#!/usr/bin/env bash
# bench/train/train_realsize.py on the device machine's GPU: the real-size classifiers (CIFAR-10 resized to 224), written
# to .realsize-weights/ in the repository root there (git-ignored, never carried: a warm machine keeps it for the Xeon
# calls of bench/device/realsize_cpu.sh; a fresh one needs this call again). Stage here first: bash
# bench/device/stage_realsize.sh.
#
#   run(command="SECONDS_PER_MODEL=70 bash bench/device/realsize_train.sh", carry=[".devreal/train", ".devreal/eval"], timeout_s=600)
#
# Env: MODELS (default: all six), SECONDS_PER_MODEL (70), GPUS (default: every GPU there; on nvidia-h200-x2 two models
# train at once, one a GPU). Writes $OUT/realsize_train.log and $OUT/realsize_train.json
# (each model's top-1 on the 2,000 carried test images, epochs, training seconds, images/s).
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
MODELS=${MODELS:-"resnet50 mobilenet_v3_large efficientnet_b0 convnext_tiny swin_tiny deit_small"}
OUT=${OUT:-/tmp/realsize-out}; mkdir -p "$OUT"
[ -f .devreal/train/cifar_train.tgz ] && [ -f .devreal/eval/cifar_test.tgz ] || {
  echo "carry .devreal/train and .devreal/eval (bash bench/device/stage_realsize.sh here)"; exit 3; }
rm -rf /tmp/realdata && mkdir -p /tmp/realdata
tar -C /tmp/realdata -xzf .devreal/train/cifar_train.tgz && tar -C /tmp/realdata -xzf .devreal/eval/cifar_test.tgz || exit 3
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
. bench/device/stage.sh
LANES=$(gpu_lanes)
rc=0
# one training process per GPU lane (bench/device/stage.sh), its models in turn
for i in $(seq 0 $((LANES - 1))); do
  # shellcheck disable=SC2046,SC2086  # word lists
  lm=$(lane_models "$i" "$LANES" $MODELS)
  [ -n "$lm" ] || continue
  ( in_lane "$i" "$LANES" python3 bench/train/train_realsize.py --data /tmp/realdata --out .realsize-weights \
      --models $lm --seconds "${SECONDS_PER_MODEL:-70}" > "$OUT/realsize_train.lane$i.log" 2>&1
    echo $? > "$OUT/.rc$i" ) &
done
wait
: > "$OUT/realsize_train.log"
for i in $(seq 0 $((LANES - 1))); do
  [ -f "$OUT/.rc$i" ] || continue
  { [ "$LANES" -gt 1 ] && echo "== GPU $i"; cat "$OUT/realsize_train.lane$i.log"; } | tee -a "$OUT/realsize_train.log"
  r=$(cat "$OUT/.rc$i"); [ "$r" = 0 ] || rc=$r
  rm -f "$OUT/.rc$i" "$OUT/realsize_train.lane$i.log"
done
python3 - "$OUT/realsize_train.json" <<'PY'
import json, pathlib, sys
rows = [json.loads(p.read_text()) for p in sorted(pathlib.Path(".realsize-weights").glob("*.json"))]
pathlib.Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))
PY
ls -la .realsize-weights
echo "train_realsize.py exit $rc; $(( $(date +%s) - T0 )) s in this call"
exit $rc
