# Sourced (`. bench/device/stage.sh`, from the repository root) by the device-machine scripts of bench/device/.
# The device reaches no package index, so what its image lacks travels as wheels in a carried folder (at most 64 MiB
# a call, the repo included: bench/device/stage_*.sh on this machine fill those folders).
#
#   install_wheels TARGET WHEEL...   pip-install the carried wheels into TARGET (no index, no dependency resolution:
#                                    the staging brought every wheel needed); the caller puts TARGET on PYTHONPATH
#   stage_devsite                    install .devsite.tar.xz (bench/device/stage_gpu_data.sh, stage_keras_gpu.sh) once
#                                    into /tmp/site, merge .devdata/$tag (if carried) into /tmp/dd, unpack its image
#                                    .tgz files, set PYTHONPATH; exits 3 on a fresh machine without the site
#   unpack_zoo_site                  unpack .devzoo/site.tar.xz (bench/device/stage_zoo_device.sh; env ZOO_SITE: another) into
#                                    /tmp/zsite, once per machine and again when the carried tar differs; exits 3 without it

install_wheels() {
  local target=$1; shift
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@"
}

stage_devsite() {
  if [ -f .devsite.tar.xz ]; then  # carried: (re)install it, also over an older /tmp/site of a warm machine
    rm -rf /tmp/.devsite && python3 -c "import tarfile; tarfile.open('.devsite.tar.xz').extractall('/tmp')" && mkdir -p /tmp/site && cp -r /tmp/.devsite/. /tmp/site/
  elif [ ! -d /tmp/site/modelopt ]; then
    echo "no /tmp/site and no .devsite.tar.xz carried: a fresh machine, stage again from the first call"; exit 3
  fi
  export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QDEPLOY_CACHE=/tmp/qdeploy-cache COLUMNS=160
  mkdir -p /tmp/dd
  [ -d ".devdata/$tag" ] && cp -r ".devdata/$tag/." /tmp/dd/
  for t in /tmp/dd/*.tgz; do [ -e "$t" ] && tar -C /tmp/dd -xzf "$t" && rm "$t"; done  # image folders packed in one file
  [ -d /tmp/dd/site-packages ] && export PYTHONPATH=$PYTHONPATH:/tmp/dd/site-packages
  echo "staged in /tmp/dd: $(ls /tmp/dd | tr '\n' ' ')"
}

unpack_zoo_site() {  # ZOO_SITE: another tar (a local test with stage_zoo_device.sh's PY=3.11 site)
  local tar=${ZOO_SITE:-.devzoo/site.tar.xz} stamp
  [ -f "$tar" ] || { echo "no $tar: run bash bench/device/stage_zoo_device.sh here and carry .devzoo"; exit 3; }
  stamp=$(cksum < "$tar" | cut -d' ' -f1)
  [ "$(cat /tmp/zsite/.unpacked 2>/dev/null)" = "$stamp" ] || \
    { rm -rf /tmp/zsite && tar -C /tmp -xJf "$tar" && echo "$stamp" > /tmp/zsite/.unpacked; } || exit 3
}

# GPU lanes: the bench scripts run one model per GPU at once where the machine has several (nvidia-h200-x2: two models'
# rows per call in the same device time). Each lane is pinned to its own share of the CPU cores, so that one lane's
# compiles (Inductor's workers take every core they see) do not delay the other lane's timing loop.
#   gpu_lanes                number of lanes: env GPUS, else the GPUs nvidia-smi lists (1 without nvidia-smi)
#   lane_models I N WORDS... the words of lane I of N (the Ith, I+Nth, ...)
#   in_lane I N CMD...       run CMD on GPU I with the Ith Nth of the cores (taskset where there is one)
gpu_lanes() {
  if [ -n "${GPUS:-}" ]; then echo "$GPUS"; return; fi
  local n; n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  echo $(( n > 0 ? n : 1 ))
}

lane_models() {
  local i=$1 n=$2 k=0 w out=""; shift 2
  for w in "$@"; do [ $(( k % n )) = "$i" ] && out="$out $w"; k=$((k + 1)); done
  echo $out
}

in_lane() {
  local i=$1 n=$2; shift 2
  if [ "$n" -le 1 ]; then "$@"; return; fi
  local cores per; cores=$(nproc); per=$(( cores / n ))
  if command -v taskset >/dev/null; then
    CUDA_VISIBLE_DEVICES=$i TORCHINDUCTOR_COMPILE_THREADS=$(( per > 2 ? per - 1 : 1 )) \
      taskset -c "$(( i * per ))-$(( (i + 1) * per - 1 ))" "$@"
  else
    CUDA_VISIBLE_DEVICES=$i TORCHINDUCTOR_COMPILE_THREADS=$(( per > 2 ? per - 1 : 1 )) "$@"
  fi
}
