#!/usr/bin/env bash
# One device call for the next kernel iteration (carry [".whl", ".anchors"]): `info` on the GPU,
# GPU tests of the default plan, the per-kernel time split, and the tile sweep (each variant checked against the
# float64 oracle before it is timed). Logs go to $OUT; the summary prints last.
set -uo pipefail
OUT=${OUT:-/tmp/next_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 FLASHQLA_TUNE_CACHE=/tmp/fqt-cache
if [ -f .anchors/anchors.tar.xz ]; then
  mkdir -p /tmp/anchors && tar -C /tmp/anchors -xJf .anchors/anchors.tar.xz && export PYTHONPATH=/tmp/anchors:$PYTHONPATH
fi
export FLA_DISABLE_BACKEND_DISPATCH=1
python3 -c "from flashqla_tune.cli import main; main(['info'])" 2>&1 | tee "$OUT/info.txt"
python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -n 3 "$OUT/gpu_tests.log"
python3 scripts/kernel_profile.py "$OUT" 2>&1 | tee "$OUT/kernel_profile.log"
python3 scripts/tile_sweep.py "$OUT" 2>&1 | tee "$OUT/tile_sweep.log"
