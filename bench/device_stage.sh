# Sourced by bench/*_gpu_call.sh on the device: install the carried wheels (.devsite.tar.xz) once into /tmp/site, merge
# .devdata/$tag (if carried) into /tmp/dd, and set PYTHONPATH (plus /tmp/dd/site-packages when staged). One call carries
# at most 64 MiB, so data arrive over several calls back to back (bench/stage_gpu_data.sh).
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
