#!/usr/bin/env bash
# Unpack a staged row of the real-size suite into .realsize-weights/NAME/ of the device machine (git-ignored, kept
# between calls while the machine stays warm), for bench/device/realsize_cpu.sh in the next call:
#   lite0  .devreal/lite0/lite0.tgz (bench/device/stage_realsize_lite0.sh): EfficientNet-Lite0, ImageNet images
#   seg    .devreal/seg/seg.tgz     (bench/device/stage_realsize_seg.sh): CamVid DeepLabV3, CamVid frames
#
#   run(command="bash bench/device/realsize_unpack.sh lite0", carry=[".devreal/lite0"])
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:?"which staged row: lite0 or seg"}
case $name in lite0|seg) ;; *) echo "unknown staged row '$name' (lite0 or seg)"; exit 2;; esac
[ -f ".devreal/$name/$name.tgz" ] || { echo "carry .devreal/$name (bash bench/device/stage_realsize_$name.sh here)"; exit 3; }
mkdir -p .realsize-weights && rm -rf ".realsize-weights/$name"
tar -C .realsize-weights -xzf ".devreal/$name/$name.tgz"
ls ".realsize-weights/$name" && find ".realsize-weights/$name" -type f | wc -l
