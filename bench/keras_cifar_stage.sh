#!/usr/bin/env bash
# Stage bench/keras_cifar.py's device run into .devkeras2/ (git-ignored, carried): ../shared/data/cifar10/train's 20,000
# PNGs packed into one file (the device counts many small files badly), and Keras 3.15.1 with the wheels the device
# lacks (Python 3.12). Never commit them.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .devkeras2/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .devkeras2/wheels \
  keras==3.15.1 absl-py namex optree h5py ml-dtypes rich markdown-it-py mdurl pygments packaging
python3 - <<'PY'
import os
import numpy as np
root = "../shared/data/cifar10/train"
blobs, offsets, labels = [], [0], []
for i, c in enumerate(sorted(os.listdir(root))):
    for f in sorted(os.listdir(f"{root}/{c}")):
        b = open(f"{root}/{c}/{f}", "rb").read()
        blobs.append(b); offsets.append(offsets[-1] + len(b)); labels.append(i)
np.savez(".devkeras2/cifar_train.npz", data=np.frombuffer(b"".join(blobs), np.uint8), offsets=np.array(offsets),
         labels=np.array(labels))
PY
du -sh .devkeras2
