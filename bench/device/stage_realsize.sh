#!/usr/bin/env bash
# Stage the real-size suite's data for the device machine (git-ignored .devreal/; never commit it: ../shared's data must
# never enter the repository). Three carried folders, since one call carries at most 64 MiB with the repository:
#   .devreal/train/cifar_train.tgz   PER_CLASS_TRAIN (1500 of 2000: the tar and the repository fit one call) CIFAR-10 training images a class: bench/train/train_realsize.py
#                                    trains the classifiers on the GPU from them (call bench/device/realsize_train.sh)
#   .devreal/eval/cifar_test.tgz     PER_CLASS_TEST (200) test images a class (train_realsize.py's top-1; the Xeon rows'
#                                    search + confirm splits) and cifar_calib.tgz: CALIB (32) further test images a class,
#                                    qdeploy's and the ceiling harness's calibration set
#   .devreal/det/bccd.tgz            BCCD (test + train splits) for the 640 px detector row, carried by realsize_cpu.sh only
# One .tgz per set: the device counts many small files for more than their bytes.
#
#   bash bench/device/stage_realsize.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
S=${SHARED:-../shared}/data/cifar10
PER_CLASS_TRAIN=${PER_CLASS_TRAIN:-1500} PER_CLASS_TEST=${PER_CLASS_TEST:-200} CALIB=${CALIB:-32}
[ -d "$S/train" ] || { echo "no $S/train (../shared holds the real data)"; exit 3; }
T=$(mktemp -d)
pick() {  # pick SPLIT DEST FIRST COUNT: images FIRST+1 .. FIRST+COUNT of each class (sorted), into $T/DEST/<class>/
  local split=$1 dest=$2 first=$3 count=$4 c
  for c in $(ls "$S/$split"); do
    mkdir -p "$T/$dest/$c"
    ls "$S/$split/$c" | sort | sed -n "$((first + 1)),$((first + count))p" | sed "s|^|$S/$split/$c/|" | xargs cp -t "$T/$dest/$c/"
  done
}
pick train train 0 "$PER_CLASS_TRAIN"
pick test test 0 "$PER_CLASS_TEST"
pick test calib "$PER_CLASS_TEST" "$CALIB"   # test images after the eval ones: never trained on, never scored
mkdir -p .devreal/train .devreal/eval
tar -C "$T" -czf .devreal/train/cifar_train.tgz train
tar -C "$T" -czf .devreal/eval/cifar_test.tgz test
tar -C "$T" -czf .devreal/eval/cifar_calib.tgz calib
# BCCD for the 640 px detector's row (yolo_bccd640), in .devreal/det/ (carried by the measuring call only: the training
# call's tree would pass 64 MiB): its test split (scored) and train split (32 seeded images calibrate), annotations and
# split lists; the val split's images stay behind
B=${SHARED:-../shared}/data/detection/bccd
if [ -d "$B/Annotations" ]; then
  mkdir -p "$T/bccd/JPEGImages"
  cp -r "$B/Annotations" "$B/ImageSets" "$T/bccd/"
  cat "$B/ImageSets/Main/test.txt" "$B/ImageSets/Main/train.txt" | sed "s|^\(.*\)$|$B/JPEGImages/\1.jpg|" | xargs cp -t "$T/bccd/JPEGImages/"
  mkdir -p .devreal/det && tar -C "$T" -czf .devreal/det/bccd.tgz bccd
fi
rm -rf "$T"
du -s --apparent-size --block-size=1K .devreal/train/* .devreal/eval/* .devreal/det/*   # KiB; a call carries <= 64 MiB with the repo
