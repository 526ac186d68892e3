#!/usr/bin/env bash
# Stage issue #24's GPU run (bench/suites/optimize_gpu.py keras-effb0: optimize with QAT of the Keras EfficientNet) into
# .devdata/k0 and k1 (git-ignored), one folder per device call (a call carries at most 64 MiB; the device command
# merges each into /tmp/dd on the warm machine, so the second call must come while it is warm). The image folders
# travel as one .tgz each (20,000 small files count for much more than their bytes; bench/device/stage.sh unpacks):
#   k0: cifar10/train (cifar-train.tgz, 46 MB; + .devsite.tar.xz, carried beside it)
#   k1: cifar10/test (cifar-test.tgz) + the converted ONNX (the call that runs)
# The ONNX is the Keras model exactly as qdeploy's Keras source converts and verifies it here (TensorFlow is not on the
# device): pass its path, e.g. runs/keras-goals3/efficientnet_b0/model.onnx.
#   bash bench/device/stage_keras_gpu.sh MODEL.onnx
# Wheels: .whl/ must hold what the device lacks (pydantic, pydantic_core, annotated-types, typing-inspection,
# nvidia-modelopt, pulp<4, omegaconf + antlr4-python3-runtime 4.9.3 (an sdist only: `pip wheel` it here), onnx2torch;
# ModelOpt imports omegaconf at import); packed into .devsite.tar.xz.
set -eu
cd "$(dirname "$0")/../.."
onnx=${1:?the converted ONNX of the Keras model}
S=../shared/data/cifar10
rm -rf .devdata/k0 .devdata/k1
mkdir -p .devdata/k0 .devdata/k1
tar -C "$S" -czf .devdata/k0/cifar-train.tgz --transform 's,^train,cifar-train,' train
tar -C "$S" -czf .devdata/k1/cifar-test.tgz --transform 's,^test,cifar-test,' test
cp "$onnx" .devdata/k1/keras_efficientnet_b0_64.onnx
rm -rf /tmp/.devsite && mkdir -p /tmp/.devsite && for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/.devsite; done
rm -rf /tmp/.devsite/pulp/solverdir/cbc && tar -C /tmp -cJf .devsite.tar.xz .devsite
du -s --apparent-size --block-size=1M .devdata/k0 .devdata/k1 .devsite.tar.xz
