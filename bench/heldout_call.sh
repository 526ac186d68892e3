#!/bin/bash
# One device call (issue 34 held-out models): trains torchvision Swin and HF ViT side by side on one GPU.
# run(command="bash bench/heldout_call.sh 230", carry=[".devdata"]); files come back from $OUT.
S=${1:-230}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep 'Model name'
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
python3 -c "import transformers; print('device transformers', transformers.__version__)" 2>&1 | tail -1
# use the same transformers as the CPU machine (5.24.0) when it imports on the device's deps, else the device's own
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hf .devdata/wheels/*.whl 2>&1 | tail -2
if PYTHONPATH=/tmp/hf python3 -c "import transformers; transformers.ViTForImageClassification" 2>/dev/null; then export PYTHONPATH=/tmp/hf; fi
python3 -c "import transformers; print('using transformers', transformers.__version__, transformers.__file__)"
export PYTHONUNBUFFERED=1
python3 bench/train_heldout.py tv_swin $S .devdata/cifar_train_png.npz > $OUT/tv_swin.log 2>&1 &
p1=$!
python3 bench/train_heldout.py hf_vit $S .devdata/cifar_train_png.npz > $OUT/hf_vit.log 2>&1 &
p2=$!
wait $p1; echo "tv_swin rc $?"; wait $p2; echo "hf_vit rc $?"
grep -v Warning $OUT/tv_swin.log | tail -8; grep -v Warning $OUT/hf_vit.log | tail -8
ls -la $OUT
