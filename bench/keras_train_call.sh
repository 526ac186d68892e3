#!/usr/bin/env bash
# The device command for bench/keras_train.py (Keras 3, torch backend): both models trained at once, one process each
# (on GPUs 0 and 1 where there are two, else sharing GPU 0: Keras' per-step Python overhead leaves a GPU mostly idle),
# into $OUT: resnet20_cifar.keras, efficientnet_b0_64.keras, their .train.json and .log. Carry .devkeras (filled by
# bench/keras_stage.sh). Every call is self-contained (a fresh machine each time). A file from $OUT comes back only
# under 16 MiB: efficientnet_b0_64.keras (17.1 MB) is split into NAME.part_aa, NAME.part_ab; join them here with
#   cat efficientnet_b0_64.keras.part_* > efficientnet_b0_64.keras
#   bash bench/keras_train_call.sh [MINUTES] [MODEL...]        (device tool: carry [".devkeras"], timeout_s 590)
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
mkdir -p /tmp/kerassite
for w in .devkeras/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/kerassite || exit 3; done
export PYTHONPATH=/tmp/kerassite KERAS_BACKEND=torch PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
NGPU=$(nvidia-smi -L | wc -l)
i=0
for m in $MODELS; do
  CUDA_VISIBLE_DEVICES=$((i % NGPU)) python3 bench/keras_train.py --model "$m" --packed .devkeras/cifar_train.npz \
    --out "$OUT" --minutes "$MINUTES" --end-by "$END_BY" --checkpoint-s 180 > "$OUT/$m.log" 2>&1 &
  i=$((i + 1))
done
wait
for m in $MODELS; do echo "== $m"; grep -v '^{"epoch"' "$OUT/$m.log" | tail -n 12; grep '^{"epoch"' "$OUT/$m.log" | awk 'NR % 10 == 1' ; grep '^{"epoch"' "$OUT/$m.log" | tail -n 3; done
for f in "$OUT"/*.keras; do
  [ "$(stat -c %s "$f")" -gt 15000000 ] && split -b 15000000 "$f" "$f.part_" && rm "$f"
done
ls -la "$OUT"
echo "call took $(( $(date +%s) - T0 )) s"
