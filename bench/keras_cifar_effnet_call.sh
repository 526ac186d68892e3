#!/usr/bin/env bash
# On the device: EfficientNetB0 alone (bench/keras_cifar.py), MINUTES of training into $OUT.  bash bench/keras_cifar_effnet_call.sh MINUTES [BATCH] [LR]
set -eu
mkdir -p /tmp/kerassite
for w in .devkeras2/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/kerassite; done
export PYTHONPATH=/tmp/kerassite KERAS_BACKEND=torch PYTHONUNBUFFERED=1
python3 bench/keras_cifar.py train efficientnet_b0 --packed .devkeras2/cifar_train.npz --out "$OUT" --minutes "$1" ${2:+--batch $2} ${3:+--lr $3} 2>&1 | tail -n 25
# files above ~16 MB do not come back from the device: the .keras file travels in 8 MB parts (cat them to rejoin)
split -b 8M "$OUT/efficientnet_b0_64.keras" "$OUT/efficientnet_b0_64.keras.part-" && rm "$OUT/efficientnet_b0_64.keras"
ls -la "$OUT"
