# Sourced by the H200 scripts in benchmarks/ and tools/, from the repository root (the device
# image has torch, Triton, nvcc, ninja, jinja2 only).
#   device_setup WHEEL_DIR...  installs the carried wheels and this checkout into /tmp/site
#       (offline; --upgrade, so a machine still warm from an earlier call runs the edited code; a
#       regular install, so the run exercises the installed package data), unpacks whichever of
#       the carried archives is present (.anchors: FLA + FlashQLA; .fla: FLA alone) and sets the
#       environment: never the source tree from the cwd, one kernel cache per machine.
#   device_report OUT          writes date, GPU, driver, nvcc, torch and Triton to OUT/env.txt.
#   device_fi_stage            copies the FlashInfer bundle's carried parts (.whl-fi-a, .whl-fi-b:
#       tools/make_device_bundles.sh flashinfer) to /tmp/fi-stage, which outlives a call while the
#       machine stays warm, so the parts may come in separate calls; once the staged parts make
#       the bundle (their sha256 is the one built with them), unpacks its site tree into
#       /tmp/fi-site (the wheels installed there by pip --no-deps for this Python 3.12).
#   device_fi_env              adds /tmp/fi-site to the end of PYTHONPATH, after device_setup's
#       folders (the bundle's tvm-ffi is the anchors' version, so either copy serves FlashQLA and
#       FlashInfer alike), with the CuTe DSL's package folder, which the DSL's .pth file adds only
#       in a site folder; fails when the bundle is not installed.
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

FI_STAGE=/tmp/fi-stage
FI_SITE=/tmp/fi-site
device_fi_stage() {
  local dir want got parts
  mkdir -p "$FI_STAGE"
  for dir in .whl-fi-*; do
    [ -d "$dir" ] || continue
    cp "$dir"/fi-site.tar.xz.part* "$dir"/fi-site.sha256 "$dir"/fi-site.parts "$dir"/packages.txt "$FI_STAGE/" || return 1
  done
  [ -f "$FI_STAGE/fi-site.sha256" ] || { echo "no FlashInfer part carried (.whl-fi-a, .whl-fi-b) or staged" >&2; return 1; }
  parts=$(cd "$FI_STAGE" && ls fi-site.tar.xz.part* | wc -l)
  echo "FlashInfer bundle: $parts of $(cat "$FI_STAGE/fi-site.parts") parts staged in $FI_STAGE"
  if [ -f "$FI_SITE/.bundle.sha256" ] && cmp -s "$FI_SITE/.bundle.sha256" "$FI_STAGE/fi-site.sha256"; then
    echo "installed in $FI_SITE already"; return 0
  fi
  [ "$parts" -eq "$(cat "$FI_STAGE/fi-site.parts")" ] || { echo "waiting for the other part(s)"; return 0; }
  want=$(awk '{print $1}' "$FI_STAGE/fi-site.sha256")
  got=$(cat "$FI_STAGE"/fi-site.tar.xz.part* | sha256sum | awk '{print $1}')
  [ "$want" = "$got" ] || { echo "the staged parts do not make the bundle (sha256 $got, want $want): a part from another build?" >&2; return 1; }
  rm -rf "$FI_SITE" && mkdir -p "$FI_SITE" && cat "$FI_STAGE"/fi-site.tar.xz.part* | tar -C "$FI_SITE" -xJf - || return 1
  cp "$FI_STAGE/fi-site.sha256" "$FI_SITE/.bundle.sha256"
  echo "installed in $FI_SITE ($(du -sh "$FI_SITE" | cut -f1))"
}

device_fi_env() {
  [ -f "$FI_SITE/.bundle.sha256" ] || {
    echo "the FlashInfer bundle is not installed: run the flashinfer-stage step with each .whl-fi-* part first" \
         "(the machine must stay warm between the calls)" >&2
    return 1
  }
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$FI_SITE:$FI_SITE/nvidia_cutlass_dsl/dsl_packages
}
