#!/usr/bin/env bash
# One device call of issue #9's GPU measurements (see bench/qat_gpu.py and bench/stage_gpu_data.sh).
# Usage on the device: bash bench/qat_gpu_call.sh TAG [EXPERIMENT...] [-- qat_gpu.py options]
#   merges .devdata/TAG (if carried) into /tmp/dd, installs .devsite.tar.xz once into /tmp/site, runs the experiments,
#   writes $OUT/qat_gpu_TAG.json and $OUT/TAG.log.
set -u
tag=$1; shift
OUT=${OUT:-/tmp/qat-gpu-out}; mkdir -p "$OUT"
if [ ! -d /tmp/site/modelopt ]; then
  [ -f .devsite.tar.xz ] || { echo "no /tmp/site and no .devsite.tar.xz carried: this is a fresh machine, start again from call c1"; exit 3; }
  python3 -c "import tarfile; tarfile.open('.devsite.tar.xz').extractall('/tmp')" && mkdir -p /tmp/site && cp -r /tmp/.devsite/. /tmp/site/
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QDEPLOY_CACHE=/tmp/qdeploy-cache COLUMNS=160
mkdir -p /tmp/dd
[ -d ".devdata/$tag" ] && cp -r ".devdata/$tag/." /tmp/dd/
echo "staged in /tmp/dd: $(ls /tmp/dd | tr '\n' ' ')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 bench/qat_gpu.py --data /tmp/dd --json "$OUT/qat_gpu_$tag.json" "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/$tag.log" | grep -E "^===|qdeploy qat:|r50-train:|Error|error" | tail -60
