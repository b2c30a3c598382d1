#!/usr/bin/env bash
# The next session's kernel calls (carry [".whl", ".anchors"]), one step per device call:
#   bash scripts/h200_next_session.sh tests       GPU tests of the forward on the current kernel,
#                                                 the host-overhead split, the per-kernel profile
#   bash scripts/h200_next_session.sh scoreboard  the quick scoreboard: ours, FLA, FlashQLA (no
#                                                 PyTorch baseline, so it fits one call)
# Logs go to $OUT; each step prints its summary last.
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
case "${1:-tests}" in
  tests)
    python3 -c "from flashqla_tune.cli import main; main(['info'])" 2>&1 | tee "$OUT/info.txt"
    timeout 330 python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -n 3 "$OUT/gpu_tests.log"
    timeout 60 python3 scripts/host_overhead.py "$OUT" 2>&1 | tail -n 2
    timeout 150 python3 scripts/kernel_profile.py "$OUT" 2>&1 | grep heads ;;
  scoreboard)
    PYTHONPATH=$PYTHONPATH timeout 540 bash scripts/h200_scoreboard.sh --quick --impl flashqla_tune --impl fla \
      --impl flashqla > "$OUT/scoreboard_run.log" 2>&1
    tail -n 30 "$OUT/scoreboard_run.log" ;;
  *) echo "unknown step $1 (tests | scoreboard)" >&2; exit 2 ;;
esac
