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
source scripts/device_setup.sh
device_setup .whl || exit 1
export FLA_DISABLE_BACKEND_DISPATCH=1
case "${1:-tests}" in
  tests)
    python3 -c "from flashqla_tune.cli import main; main(['info'])" 2>&1 | tee "$OUT/info.txt"
    timeout 330 python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -n 3 "$OUT/gpu_tests.log"
    timeout 60 python3 scripts/host_overhead.py "$OUT" 2>&1 | tail -n 2
    timeout 150 python3 scripts/kernel_profile.py "$OUT" 2>&1 | grep heads ;;
  scoreboard)
    timeout 540 bash scripts/h200_scoreboard.sh --quick --impl flashqla_tune --impl fla \
      --impl flashqla > "$OUT/scoreboard_run.log" 2>&1
    tail -n 30 "$OUT/scoreboard_run.log" ;;
  *) echo "unknown step $1 (tests | scoreboard)" >&2; exit 2 ;;
esac
