#!/usr/bin/env bash
# Stage bench/train/keras_train.py's device run into .devkeras/ (git-ignored; the device call carries it):
#  - .devkeras/cifar_train.npz: ../shared/data/cifar10/train's 20,000 PNG files as stored (bytes concatenated, offsets,
#    labels = index of the class folder in alphabetical order), one file because a call counts many small files badly;
#    decoded (and resized for EfficientNet) with PIL on the device;
#  - .devkeras/wheels: Keras 3.15.1 and the packages it needs that the device image lacks (Python 3.12, x86-64).
# Never commit them; nothing here is copied into a tracked path.   bash bench/device/keras_stage.sh
set -eu
cd "$(dirname "$0")/../.."
git check-ignore -q .devkeras/ || { echo ".devkeras/ is not git-ignored: add /.devkeras/ to .gitignore"; exit 1; }
mkdir -p .devkeras/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .devkeras/wheels \
  keras==3.15.1 absl-py namex optree h5py ml-dtypes rich markdown-it-py mdurl pygments packaging
python3 - <<'PY'
import os
import numpy as np
root = "../shared/data/cifar10/train"
blobs, offsets, labels = [], [0], []
for i, c in enumerate(sorted(d for d in os.listdir(root) if os.path.isdir(f"{root}/{d}"))):
    for f in sorted(os.listdir(f"{root}/{c}")):
        with open(f"{root}/{c}/{f}", "rb") as fh:
            b = fh.read()
        blobs.append(b); offsets.append(offsets[-1] + len(b)); labels.append(i)
np.savez(".devkeras/cifar_train.npz", data=np.frombuffer(b"".join(blobs), np.uint8), offsets=np.array(offsets),
         labels=np.array(labels, np.int16))
print(f"packed {len(labels)} images, {offsets[-1] / 1e6:.1f} MB, labels {np.bincount(labels).tolist()}")
PY
du -sh .devkeras .devkeras/wheels
