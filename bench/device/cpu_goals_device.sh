#!/usr/bin/env bash
# bench/suites/cpu_goals.py (issue #23/#36's CPU goals) on the device machine's 16-core Xeon; the GPU is hidden
# (CUDA_VISIBLE_DEVICES=), so this is the CPU path of a laptop or server. Stage first, here, the models of the call:
#
#   bash bench/device/stage_cpu_device.sh resnet20 resnet44            # .devcpu/: site.tar.xz, the data, these weights
#   run(command="bash bench/device/cpu_goals_device.sh resnet20 resnet44 --batch 1 32 --count 2000 --threads '1:1,4,16 32:16'", carry=[".devcpu"])
#
# Arguments: cpu_goals.py's (models, --batch, --count, --methods, --threads); --out and --json are set here. Only the
# models staged in .devcpu can run (the others print '## NAME: skipped: ... is absent'). bench/device/stage_cpu_device.sh's
# header proposes which models travel together; each call stages again (the site is kept).
# Steps: unpack .devcpu/site.tar.xz into /tmp/csite (once per machine: a warm one keeps it, unless the tar changed);
# unpack .devcpu's data tars and xz'd weights into /tmp/cshared, ../shared's layout (QDEPLOY_SHARED points there: the
# images travel packed, since a call counts thousands of small files for far more than their bytes); print the CPU
# (lscpu's model name and flags, nproc), check `import qdeploy, openvino, nncf` and `python3 -m qdeploy doctor`
# (OpenVINO's CPU capabilities: BF16, INT8, ...); then cpu_goals.py, stopped at BUDGET-45 s (BUDGET: the call's
# timeout_s, default 600) so that what it wrote comes back: rows are written to the JSON as each one ends.
# $OUT gets (at most 8 files come back): cpu_goals.json (every finished row), cpu_goals.log (its whole output),
# cpu_goals_runs.tgz (each optimize's optimize.json and reports, no models or caches).
# Env for a local test: DEVCPU (the staged folder, default .devcpu), SITE (default $DEVCPU/site.tar.xz), SITEDIR
# (/tmp/csite), SHARED (/tmp/cshared), OUT (/tmp/cg-out), RUNS (/tmp/cg: cpu_goals.py's --out), BUDGET (600).
# A local test (Python 3.11 site from stage_cpu_device.sh's PY=3.11 line; PATH's python3 one without .venv's packages):
#   DEVCPU=/tmp/devcpu311 SITE=/tmp/csite311.tar.xz OUT=/tmp/cgout PATH=ENV/bin:$PATH \
#     bash bench/device/cpu_goals_device.sh resnet20 --batch 1 --count 200 --methods mean-minmax
# On a warm machine /tmp/cg keeps the earlier calls' runs (and cache): cpu_goals_runs.tgz then holds theirs too.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
DEVCPU=${DEVCPU:-.devcpu}
SITE=${SITE:-$DEVCPU/site.tar.xz}
SITEDIR=${SITEDIR:-/tmp/csite}
SHARED=${SHARED:-/tmp/cshared}
RUNS=${RUNS:-/tmp/cg}
BUDGET=${BUDGET:-600}
OUT=${OUT:-/tmp/cg-out}; mkdir -p "$OUT"
# no site carried (NO_SITE=1 staging): a warm machine keeps the one an earlier call unpacked
[ -f "$SITE" ] || [ -f "$SITEDIR/.unpacked" ] || {
  echo "no $SITE and none unpacked in $SITEDIR (a fresh machine): run bash bench/device/stage_cpu_device.sh MODEL... here"; exit 3; }
unxz_py() {  # xz and tar -J where the xz tool is missing: Python's lzma reads the same files
  python3 -c "
import lzma, shutil, sys, tarfile
if sys.argv[1] == 'tar':
    with tarfile.open(sys.argv[2], 'r:xz') as t:
        t.extractall(sys.argv[3], **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))
else:
    with lzma.open(sys.argv[2]) as f, open(sys.argv[3], 'wb') as g:
        shutil.copyfileobj(f, g)" "$@"
}
untar() { if command -v xz > /dev/null; then tar -C "$2" -xJf "$1"; else unxz_py tar "$1" "$2"; fi; }
unxz_to() { if command -v xz > /dev/null; then xz -dc "$1" > "$2"; else unxz_py file "$1" "$2"; fi; }

# the site: once per machine, again if the tar differs from the one unpacked
sum=$( [ -f "$SITE" ] && sha256sum "$SITE" | cut -c1-16 || cat "$SITEDIR/.unpacked")
if [ "$(cat "$SITEDIR/.unpacked" 2>/dev/null)" != "$sum" ]; then
  rm -rf "$SITEDIR" && d=$(mktemp -d) && untar "$SITE" "$d" && mv "$d/csite" "$SITEDIR" && rmdir "$d" &&
    echo "$sum" > "$SITEDIR/.unpacked" || { echo "could not unpack $SITE into $SITEDIR"; exit 3; }
  echo "site: $SITE unpacked into $SITEDIR ($(du -sm "$SITEDIR" | cut -f1) MiB)"
else
  echo "site: $SITEDIR already holds $SITE"
fi
# the data and weights of this call, in ../shared's layout
rm -rf "$SHARED" && mkdir -p "$SHARED" || exit 3
for t in "$DEVCPU"/cifar10.tar.xz "$DEVCPU"/camvid.tar.xz; do
  [ -f "$t" ] && { untar "$t" "$SHARED" || { echo "could not unpack $t"; exit 3; }; }
done
if [ -d "$DEVCPU/shared" ]; then
  while IFS= read -r -d '' f; do
    rel=${f#"$DEVCPU/shared/"}; mkdir -p "$SHARED/$(dirname "$rel")"
    case $f in *.xz) unxz_to "$f" "$SHARED/${rel%.xz}" ;; *) cp "$f" "$SHARED/$rel" ;; esac || { echo "could not unpack $f"; exit 3; }
  done < <(find "$DEVCPU/shared" -type f -print0)
fi
echo "shared ($SHARED): $(cd "$SHARED" && find . -type f | sed 's,^\./,,' | grep -v '^data/' | tr '\n' ' ')"
for d in cifar10/test cifar10/train camvid/test camvid/testannot camvid/train; do
  [ -d "$SHARED/data/$d" ] && echo "  data/$d: $(find "$SHARED/data/$d" -type f | wc -l) files"
done

export PYTHONPATH=$SITEDIR:$PWD/src PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= QDEPLOY_SHARED=$SHARED \
       QDEPLOY_CACHE=/tmp/qdeploy-cache HF_HUB_OFFLINE=1 COLUMNS=160 NO_COLOR=1
echo "GPU hidden: CUDA_VISIBLE_DEVICES='' (the CPU path only); QDEPLOY_SHARED=$QDEPLOY_SHARED"
lscpu | grep -E '^Model name|^Flags'
echo "nproc: $(nproc)"
python3 -c '
import sys, torch, onnxruntime, openvino, nncf, qdeploy, pydantic
print("python", sys.version.split()[0], sys.executable)
for m in (qdeploy, torch, onnxruntime, openvino, nncf, pydantic): print(" ", m.__name__, getattr(m, "__version__", "?"), m.__file__)
print("torch.cuda.is_available():", torch.cuda.is_available(), "| openvino devices:", openvino.Core().available_devices)
from qdeploy.quantize import nncf_quantizer
nncf_quantizer._advanced_parameters("max")  # NNCF as qdeploy imports it (telemetry off)
print("nncf quantizer: importable")' || { echo "import check failed"; exit 4; }
python3 -m qdeploy doctor 2>&1 || echo "qdeploy doctor failed (exit $?)"

left=$(( BUDGET - ($(date +%s) - T0) - 45 )); [ "$left" -ge 30 ] || left=30
echo "cpu_goals.py $* (stopped after $left s if still running; $(( $(date +%s) - T0 )) s of setup)"
timeout -k 10 "$left" python3 bench/suites/cpu_goals.py "$@" --out "$RUNS" --json "$OUT/cpu_goals.json" > "$OUT/cpu_goals.log" 2>&1
rc=$?
[ $rc = 124 ] && echo "cpu_goals.py stopped at the deadline: the rows finished before it are in cpu_goals.json"
grep -E '^(# |\| |## |median |INT8 or BF16)' "$OUT/cpu_goals.log"
[ $rc = 0 ] || { echo "--- cpu_goals.py exit $rc; the end of its log:"; tail -40 "$OUT/cpu_goals.log"; }
if [ -d "$RUNS" ]; then  # each optimize's own record, small files only
  (cd "$RUNS" && find . -path ./cache -prune -o -type f \( -name '*.json' -o -name '*.md' -o -name '*.html' \) \
     -size -4M -print0 | tar --null -czf "$OUT/cpu_goals_runs.tgz" -T -)
fi
echo "$(( $(date +%s) - T0 )) s in this call; \$OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
