#!/usr/bin/env bash
# Unpack bench/device/stage_realsize_lite0.sh's .devreal/lite0/lite0.tgz into .realsize-weights/lite0/ of the device
# machine (git-ignored, kept between calls while the machine stays warm), for bench/device/realsize_cpu.sh's
# efficientnet_lite0 row in the next call:
#
#   run(command="bash bench/device/realsize_lite0_unpack.sh", carry=[".devreal/lite0"])
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f .devreal/lite0/lite0.tgz ] || { echo "carry .devreal/lite0 (bash bench/device/stage_realsize_lite0.sh here)"; exit 3; }
mkdir -p .realsize-weights && rm -rf .realsize-weights/lite0
tar -C .realsize-weights -xzf .devreal/lite0/lite0.tgz
ls .realsize-weights/lite0 && find .realsize-weights/lite0/imagenet -name '*.jpg' | wc -l
