#!/usr/bin/env bash
# Kernel check on the H200 (device tool `run`, carry [".whl-bench", ".anchors"]; repository root):
# builds the plans the GPU tests and the scoreboard use, runs the forward module's gpu-marked tests
# against the float64 oracle (FLA's error on the same inputs sets the bar when the anchors are
# carried), then the scoreboard with the arguments given (e.g. --quick --impl flashqla_tune --impl
# fla). Writes env.txt, build.log, gpu_tests.log (published: docs/results/gpu-tests-forward.log),
# scoreboard_run.log and the scoreboard's files to $OUT; the summary prints last.
set -uo pipefail
OUT=${OUT:-/tmp/kernel_check_out}
mkdir -p "$OUT"
source tools/device_setup.sh
device_setup "$( [ -d .whl-bench ] && echo .whl-bench || echo .whl )" || exit 1
export FLA_DISABLE_BACKEND_DISPATCH=1
device_report "$OUT"
# Build every plan the tests and the quick bench touch, in parallel, before anything runs.
python3 - <<'PY' 2>&1 | tee "$OUT/build.log"
import time
from flashqla_tune import cache
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec
specs = [GDNSpec(h, v) for h, v in [(2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (8, 24), (16, 48), (16, 16), (4, 4)]]
specs += [GDNSpec(2, 8, qkv_dtype="float16"), GDNSpec(2, 8, state_layout="vk")]
t = time.time()
entries = cache.get_kernels([default_plan(s) for s in specs])
print(f"built {len(entries)} plans in {time.time() - t:.1f} s")
for e in entries:
    print(e.plan.name, {k: (r.get("registers"), r.get("spill_stores")) for k, r in e.resources.items() if r.get("entry")})
PY
python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 60
bash benchmarks/h200_scoreboard.sh "$@" > "$OUT/scoreboard_run.log" 2>&1
tail -n 45 "$OUT/scoreboard_run.log"
