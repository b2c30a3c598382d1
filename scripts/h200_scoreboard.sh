#!/usr/bin/env bash
# The scoreboard on the H200 (device tool `run`, carry [".whl", ".anchors"]). Installs the carried
# wheels (nvidia-cutlass: our kernels build there) and this checkout into /tmp/site unless the
# caller did already, unpacks the anchor bundle (FLA, FlashQLA) if present, writes
# scoreboard.md/.json and the log to $OUT, and prints the table last. Extra arguments go to
# `flashqla-tune bench`, e.g. --quick.
set -uo pipefail
OUT=${OUT:-/tmp/scoreboard_out}
mkdir -p "$OUT"
if [ -z "${PYTHONPATH:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . &&
    export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 FLASHQLA_TUNE_CACHE=${FLASHQLA_TUNE_CACHE:-/tmp/fqt-cache}
fi
if [ -f .anchors/anchors.tar.xz ]; then
  mkdir -p /tmp/anchors && tar -C /tmp/anchors -xJf .anchors/anchors.tar.xz
  export PYTHONPATH=/tmp/anchors:${PYTHONPATH:-$PWD}
else
  echo "no .anchors/anchors.tar.xz: FLA and FlashQLA will be skipped" >&2
  export PYTHONPATH=${PYTHONPATH:-$PWD}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
python3 -m flashqla_tune.cli.bench --out "$OUT" \
  "$@" >"$OUT/bench.log" 2>&1
rc=$?
# progress lines first (the whole log stays in $OUT), then the table last
grep -v '^|\|^#\|^- \|^$' "$OUT/bench.log" | tail -n 40
echo "---- rc=$rc ----"
[ -f "$OUT/scoreboard.md" ] && cat "$OUT/scoreboard.md"
exit $rc
