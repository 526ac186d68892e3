#!/usr/bin/env bash
# bench/suites/gpu_reference.py on the real-size classifiers at 224 px (bench/train/train_realsize.py: CIFAR-10 resized
# to 224) on the device's GPU: `optimize --target torch-cuda` (max_drop 0.3) beside the hand-written references
# (eager, CUDA graph, torch.compile reduce-overhead, torch.compile + a hand CUDA graph in FP16 and BF16 channels_last,
# max-autotune), both sides also in fresh processes, alternating. Uses the weights bench/device/realsize_train.sh left in
# .realsize-weights/ of this warm machine (a fresh machine: train first). Carry .devzoo (pydantic, ...) and .devreal/eval:
#
#   run(command="MODELS='resnet50 deit_small' SECONDS_PER_MODEL=65 bash bench/device/realsize_train.sh", carry=[".devreal/train", ".devreal/eval"])
#   run(command="MODELS=resnet50 BATCHES=1,8,32,128 TAG=r50 bash bench/device/realsize_gpu.sh", carry=[".devzoo", ".devreal/eval"])
#
# The segmenter and the detector (bench/suites/realsize_cpu.py's rows, budget 1.0 mIoU / mAP points): DeepLabV3 reads
# .realsize-weights/seg/ (a call of `bash bench/device/realsize_unpack.sh seg` carrying .devreal/seg first), the
# detector BCCD from .devreal/det/bccd.tgz (carry it) and its committed weights:
#   run(command="MODELS='deeplabv3_camvid yolo_bccd640' BATCHES=1,8,32 TAG=segdet bash bench/device/realsize_gpu.sh", carry=[".devzoo", ".devreal/eval", ".devreal/det"])
#
# Env: MODELS, GPUS (default: every GPU there: on nvidia-h200-x2 two models at once, one a GPU, each on half the
# cores), BATCHES (default 1,8,32,128), TAG, SKIP_RECIPES (gpu_reference.py's --skip-recipes: recipe names with
# spaces, comma-separated, passed as one argument), GR_ARGS (more gpu_reference.py arguments, e.g. --skip-max-autotune,
# --fresh-repeats 3, --torchao float8-dynamic,int8-dynamic: torchao travels in .devzoo, --time-limit 150; on one GPU
# a 224 px model's search, references and alternating processes overrun a call: '--fresh-repeats 0' in one call,
# '--fresh-only --fresh-repeats 3' in the next, same warm machine, same BATCHES). Writes
# $OUT/realsize_gpu_$TAG.json (gpu_reference.py's rows; with several GPUs one file per GPU,
# realsize_gpu_${TAG}_gpu<i>.json), $OUT/<model>.log (each line with its time) and $OUT/<model>.optimize.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
MODELS=${MODELS:-resnet50} BATCHES=${BATCHES:-1,8,32,128} TAG=${TAG:-1}
OUT=${OUT:-/tmp/realsize-gpu-out}; mkdir -p "$OUT"
export OUT BATCHES TAG  # read by run_model in a lane's own bash
for m in $MODELS; do
  case $m in
    deeplabv3_camvid) [ -f .realsize-weights/seg/deeplabv3_fp16.pt ] || { echo "no .realsize-weights/seg on this"\
      "machine: run 'bash bench/device/realsize_unpack.sh seg' first (same warm machine), carrying .devreal/seg"; exit 3; } ;;
    yolo_bccd640) [ -f .devreal/det/bccd.tgz ] || { echo "carry .devreal/det (bash bench/device/stage_realsize.sh)"; exit 3; } ;;
    *) [ -f ".realsize-weights/$m.pt" ] || { echo "no .realsize-weights/$m.pt on this machine: run"\
      "bench/device/realsize_train.sh first (same warm machine)"; exit 3; } ;;
  esac
done
. bench/device/stage.sh; unpack_zoo_site
rm -rf /tmp/realeval /tmp/rsdd && mkdir -p /tmp/realeval /tmp/rsdd && tar -C /tmp/realeval -xzf .devreal/eval/cifar_test.tgz || exit 3
ln -s /tmp/realeval/test /tmp/rsdd/cifar-test  # gpu_reference.py reads DATA/cifar-test and DATA/<model>.pt
for m in $MODELS; do
  case $m in
    deeplabv3_camvid) ln -s "$PWD/.realsize-weights/seg" /tmp/rsdd/seg ;;  # DATA/seg: deeplabv3_fp16.pt, camvid/
    yolo_bccd640) tar -C /tmp/realeval -xzf .devreal/det/bccd.tgz && ln -s /tmp/realeval/bccd /tmp/rsdd/bccd ;;
    *) ln -s "$PWD/.realsize-weights/$m.pt" /tmp/rsdd/ ;;
  esac
done
export PYTHONPATH=/tmp/zsite:$PWD/src PYTHONUNBUFFERED=1 QDEPLOY_CACHE=/tmp/qdeploy-cache COLUMNS=200 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
python3 -c "import qdeploy.cli" || exit 2
LANES=$(gpu_lanes)
# one model's rows: gpu_reference.py's rows into JSON (one file per lane: two lanes never write one file), its log
# (each line with its time), the search's optimize.json
run_model() {
  local m=$1 json=$2 t0 r
  t0=$(date +%s)
  # shellcheck disable=SC2086  # GR_ARGS is a word list
  python3 bench/suites/gpu_reference.py "$m" --batches "$BATCHES" ${GR_ARGS:-} \
    ${SKIP_RECIPES:+--skip-recipes "$SKIP_RECIPES"} --data /tmp/rsdd --out /tmp/rsgpu --save-optimize "$OUT" \
    --json "$json" 2>&1 | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done > "$OUT/$m.log"
  r=${PIPESTATUS[0]}
  echo "$m exit $r in $(( $(date +%s) - t0 )) s"
  grep -E "ROW|optimize: (chosen|confirm)|Error|optimize exit|(eager|CUDA|torch.compile|qdeploy) " "$OUT/$m.log" | cut -c1-300 | head -40
  cp "/tmp/rsgpu/$m/optimize.json" "$OUT/$m.optimize.json" 2>/dev/null  # also after --fresh-only
  return "$r"
}
rc=0
if [ "$LANES" -le 1 ]; then
  for m in $MODELS; do run_model "$m" "$OUT/realsize_gpu_$TAG.json" || rc=$?; done
else
  # one model per GPU at once (bench/device/stage.sh's lanes), each lane's models in turn; the lanes' summaries after
  for i in $(seq 0 $((LANES - 1))); do
    # shellcheck disable=SC2086  # MODELS is a word list
    lm=$(lane_models "$i" "$LANES" $MODELS)
    [ -n "$lm" ] || continue
    ( r=0; for m in $lm; do
        in_lane "$i" "$LANES" env QDEPLOY_CACHE="/tmp/qdeploy-cache-lane$i" \
          bash -c "$(declare -f run_model); run_model \"\$@\"" _ "$m" "$OUT/realsize_gpu_${TAG}_gpu$i.json" || r=$?
      done > "$OUT/lane$i.summary" 2>&1; echo $r > "$OUT/.rc$i" ) &
  done
  wait
  for i in $(seq 0 $((LANES - 1))); do
    [ -f "$OUT/.rc$i" ] || continue
    echo "== GPU $i"; cat "$OUT/lane$i.summary"; r=$(cat "$OUT/.rc$i"); [ "$r" = 0 ] || rc=$r
    rm -f "$OUT/.rc$i" "$OUT/lane$i.summary"
  done
fi
echo "realsize_gpu.sh: $(( $(date +%s) - T0 )) s in this call"
exit $rc
