#!/usr/bin/env bash
# bench/ci/zoo.py's PyTorch sweep (torchvision + timm + Hugging Face) on the device machine's CPUs (16 cores; the GPU is
# hidden: the same CPU path as on a laptop). Needs .devzoo/site.tar.xz (bash bench/device/stage_zoo_device.sh), carried:
#
#   run(command="bash bench/device/zoo_device.sh 1/3", carry=[".devzoo"], timeout_s=600)    # then 2/3, 3/3
#   run(command="CHECKS=openvino JOBS=16 THREADS=1 bash bench/device/zoo_device.sh 1/2", carry=[".devzoo"], timeout_s=600)
#                                                   # the OpenVINO IR checks only (zoo.py --checks openvino); then 2/2
#
# Argument: the --part K/N of the registry this call runs (default 1/1: all). Env: ONLY (space-separated labels: only
# these models instead of every PyTorch one), TAG (a name for the output files), CHECKS (zoo.py's --checks: all, or
# openvino: fp32, the ONNX Runtime placement and the OpenVINO IR INT8 only, files zoo_device_openvino_K_of_N.*), JOBS (8),
# THREADS (2), TIMEOUT (400 s a model), BUDGET (the call's timeout_s, default 600): no model starts after BUDGET-150 s of the sweep
# and any still running at BUDGET-45 s is stopped, both as rows 'not run: deadline', so the JSON and the logs always
# come back. Writes $OUT/zoo_device_K_of_N.json, $OUT/zoo_device_K_of_N.log (stdout) and $OUT/zoo_logs_K_of_N.tgz
# (one log per model; $OUT returns at most 8 files). Rerun the models left 'not run' with --only LABEL ...
set -uo pipefail
cd "$(dirname "$0")/../.."
PART=${1:-1/1}
JOBS=${JOBS:-8} THREADS=${THREADS:-2} TIMEOUT=${TIMEOUT:-400} BUDGET=${BUDGET:-600} CHECKS=${CHECKS:-all}
T0=$(date +%s)
OUT=${OUT:-/tmp/zoo-out}; mkdir -p "$OUT"
tag=${TAG:-$([ "$CHECKS" = all ] || echo "${CHECKS}_")$(echo "$PART" | tr / _ | sed 's/_/_of_/')}
. bench/device/stage.sh; unpack_zoo_site  # once per machine; again when the carried site differs
export PYTHONPATH=/tmp/zsite:$PWD/src PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       QDEPLOY_CACHE=/tmp/qdeploy-cache COLUMNS=160 NO_COLOR=1
lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-400
free -g | head -2
python3 -c 'import sys, torch, torchvision, timm, onnx, onnxruntime, openvino, transformers, pydantic, modelopt, nncf
print("python", sys.version.split()[0], sys.executable)
for m in (torch, torchvision, timm, onnx, onnxruntime, openvino, transformers, pydantic, modelopt, nncf): print(m.__name__, m.__version__, m.__file__)
print("openvino.convert_model", openvino.convert_model)
import modelopt.torch.quantization
print("openvino devices", openvino.Core().available_devices)' || exit 4
left=$(( BUDGET - ($(date +%s) - T0) ))
rm -rf /tmp/zoo_logs_$tag
if [ -n "${ONLY:-}" ]; then sel=(); for m in $ONLY; do sel+=(--only "$m"); done
else sel=(--all --source torchvision --source timm --source hf); fi
python3 bench/ci/zoo.py "${sel[@]}" --part "$PART" --checks "$CHECKS" --jobs "$JOBS" \
  --threads "$THREADS" --timeout-per-model "$TIMEOUT" --deadline $(( left - 150 )) --stop-at $(( left - 45 )) \
  --json "$OUT/zoo_device_$tag.json" --logs /tmp/zoo_logs_$tag 2>&1 | tee "$OUT/zoo_device_$tag.log"
rc=${PIPESTATUS[0]}
tar -C /tmp -czf "$OUT/zoo_logs_$tag.tgz" zoo_logs_$tag
echo "zoo.py exit $rc; $(( $(date +%s) - T0 )) s in this call"
exit $rc
