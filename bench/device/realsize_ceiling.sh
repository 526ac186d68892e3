#!/usr/bin/env bash
# bench/suites/realsize_ceiling_sweep.py on the device machine's Xeon (16 cores, GPU hidden): the plain ceiling harness
# over real-size models at 224, random initialisation unless .realsize-weights/ of this warm machine holds trained ones.
# Carry .devzoo (bench/device/stage_zoo_device.sh) and .devreal/eval (bench/device/stage_realsize.sh):
#
#   run(command="MODELS='resnet50 deit_small' ROWS='1:16 16:16' TAG=1 bash bench/device/realsize_ceiling.sh", carry=[".devzoo", ".devreal/eval"], timeout_s=400)
#
# Env: MODELS, ROWS (BATCH:THREADS ...), TAG, BUDGET (the call's seconds, default 380: the sweep is stopped at
# BUDGET-15 s; its JSON is rewritten after each row). Writes $OUT/realsize_ceiling_$TAG.json and .log.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
MODELS=${MODELS:-"resnet50 deit_small"} ROWS=${ROWS:-"1:16 16:16"} TAG=${TAG:-1} BUDGET=${BUDGET:-380}
OUT=${OUT:-/tmp/realsize-out}; mkdir -p "$OUT"
. bench/device/stage.sh; unpack_zoo_site
rm -rf /tmp/realeval && mkdir -p /tmp/realeval && for t in .devreal/eval/*.tgz; do tar -C /tmp/realeval -xzf "$t" || exit 3; done
export PYTHONPATH=/tmp/zsite PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= COLUMNS=160 NO_COLOR=1
lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-600
W=$([ -d .realsize-weights ] && echo "--weights .realsize-weights")
left=$(( BUDGET - ($(date +%s) - T0) ))
# shellcheck disable=SC2086  # MODELS, ROWS and W are word lists
timeout $(( left - 15 )) python3 bench/suites/realsize_ceiling_sweep.py --images /tmp/realeval/calib --models $MODELS \
  --rows $ROWS $W --json "$OUT/realsize_ceiling_$TAG.json" 2>&1 | grep -v '━\|Deprecat\|torch.onnx.export' \
  | tee "$OUT/realsize_ceiling_$TAG.log"
rc=${PIPESTATUS[0]}
echo "realsize_ceiling_sweep.py exit $rc; $(( $(date +%s) - T0 )) s in this call"
exit $rc
