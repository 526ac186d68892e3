#!/usr/bin/env bash
# Stage what bench/device/detection_gpu_call.sh carries, into .devdet/ (git-ignored): qdeploy's config and metric wheels the
# device image lacks (pydantic + its deps, pycocotools for Python 3.12) and BCCD (../shared/data/detection/bccd, 10 MB).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.devdet}
rm -rf "$DEST" && mkdir -p "$DEST"/wheels
for w in pydantic-2 pydantic_core annotated_types typing_inspection typing_extensions; do cp .whl-zoo/$w*.whl "$DEST"/wheels/; done
[ -f .whl-zoo/pycocotools-*cp312*.whl ] 2>/dev/null || .venv/bin/pip download -q pycocotools --python-version 3.12 \
  --only-binary=:all: --platform manylinux2014_x86_64 --no-deps -d .whl-zoo
cp .whl-zoo/pycocotools-*cp312*.whl "$DEST"/wheels/
tar -C ../shared/data/detection -czf "$DEST"/bccd.tgz bccd
du -sh "$DEST"; ls "$DEST" "$DEST"/wheels
