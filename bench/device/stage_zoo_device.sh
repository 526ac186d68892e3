#!/usr/bin/env bash
# Stage what bench/ci/zoo.py's PyTorch workers need on the device machine and its image lacks, into .devzoo/site.tar.xz
# (git-ignored; carried with `carry: [".devzoo"]`, unpacked by bench/device/zoo_device.sh into /tmp/zsite). Never commit it.
#
#   bash bench/device/stage_zoo_device.sh                # wheels for the device's Python (3.12) into .whl-zoo/, then pack
#   PY=3.11 WHL=/tmp/whl311 OUT=/tmp/zsite311.tar.xz bash bench/device/stage_zoo_device.sh   # the same for this machine (a test)
#   FOR=gpu OUT=.devgpu/site.tar.xz bash bench/device/stage_zoo_device.sh   # the torch-cuda suites' share only (~6 MiB):
#       no OpenVINO, NNCF or transformers, so that it travels beside .devreal/train (33 MB) in one call; the scripts
#       read it with ZOO_SITE=.devgpu/site.tar.xz
#
# The device image already has torch, torchvision, timm, onnx, onnxruntime, onnxscript, numpy, scipy, pyyaml, rich,
# psutil, matplotlib, scikit-learn, requests, huggingface-hub, safetensors, tokenizers, typer, tqdm, ninja,
# nvidia-ml-py, setuptools (KINDS.md's package list). Carried here, at the versions of this checkout's .venv:
#   pydantic + pydantic_core, annotated-types, typing-inspection, typing_extensions (qdeploy's config)
#   nvidia-modelopt (no extras) + omegaconf, pulp (what its import needs and the image lacks; pulp's solver binaries
#     dropped: only its import is needed)
#   openvino + openvino-telemetry, trimmed by bench/device/site_trim.sh to what engine openvino loads: the CPU plugin,
#     the ONNX, IR and PyTorch frontends, convert_model (openvino/tools/ovc), TBB/hwloc, the Python bindings
#   nncf (placement openvino: nncf.quantize on the ov.Model, the zoo's openvino_ir_* checks and
#     bench/suites/openvino_ir_xeon.py) + tabulate (`import nncf` needs it; the image's list has it, carried in case).
#     nncf's other requirements are in the image (networkx, ninja, scipy, scikit-learn, rich, psutil, safetensors,
#     packaging) or unused by nncf.quantize (pydot: only its dot-file dumps)
#   transformers (the hf/* models; the image's 5.17 is older than .venv's) + regex (transformers' floor >= 2025.10.22);
#     a package .venv does not hold is left out (the device then runs the image's)
#   pycocotools (a qdeploy requirement: detection's mAP; the real-size suite's detector row)
#   torchao (optimize.torchao on torch-cuda: the real-size GPU suite's FP8/INT8 rows; an abi3 wheel; 0.18 ran with the
#     image's torch 2.11 before, docs/gpu.md "torchao")
# Not carried: onnx2torch (QAT of ONNX/Keras sources only), tensorrt/polygraphy (no TensorRT in the sweep).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-3.12}
WHL=${WHL:-.whl-${FOR:-zoo}}  # its own folder: every wheel in it is packed
OUT=${OUT:-.devzoo/site.tar.xz}
V=$PWD/.venv/bin/python
ver() { $V -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
mkdir -p "$WHL" "$(dirname "$OUT")"
pkgs=()
PACKAGES="pydantic pydantic_core annotated-types typing-inspection typing_extensions nvidia-modelopt omegaconf pulp
          pycocotools torchao"
# the CPU engines' and the Hugging Face rows' packages: not read by optimize --target torch-cuda or the GPU suites
[ "${FOR:-all}" = gpu ] || PACKAGES="$PACKAGES openvino openvino-telemetry nncf tabulate transformers regex"
for d in $PACKAGES; do
  # a package this .venv lacks is not carried: the device runs the image's (transformers 5.17 there)
  v=$(ver "$d" 2>/dev/null) || { echo "not in .venv, not carried: $d (the image's is used)" >&2; continue; }
  pkgs+=("$d==$v")
done
$V -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHL" "${pkgs[@]}" 2>&1 | grep -v '^WARNING: Location' || true
tag=cp${PY/./}
list=$(mktemp)
for w in "$WHL"/*.whl; do  # only this Python's binary wheels
  case "$w" in *-cp3*-cp3*) [[ "$w" == *"-$tag-$tag-"* ]] || { echo "skip $w (not $tag)" >&2; continue; } ;; esac
  echo "$w"
done > "$list"
T=$(mktemp -d); S=$T/zsite
mkdir -p "$S"
while read -r w; do $V -m zipfile -e "$w" "$S"; done < "$list"
rm -rf $S/pulp/solverdir/cbc $S/pulp/tests
. bench/device/site_trim.sh; trim_site "$S"  # OpenVINO trimmed to its CPU plugin + ONNX/IR frontends; no __pycache__, .pyi
chmod -R u+rwX,go+rX "$S"
tar -C "$T" -cf - zsite | xz -9 -T2 > "$OUT"
echo "packed $(wc -l < "$list") wheels: $(du -sm "$S" | cut -f1) MiB unpacked -> $OUT $(du -m --apparent-size "$OUT" | cut -f1) MiB"
rm -rf "$T" "$list"
