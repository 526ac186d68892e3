#!/usr/bin/env bash
# Copy the few files the GPU runs need from ../shared into .devdata/ (git-ignored; carried to the device),
# and fetch wheels the device image lacks into .whl/. Never commit either folder.
set -eu
cd "$(dirname "$0")/../.."
S=../shared
rm -rf .devdata && mkdir -p .devdata/imagenet-small .devdata/camvid
for d in $(ls $S/data/imagenet-val1300 | grep ^n | head -40); do
  mkdir -p .devdata/imagenet-small/$d && cp "$(ls -d $S/data/imagenet-val1300/$d/* | head -1)" .devdata/imagenet-small/$d/
done
cp -r $S/data/camvid/test $S/data/camvid/testannot .devdata/camvid/
cp $S/models/camvid-deeplabv3/deeplabv3_mobilenet_v3_large_camvid.pt .devdata/
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.3 pydantic_core==2.50.4 annotated-types typing-inspection typing_extensions
du -sh .devdata .whl
