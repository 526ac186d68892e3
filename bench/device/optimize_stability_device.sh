#!/usr/bin/env bash
# Issue 35: does `optimize --target torch-cuda` give the same answer twice, and an artifact each time? Runs the held-out
# HF ViT (bench/train/train_heldout.py; its weights hf_vit.pt staged in .devopt/ or, with DEVGR, by stage_gpu_reference.sh)
# on 1,000 CIFAR-10 test images (.devopt/cifar-test, 100 per class, copied from ../shared; git-ignored) RUNS times with the same settings; writes $OUT/stability.json.
#   run(command="RUNS=2 LIMIT=180 bash bench/device/optimize_stability_device.sh", carry=[".devzoo", ".devopt"])
#   run(command="RUNS=3 DEVGR=.devgr bash bench/device/optimize_stability_device.sh", carry=[".devgr"])   (stage_gpu_reference.sh's
#   staging: pydantic's wheels and the whole test set, of which 100 a class are written to .devopt/cifar-test)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/stab-out}; mkdir -p "$OUT"
RUNS=${RUNS:-2} LIMIT=${LIMIT:-180} MODEL=${MODEL:-hf_vit}
if [ -n "${DEVGR:-}" ]; then  # staged by bench/device/stage_gpu_reference.sh instead: its wheels, 100 a class of its CIFAR-10 test set
  . bench/device/stage.sh; install_wheels /tmp/zsite "$DEVGR"/wheels/*.whl || exit 3
  python3 bench/device/unpack_image_npz.py "$DEVGR"/cifar-test.npz .devopt/cifar-test --per-class 100 || exit 3
else
  [ -f /tmp/zsite/.unpacked ] || { rm -rf /tmp/zsite && tar -C /tmp -xJf .devzoo/site.tar.xz && touch /tmp/zsite/.unpacked; } || exit 3
fi
export PYTHONPATH=/tmp/zsite:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 COLUMNS=160
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | grep 'Model name'
cat > bench/configs/_device_stability.yaml <<YAML
model:
  source: ../train/train_heldout.py:$MODEL
  weights: ../../${DEVGR:-.devopt}/$MODEL.pt
  task: classification
  preprocess: {input_size: [32, 32], mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225]}
data:
  eval: {format: imagefolder, root: ../../.devopt/cifar-test, batch_size: 250, workers: 0}
bench: {batch_sizes: [1, 32]}
optimize: {target: torch-cuda, budget: {max_drop: 0.3}, time_limit: $LIMIT}
YAML
for i in $(seq 1 $RUNS); do
  t0=$(date +%s)
  python3 -m qdeploy optimize bench/configs/_device_stability.yaml --out /tmp/stab$i 2>&1 | grep -v -i warn > $OUT/run$i.log
  echo "run $i exit ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s"; grep -E "chosen|tie|compiled:|precisions kept|could not be confirmed|next candidate" $OUT/run$i.log | cut -c1-300
  cp /tmp/stab$i/optimize.json $OUT/optimize_run$i.json 2>/dev/null
done
python3 - <<'PY'
import json, os, glob
out = os.environ.get("OUT", "/tmp/stab-out"); rows = []
for f in sorted(glob.glob(f"{out}/optimize_run*.json")):
    d = json.load(open(f)); c = d["chosen"]; p = d.get("program") or {}
    rows.append({"run": f, "chosen": c["variant"], "artifact": c["artifact"], "budget_met": d["budget_met"],
                 "confirm_metric": c["confirm_metric"], "reference_confirm_metric": c["reference_confirm_metric"],
                 "fresh_process_p50_ms": p.get("latency_p50_ms"), "program_error": p.get("error"),
                 "replaces": p.get("replaces"), "time_s": d["time_s"],
                 "ties": [x for x in d["decisions"] if x.startswith("a tie")]})
json.dump({"rows": rows}, open(f"{out}/stability.json", "w"), indent=1)
print(json.dumps(rows, indent=1))
PY
rm -f bench/configs/_device_stability.yaml
