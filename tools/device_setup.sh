# Sourced by the H200 scripts in benchmarks/ and tools/, from the repository root (the device
# image has torch, Triton, nvcc, ninja, jinja2 only).
#   device_setup WHEEL_DIR...  installs the carried wheels and this checkout into /tmp/site
#       (offline; --upgrade, so a machine still warm from an earlier call runs the edited code; a
#       regular install, so the run exercises the installed package data), unpacks whichever of
#       the carried archives is present (.anchors: FLA + FlashQLA; .fla: FLA alone) and sets the
#       environment: never the source tree from the cwd, one kernel cache per machine.
#   device_report OUT          writes date, GPU, driver, nvcc, torch and Triton to OUT/env.txt.
# tools/make_device_bundles.sh rebuilds the carried folders.
device_setup() {
  local dir wheels=() archive dest
  for dir in "$@"; do wheels+=("$dir"/*.whl); done
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "${wheels[@]}" || return 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . ||
    return 1
  export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 FLASHQLA_TUNE_CACHE=${FLASHQLA_TUNE_CACHE:-/tmp/fqt-cache}
  for archive in .anchors/anchors.tar.xz .fla/fla.tar.xz; do
    [ -f "$archive" ] || continue
    dest=/tmp/$(basename "$(dirname "$archive")" | tr -d .)
    mkdir -p "$dest" && tar -C "$dest" -xJf "$archive" || return 1
    export PYTHONPATH=$dest:$PYTHONPATH
  done
}

device_report() {
  { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -1
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    > "$1/env.txt" 2>&1
  cat "$1/env.txt"
}
