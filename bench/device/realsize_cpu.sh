#!/usr/bin/env bash
# bench/suites/realsize_cpu.py on the device machine's Xeon (16 cores; the GPU hidden: CUDA_VISIBLE_DEVICES=), on the
# weights bench/device/realsize_train.sh left in .realsize-weights/ of this warm machine (a fresh machine: train first).
# Carry .devzoo (bench/device/stage_zoo_device.sh: openvino, nncf, pydantic, ...) and .devreal/eval
# (bench/device/stage_realsize.sh: the test and calibration images):
#
#   run(command="MODELS=resnet50 TAG=r50 bash bench/device/realsize_cpu.sh", carry=[".devzoo", ".devreal/eval"], timeout_s=600)
#
# A model without weights there is trained first in this call when .devreal/train travels too (its training seconds
# are in realsize_train.json and the row's "training").
# efficientnet_lite0 and deeplabv3_camvid read .realsize-weights/lite0/ and seg/, which a call of
# bench/device/realsize_unpack.sh leaves there (staged here by bench/device/stage_realsize_lite0.sh / _seg.sh).
# Env: MODELS (space-separated), ROWS (realsize_cpu.py --rows; default "1:16,4 16:16"), TAG, BUDGET (the call's
# seconds, default 560: no row starts after BUDGET-PER_ROW s, PER_ROW 150), ARGS (more arguments). Writes
# $OUT/realsize_cpu_$TAG.json (rewritten after each row), $OUT/realsize_cpu_$TAG.log (each line with its time) and
# each row's optimize.json. A row whose harness the call's limit cut is finished by the same command in the next call
# on the same warm machine: optimize's answer is read back from /tmp/realsize-runs (realsize_cpu.optimized), the
# harness's quantized models from its reuse folder.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
MODELS=${MODELS:-resnet50} ROWS=${ROWS:-"1:16,4 16:16"} TAG=${TAG:-1} BUDGET=${BUDGET:-560} PER_ROW=${PER_ROW:-150}
OUT=${OUT:-/tmp/realsize-out}; mkdir -p "$OUT"
missing=""; STAGED_ARGS=""
staged() {  # staged NAME FILE: a row whose weights and data realsize_unpack.sh NAME left on this machine
  [ -f ".realsize-weights/$1/$2" ] || { echo "no .realsize-weights/$1 on this machine: run"\
    "'bash bench/device/realsize_unpack.sh $1' first (same warm machine), carrying .devreal/$1"; exit 3; }
}
for m in $MODELS; do
  if [ "$m" = efficientnet_lite0 ]; then  # ImageNet weights and images
    staged lite0 lite0_fp16.pt
    STAGED_ARGS="$STAGED_ARGS --imagenet $PWD/.realsize-weights/lite0/imagenet --lite0-weights $PWD/.realsize-weights/lite0/lite0_fp16.pt"
    continue
  fi
  if [ "$m" = deeplabv3_camvid ]; then  # ../shared's CamVid DeepLabV3 and CamVid frames
    staged seg deeplabv3_fp16.pt
    STAGED_ARGS="$STAGED_ARGS --camvid $PWD/.realsize-weights/seg/camvid --deeplabv3-weights $PWD/.realsize-weights/seg/deeplabv3_fp16.pt"
    continue
  fi
  if [ "$m" = yolo_bccd640 ]; then  # committed weights; BCCD from .devreal/det/bccd.tgz (stage_realsize.sh): carry it
    STAGED_ARGS="$STAGED_ARGS --bccd /tmp/realeval/bccd"
    continue
  fi
  [ -f ".realsize-weights/$m.pt" ] || missing="$missing $m"
done
if [ -n "$missing" ]; then  # a fresh machine: train them here if the training images travelled, else stop
  [ -f .devreal/train/cifar_train.tgz ] || { echo "no weights for$missing on this machine and no .devreal/train carried:"\
    "run bench/device/realsize_train.sh first (on the same warm machine) or carry .devreal/train"; exit 3; }
  MODELS="${missing# }" OUT=$OUT bash bench/device/realsize_train.sh || exit 4
fi
. bench/device/stage.sh; unpack_zoo_site
rm -rf /tmp/realeval && mkdir -p /tmp/realeval && for t in .devreal/eval/*.tgz .devreal/det/*.tgz; do [ -f "$t" ] || continue; tar -C /tmp/realeval -xzf "$t" || exit 3; done
export PYTHONPATH=/tmp/zsite:$PWD/src:$PWD/.realsize-weights/lite0 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= QDEPLOY_CACHE=/tmp/qdeploy-cache \
       COLUMNS=160 NO_COLOR=1
lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-600
left=$(( BUDGET - ($(date +%s) - T0) ))
# shellcheck disable=SC2086  # MODELS, ROWS and ARGS are word lists
timeout $(( left - 10 )) python3 bench/suites/realsize_cpu.py --weights .realsize-weights --cifar /tmp/realeval \
  --models $MODELS --rows $ROWS --budget $(( left - PER_ROW )) --out /tmp/realsize-runs \
  --json "$OUT/realsize_cpu_$TAG.json" $STAGED_ARGS ${ARGS:-} 2>&1 | grep --line-buffered -v '━' |
  while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done | tee "$OUT/realsize_cpu_$TAG.log"  # each line's time
rc=${PIPESTATUS[0]}
for j in /tmp/realsize-runs/*/optimize.json; do  # each row's search record (stages, times) comes back beside the log
  [ -f "$j" ] && cp "$j" "$OUT/optimize_${TAG}_$(basename "$(dirname "$j")").json"
done
echo "realsize_cpu.py exit $rc; $(( $(date +%s) - T0 )) s in this call"
exit $rc
