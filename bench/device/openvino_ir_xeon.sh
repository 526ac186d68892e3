#!/usr/bin/env bash
# bench/suites/openvino_ir_xeon.py on the device machine's Xeon (16 cores; the GPU is hidden: CUDA_VISIBLE_DEVICES=).
# Stage here first: bash bench/device/stage_zoo_device.sh (.devzoo/site.tar.xz: openvino, nncf, pydantic, ...) and
# bash bench/device/stage_openvino_ir_xeon.sh (.devzoo/ov_images.tar: 80 ImageNet validation images). Two calls, two
# models each (one model: about 2-3 min at 224 on 16 cores, two quantizations included):
#
#   run(command="MODELS='resnet50 convnext_tiny' TAG=1 bash bench/device/openvino_ir_xeon.sh", carry=[".devzoo"], timeout_s=600)
#   run(command="MODELS='deit_small swin_tiny' TAG=2 bash bench/device/openvino_ir_xeon.sh", carry=[".devzoo"], timeout_s=600)
#   # here: python bench/suites/openvino_ir_xeon.py --merge P1.json P2.json --json docs/results/openvino/openvino_ir_xeon.json
#
# Env: MODELS (default all four), TAG (the output files' suffix), THREADS (16), BUDGET (540 s: the script is stopped at
# BUDGET-10 s of this call and starts no model after BUDGET-PER_MODEL s, PER_MODEL 200), ARGS (more arguments for the
# script, e.g. "--iters 30 --repeats 7" or "--plain-route pytorch"). Writes $OUT/openvino_ir_xeon_$TAG.json (rewritten
# after each model) and $OUT/openvino_ir_xeon_$TAG.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
MODELS=${MODELS:-"resnet50 convnext_tiny deit_small swin_tiny"} TAG=${TAG:-1} THREADS=${THREADS:-16}
BUDGET=${BUDGET:-540} PER_MODEL=${PER_MODEL:-200}
OUT=${OUT:-/tmp/ovx-out}; mkdir -p "$OUT"
. bench/device/stage.sh; unpack_zoo_site
[ -f .devzoo/ov_images.tar ] || { echo "no .devzoo/ov_images.tar: run bash bench/device/stage_openvino_ir_xeon.sh here"; exit 3; }
rm -rf /tmp/ovx-images && mkdir -p /tmp/ovx-images && tar -C /tmp/ovx-images -xf .devzoo/ov_images.tar || exit 3
export PYTHONPATH=/tmp/zsite:$PWD/src PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= QDEPLOY_CACHE=/tmp/qdeploy-cache \
       COLUMNS=160 NO_COLOR=1
lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-600
python3 -c 'import sys, torch, timm, openvino, nncf, onnx, onnxruntime
print("python", sys.version.split()[0]); print({m.__name__: m.__version__ for m in (torch, timm, openvino, nncf, onnx, onnxruntime)})
print("CPU", openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))' || exit 4
left=$(( BUDGET - ($(date +%s) - T0) ))
# shellcheck disable=SC2086  # MODELS and ARGS are word lists
timeout $(( left - 10 )) python3 bench/suites/openvino_ir_xeon.py --models $MODELS --images /tmp/ovx-images \
  --threads "$THREADS" --budget $(( left - PER_MODEL )) --work /tmp/ovx-work --json "$OUT/openvino_ir_xeon_$TAG.json" \
  ${ARGS:-} 2>&1 | grep -v '━' | tee "$OUT/openvino_ir_xeon_$TAG.log"
rc=${PIPESTATUS[0]}
echo "openvino_ir_xeon.py exit $rc; $(( $(date +%s) - T0 )) s in this call"
exit $rc
