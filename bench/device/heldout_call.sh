#!/bin/bash
# One device call: trains held-out models (bench/train/train_heldout.py) side by side on one GPU.
#   run(command="bash bench/device/heldout_call.sh 230 tv_swin hf_vit", carry=[".devdata"]); files come back from $OUT.
# issue 34: tv_swin hf_vit; issue 35: tv_vit tv_convnext_femto tv_effnet_b0
S=${1:-230}; shift; NAMES=${@:-tv_swin hf_vit}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep 'Model name'
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
python3 -c "import transformers; print('device transformers', transformers.__version__)" 2>&1 | tail -1
# use the same transformers as the CPU machine (5.24.0) when it imports on the device's deps, else the device's own
. bench/device/stage.sh; install_wheels /tmp/hf .devdata/wheels/*.whl 2>&1 | tail -2
if PYTHONPATH=/tmp/hf python3 -c "import transformers; transformers.ViTForImageClassification" 2>/dev/null; then export PYTHONPATH=/tmp/hf; fi
python3 -c "import transformers; print('using transformers', transformers.__version__, transformers.__file__)"
export PYTHONUNBUFFERED=1
pids=()
for n in $NAMES; do python3 bench/train/train_heldout.py $n $S .devdata/cifar_train_png.npz > $OUT/$n.log 2>&1 & pids+=($!); done
i=0; for n in $NAMES; do wait ${pids[$i]}; echo "$n rc $?"; i=$((i+1)); done
for n in $NAMES; do grep -v Warning $OUT/$n.log | tail -4; done
ls -la $OUT
