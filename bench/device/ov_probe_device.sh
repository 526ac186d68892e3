#!/usr/bin/env bash
# bench/diagnose/ov_probe.py on the device machine's Xeon (AMX): build the zoo models whose OpenVINO INT8 check failed there
# (zoo.py --worker, kept work folders), then probe every INT8 file they made under each setting.
#   run(command="bash bench/device/ov_probe_device.sh", carry=[".devzoo"])
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ovp-out}; mkdir -p "$OUT"
rm -rf /tmp/zsite && tar -C /tmp -xJf .devzoo/site.tar.xz || exit 3
export PYTHONPATH=/tmp/zsite:$PWD/src PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-600
MODELS=${MODELS:-"timm/levit_128s timm/mobileone_s0 timm/nf_regnet_b0 timm/fastvit_t8 timm/efficientformer_l1 timm/convit_tiny timm/botnet26t_256 timm/mobilenetv4_conv_small timm/swin_tiny_patch4_window7_224 torchvision/swin_t hf/levit hf/efficientnet"}
i=0
for m in $MODELS; do
  d=/tmp/ovw/$(echo $m | tr / _); mkdir -p $d
  ( OMP_NUM_THREADS=2 timeout 300 python3 bench/ci/zoo.py --worker $m --workdir $d --threads 2 > $d.log 2>&1;
    echo "$m worker rc $? ov: $(python3 -c "import json;print(json.load(open('$d/row.json'))['checks'].get('openvino_qdq_int8_runs'))" 2>&1 | cut -c1-200)" ) &
  i=$((i+1)); if [ $((i % 7)) -eq 0 ]; then wait; fi
done
wait
ls /tmp/ovw/*/cache/artifacts/*.onnx | xargs -P 8 -n 1 python3 bench/diagnose/ov_probe.py > $OUT/ov_probe.jsonl 2>$OUT/ov_probe.err
cat $OUT/ov_probe.jsonl | cut -c1-700
tail -5 $OUT/ov_probe.err
