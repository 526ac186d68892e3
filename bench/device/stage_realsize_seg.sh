#!/usr/bin/env bash
# Stage DeepLabV3's row of the real-size suite (CamVid, 360x480) for the device machine (git-ignored .devreal/seg/;
# ../shared's data never enters the repository): one .tgz with
#   seg/deeplabv3_fp16.pt        ../shared's CamVid DeepLabV3-MobileNetV3-Large state dict in FP16 (22 MB; loaded into
#                                the FP32 model, so the FP32 reference is these FP16 values)
#   seg/camvid/test, testannot   the 233 test frames and their label maps (scored: search + confirm)
#   seg/camvid/val, valannot     the 101 val frames (64 seeded ones calibrate)
# It travels alone (repository + ~37 MB), in a call that unpacks it into .realsize-weights/ of the warm machine
# (git-ignored, kept between calls), before the call that measures it with .devzoo:
#
#   bash bench/device/stage_realsize_seg.sh
#   run(command="bash bench/device/realsize_unpack.sh seg", carry=[".devreal/seg"])
#   run(command="MODELS=deeplabv3_camvid TAG=seg bash bench/device/realsize_cpu.sh", carry=[".devzoo", ".devreal/eval"])
set -euo pipefail
cd "$(dirname "$0")/../.."
S=${SHARED:-../shared}
PY=${PY:-.venv/bin/python}
W=$S/models/camvid-deeplabv3/deeplabv3_mobilenet_v3_large_camvid.pt
[ -f "$W" ] && [ -d "$S/data/camvid/test" ] || { echo "no $W or $S/data/camvid (../shared holds the real data)"; exit 3; }
T=$(mktemp -d)
mkdir -p "$T/seg/camvid"
"$PY" - "$W" "$T/seg/deeplabv3_fp16.pt" <<'PY'
import sys

import torch

state = torch.load(sys.argv[1], map_location="cpu")
state = state.get("model", state) if isinstance(state, dict) else state
torch.save({k: (v.half() if v.is_floating_point() else v) for k, v in state.items()}, sys.argv[2])
PY
for d in test testannot val valannot; do cp -r "$S/data/camvid/$d" "$T/seg/camvid/"; done
mkdir -p .devreal/seg
tar -C "$T" -czf .devreal/seg/seg.tgz seg
rm -rf "$T"
du -s --apparent-size --block-size=1K .devreal/seg/*
