#!/usr/bin/env bash
# The scoreboard on the H200 (device tool `run`, carry [".whl-bench", ".anchors"]; repository root).
# Installs the carried wheels (nvidia-cutlass: our kernels build there) and this checkout into
# /tmp/site unless the caller did already, unpacks the anchor bundle (FLA, FlashQLA) if present,
# writes scoreboard.md/.json, bench.log and nvidia-smi.txt to $OUT, and prints the table last
# (published: docs/results/scoreboard.md). Extra arguments go to `flashqla-tune bench`, e.g. --quick.
set -uo pipefail
OUT=${OUT:-/tmp/scoreboard_out}
mkdir -p "$OUT"
if [ -z "${PYTHONPATH:-}" ]; then  # not set up by a calling script
  source tools/device_setup.sh
  device_setup "$( [ -d .whl-bench ] && echo .whl-bench || echo .whl )" || exit 1
fi
[ -f .anchors/anchors.tar.xz ] || echo "no .anchors/anchors.tar.xz: FLA and FlashQLA will be skipped" >&2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
python3 -m flashqla_tune.cli.bench --out "$OUT" \
  "$@" >"$OUT/bench.log" 2>&1
rc=$?
# progress lines first (the whole log stays in $OUT), then the table last
grep -v '^|\|^#\|^- \|^$' "$OUT/bench.log" | tail -n 40
echo "---- rc=$rc ----"
[ -f "$OUT/scoreboard.md" ] && cat "$OUT/scoreboard.md"
exit $rc
