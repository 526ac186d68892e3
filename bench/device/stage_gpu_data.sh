#!/usr/bin/env bash
# Stage the data/weights for bench/suites/qat_gpu.py into .devdata/<call>/ (git-ignored), one folder per device call
# (c0 with .devsite.tar.xz: `bash bench/device/qat_gpu_call.sh c0` stages only; then c1 ... c4 as in docs/qat.md):
# a call carries at most 64 MiB, so the sets travel in turn and the device command merges each into /tmp/dd.
# Also packs the wheels of .whl/ (ModelOpt and its pure-Python needs; pulp's solver binaries left out: only its
# import is needed) into .devsite.tar.xz (3.4 MB instead of 21 MB). Never commit either.
set -eu
cd "$(dirname "$0")/../.."
S=../shared
rm -rf .devdata/c0 .devdata/c1 .devdata/c2 .devdata/c3 .devdata/c4 .devdata/x2
mkdir -p .devdata/c0/cifar-train .devdata/c1/cifar-train .devdata/c1/camvid .devdata/c2 .devdata/c3/camvid .devdata/c4 .devdata/x2/cifar-train
# cifar10/train in two halves (c0 travels with .devsite.tar.xz; the device counts its 20,000 small files over 64 MiB)
i=0; for c in $(ls $S/data/cifar10/train); do
  if [ $i -lt 5 ]; then cp -r $S/data/cifar10/train/$c .devdata/c0/cifar-train/; else cp -r $S/data/cifar10/train/$c .devdata/c1/cifar-train/; fi; i=$((i+1))
done
cp -r $S/data/camvid/testannot $S/data/camvid/trainannot .devdata/c1/camvid/
cp -r $S/data/cifar10/test .devdata/c2/cifar-test
cp $S/models/cifar10-dev/efficientnet_b0_48.pt $S/models/cifar10-dev/mobilenet_v3_large_64.pt .devdata/c2/
cp -r $S/data/camvid/test .devdata/c3/camvid/
cp -r $S/data/camvid/train .devdata/c3/camvid/
cp $S/models/camvid-deeplabv3/deeplabv3_mobilenet_v3_large_camvid.pt .devdata/c4/
# 2-GPU scaling (speed only): 1,000 training images per class and EfficientNet-B0
for c in $(ls $S/data/cifar10/train); do
  mkdir -p .devdata/x2/cifar-train/$c && ls $S/data/cifar10/train/$c | sort | head -1000 | sed "s|^|$S/data/cifar10/train/$c/|" | xargs cp -t .devdata/x2/cifar-train/$c/
done
cp $S/models/cifar10-dev/efficientnet_b0_48.pt .devdata/x2/
if [ -d .whl ]; then
  rm -rf /tmp/.devsite && mkdir -p /tmp/.devsite && for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/.devsite; done
  rm -rf /tmp/.devsite/pulp/solverdir/cbc && tar -C /tmp -cJf .devsite.tar.xz .devsite
fi
du -s --apparent-size --block-size=1M .devdata/c? .devdata/x2 .devsite.tar.xz  # MiB; a call carries <= 64 with the repo
