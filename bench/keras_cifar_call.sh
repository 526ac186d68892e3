#!/usr/bin/env bash
# On the device: bench/keras_cifar.py trains both models at once (Keras 3, torch backend; two processes share the GPU,
# which Keras' per-step overhead leaves mostly idle), MINUTES of training each, into $OUT. Carry .devkeras2
# (bench/keras_cifar_stage.sh fills it).   bash bench/keras_cifar_call.sh 8
set -eu
mkdir -p /tmp/kerassite
for w in .devkeras2/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/kerassite; done
export PYTHONPATH=/tmp/kerassite KERAS_BACKEND=torch PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 bench/keras_cifar.py train resnet20 --packed .devkeras2/cifar_train.npz --out "$OUT" --minutes "$1" > "$OUT/resnet20.log" 2>&1 &
python3 bench/keras_cifar.py train efficientnet_b0 --packed .devkeras2/cifar_train.npz --out "$OUT" --minutes "$1" > "$OUT/efficientnet_b0.log" 2>&1 &
wait
for f in "$OUT"/*.log; do tail -n 3 "$f"; done
