#!/usr/bin/env bash
# Issue #9: DDP scaling of `qdeploy qat` on the 2-GPU machine (nvidia-h200-x2), EfficientNet-B0 48x48, supervised,
# batch 128 per GPU, over the 10,000 cifar10/train images staged by bench/device/stage_gpu_data.sh (.devdata/x2).
# Usage on the device: bash bench/device/qat_scaling.sh   -> $OUT/qat_scaling.json
set -u
OUT=${OUT:-/tmp/qat-gpu-out}; mkdir -p "$OUT"
bash bench/device/qat_gpu_call.sh x2 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QDEPLOY_CACHE=/tmp/qdeploy-cache
# KINDS.md: NVLink multicast off on the multi-GPU kinds
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 bench/suites/qat_gpu.py --data /tmp/dd --emit-config effb0-sup --set epochs=3 > /tmp/scaling.yaml
python3 -m qdeploy --quiet qat /tmp/scaling.yaml --out /tmp/scale1 2>&1 | grep -v -i warn | tail -3
torchrun --nproc_per_node=2 -m qdeploy --quiet qat /tmp/scaling.yaml --out /tmp/scale2 2>&1 | grep -v -i warn | tail -3
python3 - "$OUT/qat_scaling.json" <<'PY'
import json, sys
runs = {n: json.load(open(f"/tmp/scale{n}/qat.json")) for n in (1, 2)}
# the first epoch includes cuDNN autotuning and allocator warm-up: compare the later epochs
ips = {n: [e["images_per_s"] for e in r["log"]] for n, r in runs.items()}
steady = {n: sum(v[1:]) / len(v[1:]) for n, v in ips.items()}
out = {"per_epoch_images_per_s": ips, "steady_images_per_s": steady, "speedup": round(steady[2] / steady[1], 3),
       "after": {n: r["after"] for n, r in runs.items()}, "processes": {n: r["processes"] for n, r in runs.items()},
       "batch_size_per_gpu": runs[1]["qat"]["batch_size"], "train_images": runs[1]["train_images"]}
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out))
PY
