#!/usr/bin/env bash
# The device command for bench/train/keras_train.py (Keras 3, torch backend): the models named trained at once, one process
# each (on GPUs 0 and 1 where there are two, else sharing GPU 0: Keras' per-step Python overhead leaves a GPU mostly idle),
# into $OUT: resnet20_cifar.keras, efficientnet_b0_64.keras, their .train.json and .log. Carry .devkeras (filled by
# bench/device/keras_stage.sh). A call is self-contained unless it resumes (below). A file from $OUT comes back only
# under 16 MiB: efficientnet_b0_64.keras (17.1 MB) is split into NAME.part_aa, NAME.part_ab; join them here with
#   cat efficientnet_b0_64.keras.part_* > efficientnet_b0_64.keras
#   bash bench/device/keras_train_call.sh [MINUTES] [MODEL[:TAG]...]  (device tool: carry [".devkeras"], timeout_s 590)
# MODEL:TAG trains into $OUT/TAG with the extra keras_train.py arguments in $ARGS_TAG (two recipes of one model side by
# side). A schedule longer than one call: ARGS_TAG="--until 0.5" in the first call; in the next, RESUME=FOLDER (the
# files of the first call, one TAG subfolder each; split parts are joined here) goes on to the end. The data, wheels and
# one checkpoint (weights 17 MB + SGD momentum 16 MB) exceed what a call carries (64 MiB), so the next call must come
# while the machine is still warm (about 30 s): RESUME=/tmp/keras_last, the previous call's $OUT kept on the machine.
# Training stops at MINUTES or when the call's own limit nears (CALL_LIMIT_S, default 565 s after this script starts,
# minus 25 s to save), whichever is first.
set -u
T0=$(date +%s)
MINUTES=${1:-9.5}
shift || true
MODELS=${*:-resnet20 efficientnet_b0}
END_BY=$((T0 + ${CALL_LIMIT_S:-565}))
: "${OUT:?OUT (the folder that comes back) is not set}"
echo "device already has: $(python3 -c 'import importlib.util as u; print([m for m in ("keras", "ml_dtypes", "rich", "h5py", "optree", "absl", "namex") if u.find_spec(m)])')"
if ! python3 -c "import keras" 2>/dev/null; then  # the device image has no Keras: the staged wheels
  mkdir -p /tmp/kerassite
  for w in .devkeras/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/kerassite || exit 3; done
  export PYTHONPATH=/tmp/kerassite
fi
export KERAS_BACKEND=torch PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
i=0
for spec in $MODELS; do
  m=${spec%%:*}; tag=${spec#*:}; [ "$tag" = "$spec" ] && tag=$m
  extra_var="ARGS_$tag"; extra=${!extra_var:-}
  resume=()
  if [ -n "${RESUME:-}" ]; then
    d="$RESUME/$tag"; [ -d "$d" ] || d="$RESUME"
    for parts in "$d"/*.part_aa; do [ -e "$parts" ] && cat "${parts%.part_aa}".part_* > "${parts%.part_aa}"; done
    resume=(--resume "$d")
  fi
  out="$OUT"; [ "$tag" != "$m" ] && out="$OUT/$tag"
  mkdir -p "$out"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$((i % NGPU)) python3 bench/train/keras_train.py --model "$m" --packed .devkeras/cifar_train.npz \
    --out "$out" --minutes "$MINUTES" --end-by "$END_BY" --checkpoint-s 180 "${resume[@]}" $extra > "$out/$m.log" 2>&1 &
  i=$((i + 1))
done
wait
for log in $(find "$OUT" -name '*.log' | sort); do
  echo "== $log"; grep -v '^{"epoch"' "$log" | tail -n 12; grep '^{"epoch"' "$log" | awk 'NR % 10 == 1'; grep '^{"epoch"' "$log" | tail -n 3
done
rm -rf /tmp/keras_last && cp -r "$OUT" /tmp/keras_last  # a warm machine keeps it: the next call can RESUME=/tmp/keras_last
find "$OUT" -name '*.optimizer.npz' -delete  # needed only to resume, from /tmp/keras_last: not sent back
find "$OUT" -type f -size +15000000c | while read -r f; do split -b 15000000 "$f" "$f.part_" && rm "$f"; done
ls -laR "$OUT"
echo "call took $(( $(date +%s) - T0 )) s"
