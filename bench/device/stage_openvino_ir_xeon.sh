#!/usr/bin/env bash
# Stage the images of bench/suites/openvino_ir_xeon.py for the device machine: .devzoo/ov_images.tar (git-ignored, carried
# with .devzoo beside its site.tar.xz from bench/device/stage_zoo_device.sh; never commit it: ../shared's data must never
# enter the repository). N images (default 80: 64 calibration + 16 eval) of the ImageNet validation subset, the first
# image of every k-th class folder (k = folders / N), so that calibration sees N classes rather than the first few;
# one tar, since a call counts many small files for more than their bytes.
#
#   bash bench/device/stage_openvino_ir_xeon.sh            # then bench/device/openvino_ir_xeon.sh's run(...) lines
#   N=12 DEST=/tmp/ovimgs.tar bash bench/device/stage_openvino_ir_xeon.sh   # a local test's few images
set -euo pipefail
cd "$(dirname "$0")/../.."
SRC=${SRC:-../shared/data/imagenet-val1300}
N=${N:-80}
DEST=${DEST:-.devzoo/ov_images.tar}
[ -d "$SRC" ] || { echo "no $SRC"; exit 3; }
T=$(mktemp -d)
mapfile -t dirs < <(find "$SRC" -mindepth 1 -maxdepth 1 -type d | sort)
step=$(( ${#dirs[@]} / N )); [ "$step" -ge 1 ] || step=1
n=0
for ((i = 0; i < ${#dirs[@]} && n < N; i += step)); do
  f=$(find "${dirs[$i]}" -maxdepth 1 -type f \( -iname '*.jpeg' -o -iname '*.jpg' -o -iname '*.png' \) | sort | head -1)
  [ -n "$f" ] || continue
  cp "$f" "$T/$(basename "${dirs[$i]}")_$(basename "$f")"
  n=$((n + 1))
done
mkdir -p "$(dirname "$DEST")"
tar -C "$T" -cf "$DEST" .
echo "packed $n images from $SRC into $DEST ($(du -k --apparent-size "$DEST" | cut -f1) KiB)"
rm -rf "$T"
