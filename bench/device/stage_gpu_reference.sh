#!/usr/bin/env bash
# Stage what bench/device/gpu_reference_call.sh carries to the device machine, into .devgr/ (git-ignored; never commit it):
#   .devgr/wheels/   pydantic (+ pydantic_core, annotated-types, typing-inspection, typing_extensions): qdeploy's config;
#                    the device image lacks it. With HF=1 also transformers + regex (.venv's version; the image's is older)
#   .devgr/cifar-test.npz   the CIFAR-10 test set (10,000 PNGs as bytes + offsets + labels + class names: 23 MB; a tar
#                    of the folders is 35 MB with its 512-byte blocks); gpu_reference_call.sh writes the folders back
#   .devgr/*.pt      the weights of the models named (../shared's, or .devheld/'s: bench/train/train_heldout.py's, re-trained by bench/device/heldout_call.sh)
#   bash bench/device/stage_gpu_reference.sh effnet convnext      # ../shared's weights for these
#   HF=1 bash bench/device/stage_gpu_reference.sh hf_vit
# DEST=.devgr2 stages into another folder (gpu_reference_call.sh reads it with DEVGR=.devgr2).
# A call carries 64 MiB with the repo: keep to ~25 MB of weights per call.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.devgr}
rm -rf "$DEST" && mkdir -p "$DEST"/wheels
for w in pydantic-2 pydantic_core annotated_types typing_inspection typing_extensions; do cp .whl-zoo/$w*.whl "$DEST"/wheels/; done
[ "${HF:-0}" = 1 ] && cp .whl-zoo/transformers-*.whl .whl-zoo/regex-*.whl "$DEST"/wheels/
DEST=$DEST .venv/bin/python - <<'PY'
import os, numpy as np
root = "../shared/data/cifar10/test"; classes = sorted(os.listdir(root)); blobs, labels, names = [], [], []
for i, c in enumerate(classes):
    for f in sorted(os.listdir(os.path.join(root, c))):
        blobs.append(open(os.path.join(root, c, f), "rb").read()); labels.append(i); names.append(f)
off = np.cumsum([0] + [len(b) for b in blobs])
np.savez(os.environ["DEST"] + "/cifar-test.npz", data=np.frombuffer(b"".join(blobs), np.uint8), off=off, y=np.array(labels),
         names=np.array(names), classes=np.array(classes))
PY
for m in "$@"; do
  case $m in
    effnet) cp ../shared/models/cifar10-dev/efficientnet_b0_48.pt "$DEST"/ ;;
    convnext) cp ../shared/models/cifar10-modern/convnext_atto_64.pt "$DEST"/ ;;
    deit) cp ../shared/models/cifar10-modern/deit_tiny_p4_32.pt "$DEST"/ ;;
    *) cp .devheld/$m.pt "$DEST"/ ;;
  esac
done
du -sh "$DEST"; ls "$DEST"
