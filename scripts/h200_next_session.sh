#!/usr/bin/env bash
# The next session's kernel calls (carry [".whl-bench", ".anchors"]), one step per device call:
#   bash scripts/h200_next_session.sh tests       GPU tests of the forward on the current kernel
#                                                 and the per-kernel profile
#   bash scripts/h200_next_session.sh pair        on nvidia-h200-x2: the tests step on GPU 0 and the
#                                                 sweep step on GPU 1 at once (one call, half the device time)
#   bash scripts/h200_next_session.sh pair-prep   on nvidia-h200-x2: the tests step's GPU tests on GPU 0 and
#                                                 the variants step, then the host step (FLA and FlashQLA
#                                                 left out), on GPU 1 at once
#   bash scripts/h200_next_session.sh pair-cp-half  on nvidia-h200-x2: the CP, host-path and two-per-SM GPU
#                                                 tests, then the host step, on GPU 0; pair-score's second
#                                                 half on GPU 1
#   bash scripts/h200_next_session.sh host-then-half   the host step alone, then pair-score's first half
#   bash scripts/h200_next_session.sh tests-x1      on one H200: the forward GPU tests in tests-x2's four groups,
#                                                 all four at once (the tests step's three processes did not
#                                                 finish in its 420 s on a cold machine, nineteenth session)
#   bash scripts/h200_next_session.sh gpu-tests EXPR   the forward GPU tests matching the -k expression EXPR
#   bash scripts/h200_next_session.sh host-alone  the host step without FLA and FlashQLA, then the
#                                                 host queue probe (scripts/host_queue_probe.py)
#   bash scripts/h200_next_session.sh host-ab     (carry .carry too) the library call's host time, this
#                                                 tree against .carry/base-csrc, in one process
#                                                 (scripts/host_launch_ab.py), then host-alone
#   bash scripts/h200_next_session.sh kernel-split ARGS   scripts/kernel_split.py with ARGS (--heads,
#                                                 --seqlens, --impl), its rows printed as they finish
#   bash scripts/h200_next_session.sh half 1|2    on one H200: pair-score's first or second half alone
#                                                 (two calls make the whole scoreboard)
#   bash scripts/h200_next_session.sh pair-score  on nvidia-h200-x2: the cp-bench scoreboard of all six head
#                                                 configurations, three on each GPU (OUT/gpu0, OUT/gpu1), then
#                                                 the host step on GPU 0 once its half is done
#   bash scripts/h200_next_session.sh pair-final  on nvidia-h200-x2: the tests step's GPU tests on GPU 0 and
#                                                 the per-kernel split of the batch-filled rows on GPU 1
#   bash scripts/h200_next_session.sh host-tests-ablation  on nvidia-h200-x2: the host step alone, then the
#                                                 forward GPU tests on GPU 0 and the prep ablation and CP
#                                                 per-kernel split on GPU 1
#   bash scripts/h200_next_session.sh host-cp-half  on nvidia-h200-x2: the host step alone, then the CP,
#                                                 host-path, graph and two-per-SM tests and the CP split on
#                                                 GPU 0, the scoreboard's second half on GPU 1
#   bash scripts/h200_next_session.sh host-cp-variants  on nvidia-h200-x2: the host step alone, then the CP
#                                                 and host-path GPU tests and the CP split on GPU 0, the
#                                                 variants step on GPU 1
#   bash scripts/h200_next_session.sh chain-clocks   the exact chain's SM cycles per stage of a step
#                                                 (scripts/chain_clocks.py, a measurement build)
#   bash scripts/h200_next_session.sh tests-x2     on nvidia-h200-x2: the forward GPU tests in four groups,
#                                                 two per GPU
#   bash scripts/h200_next_session.sh first-x2     on nvidia-h200-x2: the forward GPU tests (two groups per GPU),
#                                                 then on GPU 0 the 1024x8 per-kernel split against FlashQLA,
#                                                 on GPU 1 the prep variants and the CP time per segment length
#                                                 of the 8192-token rows on 16/16 and 4/16
#   bash scripts/h200_next_session.sh cp-variants-x2   on nvidia-h200-x2: scripts/cp_variants.py (the
#                                                 CP launch's build variants; TABLES=1: the warm-up
#                                                 tables) on GPU 0, the whole forward GPU module on
#                                                 GPU 1 (WITH_CLOCKS=1: then the chain's stage clocks)
#   bash scripts/h200_next_session.sh variants-x2   on nvidia-h200-x2: scripts/cp_variants.py on GPU 0;
#                                                 on GPU 1 scripts/prep_variants.py, then the chain's
#                                                 stage clocks of the product and, with
#                                                 CHAIN_CLOCK_FLAGS set, of the build with those flags
#   bash scripts/h200_next_session.sh prep-switch-x2 NAME=VALUE ...   on nvidia-h200-x2: scripts/prep_variants.py
#                                                 on GPU 0; on GPU 1 the whole forward GPU module on a copy
#                                                 of the tree whose measurement switches NAME are set to
#                                                 VALUE (its "#define NAME" default rewritten), installed
#                                                 beside the product's
#   bash scripts/h200_next_session.sh pair-score-cp    on nvidia-h200-x2: both scoreboard halves, then the
#                                                 host step and the CP GPU tests
#   bash scripts/h200_next_session.sh half-oracle  on nvidia-h200-x2: the scoreboard's first half on GPU 0,
#                                                 the GPU tests host-cp-half leaves on GPU 1
#   bash scripts/h200_next_session.sh host        the host-overhead split of an eager call, FLA and FlashQLA beside it
#   bash scripts/h200_next_session.sh sweep       plan variants (scripts/tile_sweep.py), oracle-checked and timed
#   bash scripts/h200_next_session.sh fix-and-score EXPR   GPU tests matching EXPR, then the
#                                                 2/8 and 4/16 scoreboard rows that fit
#   bash scripts/h200_next_session.sh scoreboard [--heads H/V ...]   scoreboard rows that fit one
#                                                 call: ours, FLA, FlashQLA (no PyTorch baseline)
#   bash scripts/h200_next_session.sh ncu [H/V:SEQLENS ...]   Nsight Compute on the prep and sequential
#                                                 kernels (scripts/ncu_target.py; its default cases
#                                                 without arguments): stall reasons, memory, occupancy
#   bash scripts/h200_next_session.sh prep-ablation   the prep's time per stage by leaving stages out
#                                                 (scripts/prep_ablation.py; no counters needed)
#   bash scripts/h200_next_session.sh tune-smoke  a few tuner trials measured in the child process (carry .whl)
#   bash scripts/h200_next_session.sh cp [--heads H/V ... --seqlens MIX ...]   the context-parallel GPU
#                                                 tests and scripts/cp_profile.py
#   bash scripts/h200_next_session.sh eager-default   eager timings of the op's default beside FLA and
#                                                 FlashQLA on every row the default window splits
#   bash scripts/h200_next_session.sh cp-bench [--heads H/V ...]   ours without CP, with calibrated
#                                                 warm-up and with exact CP chaining beside FLA and
#                                                 FlashQLA (default 2/8)
#   bash scripts/h200_next_session.sh variants    the prep's build variants (scripts/prep_variants.py):
#                                                 each against the float64 oracle, then its prep time
#   bash scripts/h200_next_session.sh split       the CP GPU tests, then the GPU time per kernel of
#                                                 ours, FLA and FlashQLA on 16/16 and 2/8 rows
#                                                 (scripts/kernel_split.py)
# Logs go to $OUT; each step prints its summary last.
set -uo pipefail
OUT=${OUT:-/tmp/next_out}
mkdir -p "$OUT"
source scripts/device_setup.sh
# .whl-bench (no optuna storage wheels) keeps [wheels, .anchors] under the 64 MiB a call carries
device_setup "$( [ -d .whl-bench ] && echo .whl-bench || echo .whl )" || exit 1
export FLA_DISABLE_BACKEND_DISPATCH=1
# Ours, FLA and FlashQLA in one run (no PyTorch baseline): TIMEOUT_S BUDGET_S then --heads ...;
# --budget-s stops starting new cases in time for the table to be written; --prewarm compiles every
# head configuration's kernels (FLA, FlashQLA, ours) in parallel first, instead of on each first row.
same_run_scoreboard() {
  local timeout_s=$1 budget_s=$2
  shift 2
  timeout "$timeout_s" bash scripts/h200_scoreboard.sh --impl flashqla_tune --impl fla --impl flashqla \
    "$@" --accuracy-max-tokens 0 --sample-budget-s 0.05 --budget-s "$budget_s" --prewarm > "$OUT/scoreboard_run.log" 2>&1
  tail -n 40 "$OUT/scoreboard_run.log"
}
forward_gpu_tests() {
  # The module in three pytest processes on the one GPU (nothing here is timed, so they may
  # share it): most of its 361 s in one process was FLA's Triton JIT and autotuning for the
  # error bar of each new head configuration, which the groups now pay side by side. The
  # plans build once (the cache's file lock makes the other processes wait for them).
  local timeout_s=$1 oracle="test_forward_matches_float64_oracle" i
  local groups=("$oracle and (gva_varlen_bf16 or l2norm or strong or weak or zero or gqa2)"
                "$oracle and (gva_varlen_fp16 or no_gva or group3 or batch2 or state_v_first)"
                "not $oracle")
  for i in 0 1 2; do
    timeout "$timeout_s" python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider --durations=0 \
      -k "${groups[$i]}" > "$OUT/gpu_tests_$i.log" 2>&1 &
  done
  wait
  cat "$OUT"/gpu_tests_[012].log > "$OUT/gpu_tests.log"
  for i in 0 1 2; do grep -E "passed|failed|error" "$OUT/gpu_tests_$i.log" | tail -n 1; done
}
# One GPU's share of the cp-bench scoreboard in OUT/gpuN (the bench writes scoreboard.* there);
# --prewarm builds in parallel. score_half GPU --heads H/V ...
score_half() {
  local gpu=$1
  shift
  mkdir -p "$OUT/gpu$gpu"
  CUDA_VISIBLE_DEVICES=$gpu OUT="$OUT/gpu$gpu" timeout "${SCORE_TIMEOUT_S:-440}" bash scripts/h200_scoreboard.sh \
    --impl flashqla_tune --impl flashqla_tune_single_chain --impl flashqla_tune_warmup --impl flashqla_tune_exact_cp \
    --impl fla --impl flashqla "$@" --accuracy-max-tokens 0 --sample-budget-s 0.05 --budget-s "${SCORE_BUDGET_S:-370}" --prewarm \
    > "$OUT/gpu$gpu/scoreboard_run.log" 2>&1
}
# The scoreboard's two halves (one GPU each on an x2), and what a call keeps of a half: its
# calibrated column's summary line printed, its folder as one archive (the device returns at most
# 8 files a call). pack_score_half GPU
FIRST_HALF=(--heads 16/16 --heads 2/8 --heads 4/16)
SECOND_HALF=(--heads 8/24 --heads 16/32 --heads 8/32)
pack_score_half() {
  grep -A12 "^Summary, graph" "$OUT/gpu$1/scoreboard.md" | grep flashqla_tune_warmup
  tar -C "$OUT" -czf "$OUT/scoreboard-gpu$1.tar.gz" "gpu$1" && rm -rf "${OUT:?}/gpu$1"
}
# The GPU tests host-cp-half runs beside the scoreboard's second half; half-oracle runs the rest
# (and the CP ones again, since host-cp-half's time limit can cut them).
CP_HALF_TESTS="context_parallel or forced_short or cpp_host or graph or two_ctas or malformed or no_sequence or int32 or 16_byte"
# The whole forward module in four groups of similar length (first-x2, tests-x2): the oracle cases
# in two, the other tests in two. forward_group I GPU TIMEOUT_S runs group I on one GPU;
# collect_forward_groups joins their logs into gpu_tests.log and prints the counts and failures.
ORACLE="test_forward_matches_float64_oracle"
FORWARD_GROUPS=("$ORACLE and (gva_varlen_bf16 or l2norm or strong or weak or zero or gqa2)"
                "$ORACLE and not (gva_varlen_bf16 or l2norm or strong or weak or zero or gqa2)"
                "not $ORACLE and ($CP_HALF_TESTS)" "not $ORACLE and not ($CP_HALF_TESTS)")
forward_group() {
  CUDA_VISIBLE_DEVICES=$2 timeout "$3" python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py \
    -p no:cacheprovider --durations=0 -k "${FORWARD_GROUPS[$1]}" > "$OUT/gpu_tests_$1.log" 2>&1
}
# The host step without FLA and FlashQLA on GPU 0, timeout $1 seconds; its summary line printed.
host_alone() {
  CUDA_VISIBLE_DEVICES=0 timeout "$1" python3 scripts/host_overhead.py "$OUT" --no-anchors > "$OUT/host_overhead.log" 2>&1
  tail -n 1 "$OUT/host_overhead.log" | cut -c1-700
}
# The same, then scripts/host_queue_probe.py (calls one at a time after a synchronize); its lines printed.
host_alone_and_probe() {
  host_alone 120
  timeout 90 python3 scripts/host_queue_probe.py "$OUT" > "$OUT/host_queue_probe.log" 2>&1
  tail -n 4 "$OUT/host_queue_probe.log" | cut -c1-600
}
collect_forward_groups() {
  cat "$OUT"/gpu_tests_[0123].log > "$OUT/gpu_tests.log"; rm -f "$OUT"/gpu_tests_[0123].log
  grep -E "passed|failed|error" "$OUT/gpu_tests.log" | grep -v "^cp "
  grep -E "^FAILED" "$OUT/gpu_tests.log" | head -n 12 | cut -c1-300 || true  # no failure is not an error
}
case "${1:-tests}" in
  host-cp-half)
    # on nvidia-h200-x2, after a CP launch change: the host step alone (a quiet host); then at once,
    # on GPU 0 the CP, host-path, graph and two-per-SM GPU tests and the CP per-kernel split, on
    # GPU 1 the scoreboard's second half (pair-score)
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    host_alone 110
    (CUDA_VISIBLE_DEVICES=0 timeout 270 python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider \
       -k "$CP_HALF_TESTS" \
       --durations=0 > "$OUT/gpu_tests_cp.log" 2>&1
     CUDA_VISIBLE_DEVICES=0 timeout 140 python3 -P scripts/kernel_split.py "$OUT" --heads 16/16 --heads 4/16 \
       --seqlens 8192x4 --seqlens 1x8192 --impl flashqla_tune_warmup > "$OUT/kernel_split.log" 2>&1) &
    SCORE_TIMEOUT_S=430 SCORE_BUDGET_S=360 score_half 1 "${SECOND_HALF[@]}" &
    wait
    grep -E "passed|failed|error" "$OUT/gpu_tests_cp.log" | tail -n 2; grep -E "^FAILED|Error" "$OUT/gpu_tests_cp.log" | head -n 12 | cut -c1-300
    grep -E "us \|" "$OUT/kernel_split.log" | cut -c1-260
    pack_score_half 1
    grep -v "UserWarning\|_warn_once" "$OUT/kernel_split.log" > "$OUT/kernel_split.txt"; rm -f "$OUT/kernel_split.log" ;;
  host-cp-variants)
    # on nvidia-h200-x2, after a CP launch change with prep variants pending: the host step alone (a
    # quiet host); then at once, on GPU 0 the CP and host-path GPU tests and the CP per-kernel split,
    # on GPU 1 the prep variants
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    host_alone 110
    (CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider \
       -k "$CP_HALF_TESTS" --durations=0 > "$OUT/gpu_tests_cp.log" 2>&1
     CUDA_VISIBLE_DEVICES=0 timeout 140 python3 -P scripts/kernel_split.py "$OUT" --heads 16/16 --heads 4/16 \
       --seqlens 8192x4 --seqlens 1x8192 --impl flashqla_tune_warmup > "$OUT/kernel_split.log" 2>&1) &
    CUDA_VISIBLE_DEVICES=1 timeout 420 python3 -P scripts/prep_variants.py "$OUT" > "$OUT/prep_variants.log" 2>&1 &
    wait
    grep -E "passed|failed|error" "$OUT/gpu_tests_cp.log" | tail -n 2; grep -E "^FAILED|Error" "$OUT/gpu_tests_cp.log" | head -n 12 | cut -c1-300
    grep -E "us \|" "$OUT/kernel_split.log" | cut -c1-260
    grep -E "prep_ms|worst|Error" "$OUT/prep_variants.log" | tail -n 18 | cut -c1-400
    grep -v "UserWarning\|_warn_once" "$OUT/kernel_split.log" > "$OUT/kernel_split.txt"; rm -f "$OUT/kernel_split.log" ;;
  first-x2)
    # on nvidia-h200-x2, the fifteenth session's first call (docs/README.md's device plan): the
    # whole forward GPU module (tests-x2's four groups), then on GPU 0 where the 1024x8 rows lose
    # (per kernel, ours against FlashQLA), on GPU 1 the prep's thread count for four v-heads and
    # whether another segment length serves both 1x8192 and 8192x4 on 16/16 and 4/16
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    (forward_group 1 0 320 & forward_group 3 0 320 & wait
     CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -P scripts/kernel_split.py "$OUT" --heads 16/16 --heads 2/8 \
       --heads 16/32 --seqlens 1024x8 --impl flashqla_tune_warmup --impl flashqla > "$OUT/kernel_split.log" 2>&1) &
    (forward_group 0 1 240 & forward_group 2 1 240 & wait
     CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -P scripts/prep_variants.py "$OUT" > "$OUT/prep_variants.log" 2>&1
     CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -P scripts/cp_profile.py "$OUT" --heads 16/16 --heads 4/16 \
       --seqlens 1x8192 --seqlens 8192x4 > "$OUT/cp_profile.log" 2>&1) &
    wait
    collect_forward_groups
    grep -E "us \|" "$OUT/kernel_split.log" | cut -c1-260
    grep -E "prep_ms|worst|Error" "$OUT/prep_variants.log" | tail -n 8 | cut -c1-300
    tail -n 20 "$OUT/cp_profile.log" | cut -c1-300
    grep -v "UserWarning\|_warn_once" "$OUT/kernel_split.log" > "$OUT/kernel_split.txt"; rm -f "$OUT/kernel_split.log"
    true ;;  # the summaries' greps may find nothing
  cp-variants-x2)
    # on nvidia-h200-x2 (carry .whl-bench): on GPU 0 the CP launch variants (scripts/cp_variants.py;
    # with TABLES=1 also the warm-up tables' times); on GPU 1 at once the whole forward GPU module,
    # its four groups side by side (nothing there is timed); with WITH_CLOCKS=1, then the chain's
    # stage clocks
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 500 python3 -P scripts/cp_variants.py "$OUT" ${TABLES:+--tables} > "$OUT/cp_variants.log" 2>&1 &
    for i in 0 1 2 3; do forward_group "$i" 1 500 & done
    wait
    collect_forward_groups
    grep -E "graph_ms|tables_ms|\"state\"|worst|Error" "$OUT/cp_variants.log" | cut -c1-400
    if [ -n "${WITH_CLOCKS:-}" ]; then  # then the chain's stage clocks on the product (under a minute)
      CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -P scripts/chain_clocks.py > "$OUT/chain_clocks.log" 2>&1
      grep -E "^==|chain clocks" "$OUT/chain_clocks.log" | head -n 40 | cut -c1-200
    fi
    true ;;
  variants-x2)
    # on nvidia-h200-x2 (carry .whl-bench): both variant scripts at once, each variant against the
    # float64 oracle and bit for bit against the product; then on GPU 1 the chain's stage clocks of
    # the product and (CHAIN_CLOCK_FLAGS set) of the switched build
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -P scripts/cp_variants.py "$OUT" > "$OUT/cp_variants.log" 2>&1 &
    (CUDA_VISIBLE_DEVICES=1 timeout 330 python3 -P scripts/prep_variants.py "$OUT" > "$OUT/prep_variants.log" 2>&1
     CUDA_VISIBLE_DEVICES=1 timeout 80 python3 -P scripts/chain_clocks.py > "$OUT/chain_clocks.log" 2>&1
     if [ -n "${CHAIN_CLOCK_FLAGS:-}" ]; then
       CUDA_VISIBLE_DEVICES=1 timeout 80 python3 -P scripts/chain_clocks.py > "$OUT/chain_clocks_switched.log" 2>&1
     fi) &
    wait
    grep -E "graph_ms|worst|Error" "$OUT/cp_variants.log" | cut -c1-300
    grep -E "prep_ms|worst|Error" "$OUT/prep_variants.log" | cut -c1-300
    for f in chain_clocks chain_clocks_switched; do
      [ -f "$OUT/$f.log" ] || continue
      echo "== $f"; grep -E "chain clocks seq 0 head 0 step [12]:" "$OUT/$f.log" | cut -c1-160
    done ;;
  prep-switch-x2)
    # on nvidia-h200-x2 (carry .whl-bench): a prep switch's timing and checks beside the product on
    # GPU 0 and, at once, the forward module built with the switch on GPU 1 (so a winner needs no
    # second test call before it becomes the default)
    shift
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -P scripts/prep_variants.py "$OUT" > "$OUT/prep_variants.log" 2>&1 &
    switched=/tmp/tree-switched
    rm -rf "$switched" /tmp/site-switched && mkdir -p "$switched" && cp -r . "$switched/"
    for define in "$@"; do
      sed -i -E "s/^#define ${define%%=*} [0-9]+$/#define ${define%%=*} ${define#*=}/" "$switched"/csrc/*.cuh
      grep -h "^#define ${define%%=*} " "$switched"/csrc/*.cuh
    done
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site-switched "$switched"
    for i in 0 1 2 3; do
      (PYTHONPATH=/tmp/site-switched:$PYTHONPATH FLASHQLA_TUNE_CACHE=/tmp/fqt-cache-switched forward_group "$i" 1 400) &
    done
    wait
    collect_forward_groups
    grep -E "prep_ms|worst|Error" "$OUT/prep_variants.log" | cut -c1-300 ;;
  chain-clocks)
    # the exact chain's stage cycles per step (scripts/chain_clocks.py; a measurement build)
    timeout 300 python3 -P scripts/chain_clocks.py > "$OUT/chain_clocks.log" 2>&1
    echo "rc=$?"; grep -E "^==|chain clocks" "$OUT/chain_clocks.log" | head -n 60 | cut -c1-200 ;;
  tests-x2)
    # on nvidia-h200-x2: the whole forward GPU test module in four pytest processes, two per GPU
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    for i in 0 1 2 3; do forward_group "$i" $((i / 2)) "${TESTS_TIMEOUT_S:-450}" & done
    wait
    collect_forward_groups ;;
  half-oracle)
    # on nvidia-h200-x2: the scoreboard's first half on GPU 0; on GPU 1 at once the CP GPU tests
    # (again: host-cp-half's time limit can cut them), the oracle cases and the forward GPU tests
    # host-cp-half does not run
    SCORE_TIMEOUT_S=440 SCORE_BUDGET_S=370 score_half 0 "${FIRST_HALF[@]}" &
    groups=("context_parallel or forced_short" "test_forward_matches_float64_oracle"
            "not test_forward_matches_float64_oracle and not ($CP_HALF_TESTS)")
    for i in 0 1 2; do
      CUDA_VISIBLE_DEVICES=1 timeout 450 python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider \
        --durations=0 -k "${groups[$i]}" > "$OUT/gpu_tests_$i.log" 2>&1 &
    done
    wait
    cat "$OUT"/gpu_tests_[012].log > "$OUT/gpu_tests.log"; rm -f "$OUT"/gpu_tests_[012].log
    grep -E "passed|failed|error" "$OUT/gpu_tests.log" | grep -v "^cp "; grep -E "^FAILED" "$OUT/gpu_tests.log" | head -n 12 | cut -c1-300
    pack_score_half 0 ;;
  host-tests-ablation)
    # on nvidia-h200-x2: the host step alone first (a quiet host), then at once the forward GPU
    # tests on GPU 0 and, on GPU 1, the prep ablation and the CP per-kernel split of the rows the
    # guard's cost shows in; everything but the summaries in one archive (at most 8 files return)
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    host_alone 110
    CUDA_VISIBLE_DEVICES=0 forward_gpu_tests 430 > "$OUT/tests_summary.txt" 2>&1 &
    (CUDA_VISIBLE_DEVICES=1 timeout 270 python3 -P scripts/prep_ablation.py "$OUT" > "$OUT/prep_ablation.log" 2>&1
     CUDA_VISIBLE_DEVICES=1 timeout 140 python3 -P scripts/kernel_split.py "$OUT" --heads 16/16 --heads 4/16 \
       --seqlens 8192x4 --seqlens 1x8192 --impl flashqla_tune_warmup > "$OUT/kernel_split.log" 2>&1) &
    wait
    cat "$OUT/tests_summary.txt"; grep -E "FAILED|Error" "$OUT/gpu_tests.log" | head -n 20 | cut -c1-300
    grep -E "^\{" "$OUT/prep_ablation.log" | cut -c1-700; grep -E "us of kernel time|cp_jobs" "$OUT/kernel_split.log" | cut -c1-260
    rm -f "$OUT"/gpu_tests_[012].log
    tar -C "$OUT" -czf "$OUT/logs.tar.gz" prep_ablation.log kernel_split.log host_overhead.log tests_summary.txt 2>/dev/null
    rm -f "$OUT"/prep_ablation.log "$OUT"/kernel_split.log "$OUT"/host_overhead.log "$OUT"/tests_summary.txt ;;
  pair)
    # two GPUs of one host: the untimed tests on GPU 0, the timed sweep alone on GPU 1
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    CUDA_VISIBLE_DEVICES=0 forward_gpu_tests 500 > "$OUT/tests_summary.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 520 python3 scripts/tile_sweep.py "$OUT" > "$OUT/tile_sweep.log" 2>&1 &
    wait
    cat "$OUT/tests_summary.txt"; tail -n 45 "$OUT/tile_sweep.log" | cut -c1-220 ;;
  pair-prep)
    # GPU 1: the prep variants, then the host-time split (FLA's and FlashQLA's are in the v11 log)
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    CUDA_VISIBLE_DEVICES=0 forward_gpu_tests 500 > "$OUT/tests_summary.txt" 2>&1 &
    (CUDA_VISIBLE_DEVICES=1 timeout 400 python3 -P scripts/prep_variants.py "$OUT" > "$OUT/prep_variants.log" 2>&1
     CUDA_VISIBLE_DEVICES=1 timeout 100 python3 scripts/host_overhead.py "$OUT" --no-anchors > "$OUT/host_overhead.log" 2>&1) &
    wait
    rm -f "$OUT"/gpu_tests_[012].log  # the device returns at most 8 files; gpu_tests.log has them
    cat "$OUT/tests_summary.txt"; grep -E "prep_ms|worst|Error" "$OUT/prep_variants.log" | tail -n 20 | cut -c1-300
    tail -n 2 "$OUT/host_overhead.log" | cut -c1-600 ;;
  pair-cp-half)
    # GPU 0: the CP, host-path and two-per-SM GPU tests, then the host step (FLA and FlashQLA left
    # out; its times are inflated by GPU 1's parallel builds: host-then-half times it alone);
    # GPU 1: the scoreboard's second half (pair-score)
    (CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider \
       -k "context_parallel or forced_short or cpp_host or group3 or two_ctas" > "$OUT/gpu_tests_cp.log" 2>&1
     CUDA_VISIBLE_DEVICES=0 timeout 100 python3 scripts/host_overhead.py "$OUT" --no-anchors > "$OUT/host_overhead.log" 2>&1) &
    score_half 1 "${SECOND_HALF[@]}" &
    wait
    grep -E "passed|failed|error" "$OUT/gpu_tests_cp.log" | tail -n 2; tail -n 1 "$OUT/host_overhead.log" | cut -c1-400
    pack_score_half 1 ;;
  host-then-half)
    # the host step alone on a quiet host (the bench's parallel builds inflate host times by
    # 1.5-2x), then pair-score's first half in the time left
    host_alone 120
    SCORE_TIMEOUT_S=380 SCORE_BUDGET_S=310 score_half 0 "${FIRST_HALF[@]}"
    pack_score_half 0 ;;
  tests-x1)
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    for i in 0 1 2 3; do forward_group "$i" 0 "${TESTS_TIMEOUT_S:-540}" & done
    wait
    collect_forward_groups ;;
  gpu-tests)
    timeout "${TESTS_TIMEOUT_S:-400}" python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider \
      --durations=0 -k "$2" > "$OUT/gpu_tests.log" 2>&1
    echo "gpu-tests rc=$?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -n 2
    grep -E "^FAILED" "$OUT/gpu_tests.log" | head -n 12 | cut -c1-300 || true ;;
  host-alone)
    host_alone_and_probe ;;
  host-ab)
    FQT_BASE_CSRC=.carry/base-csrc timeout 200 python3 -P scripts/host_launch_ab.py "$OUT" > "$OUT/host_launch_ab.log" 2>&1
    tail -n 1 "$OUT/host_launch_ab.log" | cut -c1-900
    host_alone_and_probe ;;
  kernel-split)
    timeout "${SPLIT_TIMEOUT_S:-420}" python3 -P scripts/kernel_split.py "$OUT" "${@:2}" > "$OUT/kernel_split.log" 2>&1
    echo "kernel-split rc=$?"; grep -E "us of kernel time" "$OUT/kernel_split.log" | cut -c1-300 ;;
  half)
    # one half of the scoreboard on GPU 0 (when no x2 is lent), kept as scoreboard-gpu0.tar.gz
    case "${2:-}" in
      1) half=("${FIRST_HALF[@]}") ;;
      2) half=("${SECOND_HALF[@]}") ;;
      *) echo "half takes 1 or 2, not '${2:-}'" >&2; exit 2 ;;
    esac
    SCORE_TIMEOUT_S=${SCORE_TIMEOUT_S:-400} SCORE_BUDGET_S=${SCORE_BUDGET_S:-330} score_half 0 "${half[@]}"
    pack_score_half 0 ;;
  pair-score)
    score_half 0 "${FIRST_HALF[@]}" &
    score_half 1 "${SECOND_HALF[@]}" &
    wait
    CUDA_VISIBLE_DEVICES=0 timeout 100 python3 scripts/host_overhead.py "$OUT" > "$OUT/host_overhead.log" 2>&1
    tail -n 2 "$OUT/host_overhead.log"
    pack_score_half 0; pack_score_half 1 ;;
  pair-score-cp)
    # on nvidia-h200-x2: pair-score, then on GPU 0 the host step and on GPU 1 the CP GPU tests
    # (after a change of the CP launch whose kernels the whole module has already passed)
    SCORE_TIMEOUT_S=${SCORE_TIMEOUT_S:-400} SCORE_BUDGET_S=${SCORE_BUDGET_S:-330} score_half 0 "${FIRST_HALF[@]}" &
    SCORE_TIMEOUT_S=${SCORE_TIMEOUT_S:-400} SCORE_BUDGET_S=${SCORE_BUDGET_S:-330} score_half 1 "${SECOND_HALF[@]}" &
    wait
    CUDA_VISIBLE_DEVICES=0 timeout 100 python3 scripts/host_overhead.py "$OUT" > "$OUT/host_overhead.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider \
      -k "context_parallel or forced_short" > "$OUT/gpu_tests.log" 2>&1 &
    wait
    tail -n 2 "$OUT/host_overhead.log" | cut -c1-600
    grep -E "passed|failed|error" "$OUT/gpu_tests.log" | grep -v "^cp " | tail -n 2
    grep -E "^FAILED" "$OUT/gpu_tests.log" | head -n 12 | cut -c1-300
    pack_score_half 0; pack_score_half 1
    true ;;
  pair-final)
    # the device returns at most 8 files: the three test groups' logs stay only in gpu_tests.log
    python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
    CUDA_VISIBLE_DEVICES=0 forward_gpu_tests 480 > "$OUT/tests_summary.txt" 2>&1 &
    rows=()
    for h in 16/32 8/32 8/24 16/16; do rows+=(--heads "$h"); done
    for s in 8192x4 16384+16384 1024x8; do rows+=(--seqlens "$s"); done
    CUDA_VISIBLE_DEVICES=1 timeout 480 python3 -P scripts/kernel_split.py "$OUT" "${rows[@]}" --impl flashqla_tune_warmup \
      --impl flashqla_tune_single_chain --impl flashqla > "$OUT/kernel_split.log" 2>&1 &
    wait
    rm -f "$OUT"/gpu_tests_[012].log
    cat "$OUT/tests_summary.txt"; grep -E "us of kernel time" "$OUT/kernel_split.log" | cut -c1-200 ;;
  tests)
    python3 -c "from flashqla_tune.cli import main; main(['info'])" 2>&1 | tee "$OUT/info.txt"
    forward_gpu_tests 420
    timeout 150 python3 scripts/kernel_profile.py "$OUT" 2>&1 | grep heads ;;
  host)
    # with .anchors carried, FLA and FlashQLA are timed too (their first calls compile: ~1-2 min)
    timeout 300 python3 scripts/host_overhead.py "$OUT" 2>&1 | tail -n 2 ;;
  sweep)
    timeout 560 python3 scripts/tile_sweep.py "$OUT" > "$OUT/tile_sweep.log" 2>&1
    tail -n 45 "$OUT/tile_sweep.log" | cut -c1-220 ;;
  fix-and-score)
    # a subset of the GPU tests (what a fix touched: "-k" expression in $2), then the scoreboard
    timeout 150 python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider -k "$2" \
      > "$OUT/gpu_tests_subset.log" 2>&1
    grep -E "passed|failed|error" "$OUT/gpu_tests_subset.log" | tail -n 3
    same_run_scoreboard 420 330 --heads 2/8 --heads 4/16 ;;
  scoreboard)
    # heads from the arguments (e.g. --heads 16/16 --heads 8/24), else the few-head ones first
    # (the rows where FLA is closest)
    heads=("${@:2}")
    [ ${#heads[@]} -gt 0 ] || heads=(--heads 2/8 --heads 4/16 --heads 16/64)
    same_run_scoreboard 560 470 "${heads[@]}" ;;
  ncu)
    # hardware counters work on the Firecracker machines (../.library/device/KINDS.md); the clocks
    # stay as they are (--clock-control none, METHOD.md). One launch of each kernel per case.
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    [ -n "$ncu_bin" ] || { echo "no ncu on this machine" >&2; exit 1; }
    timeout 420 "$ncu_bin" --clock-control none --profile-from-start off \
      --kernel-name regex:'gdn_prep_kernel|gdn_fwd_kernel' \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
      -o "$OUT/kernels" python3 -P scripts/ncu_target.py "${@:2}" > "$OUT/ncu.log" 2>&1
    echo "ncu rc=$?"; tail -n 5 "$OUT/ncu.log"
    "$ncu_bin" --import "$OUT/kernels.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
    grep -E "gdn_|Duration|Warp Cycles Per Issued|Stall|Achieved Occupancy|Memory Throughput" "$OUT/ncu_details.txt" | head -n 40
    # per SASS instruction: where the prep's warps wait (scripts/ncu_hot_instructions.py)
    "$ncu_bin" --import "$OUT/kernels.ncu-rep" --page source --print-source sass --csv \
      --kernel-name regex:gdn_prep_kernel > "$OUT/ncu_prep_source.csv" 2>&1
    python3 scripts/ncu_hot_instructions.py "$OUT/ncu_prep_source.csv" 30 > "$OUT/ncu_prep_hot.txt" 2>&1
    grep -E "^== |by opcode" "$OUT/ncu_prep_hot.txt" | cut -c1-300 ;;
  prep-ablation)
    timeout 420 python3 -P scripts/prep_ablation.py "$OUT" > "$OUT/prep_ablation.log" 2>&1
    echo "rc=$?"; tail -n 4 "$OUT/prep_ablation.log" | cut -c1-600 ;;
  tune-smoke)
    # the tuner's measuring process (tune/isolation.py) on the GPU: a few trials of 2/8, checked and
    # timed in the child; optuna comes from .whl (carry it instead of .whl-bench)
    timeout "${SMOKE_TIMEOUT:-150}" python3 -c "from flashqla_tune.cli import main; import sys; sys.exit(main(sys.argv[1:]))" \
      tune --hqk 2 --hv 8 --trials "${SMOKE_TRIALS:-3}" --budget 120 --no-progress --study-dir "$OUT/study" \
      > "$OUT/tune_smoke.log" 2>&1
    echo "tune rc=$?"; tail -n 16 "$OUT/tune_smoke.log" | cut -c1-300 ;;
  cp)
    # the CP GPU tests, then scripts/cp_profile.py (time per forced segment length, per-kernel split)
    # on its default rows or those of the extra arguments (--heads 8/32 --seqlens 1x16384 ...);
    # scripts/diag_cp.py localises a failure by path (windows / exact / guard) when one appears
    shift
    timeout 300 python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider \
      -k "context_parallel or forced_short" > "$OUT/gpu_tests_cp.log" 2>&1
    grep -E "^cp |passed|failed|error" "$OUT/gpu_tests_cp.log" | tail -n 40
    timeout 220 python3 -P scripts/cp_profile.py "$OUT" "$@" > "$OUT/cp_profile.log" 2>&1
    tail -c 600 "$OUT/cp_profile.log" ;;
  eager-default)
    # issue 4: the scoreboard rows whose op column the default window changes (v6 measured their
    # graph replay); 1x2048 never splits. 16/32 and 8/32 split from 16k tokens.
    rows=()
    for s in 1x32768 1x8192 28672+4096 16384+16384 4096+28672 12288+4096 1024+7168 8192x4 1024x8; do
      rows+=(--seqlens "$s"); done
    timeout 290 bash scripts/h200_scoreboard.sh --impl flashqla_tune --impl fla --impl flashqla --no-graph \
      --heads 2/8 --heads 4/16 --heads 16/16 --heads 8/24 "${rows[@]}" --accuracy-max-tokens 0 \
      --sample-budget-s 0.05 --budget-s 230 --prewarm > "$OUT/eager_a.log" 2>&1
    mkdir -p "$OUT/a" && mv "$OUT"/scoreboard.* "$OUT/a/" 2>/dev/null
    tail -n 8 "$OUT/eager_a.log"
    timeout 250 bash scripts/h200_scoreboard.sh --impl flashqla_tune --impl fla --impl flashqla --no-graph \
      --heads 16/32 --heads 8/32 --seqlens 1x32768 --seqlens 28672+4096 --seqlens 16384+16384 \
      --seqlens 4096+28672 --seqlens 12288+4096 --seqlens 8192x4 --accuracy-max-tokens 0 \
      --sample-budget-s 0.05 --budget-s 200 --prewarm > "$OUT/eager_b.log" 2>&1
    tail -n 8 "$OUT/eager_b.log" ;;
  cp-bench)
    heads=("${@:2}")
    [ ${#heads[@]} -gt 0 ] || heads=(--heads 2/8)
    timeout 560 bash scripts/h200_scoreboard.sh --impl flashqla_tune --impl flashqla_tune_single_chain --impl flashqla_tune_warmup \
      --impl flashqla_tune_exact_cp --impl fla --impl flashqla "${heads[@]}" --accuracy-max-tokens 0 \
      --sample-budget-s 0.05 --budget-s 480 --prewarm > "$OUT/scoreboard_run.log" 2>&1
    tail -n 30 "$OUT/scoreboard_run.log" ;;
  variants)
    timeout 540 python3 -P scripts/prep_variants.py "$OUT" > "$OUT/prep_variants.log" 2>&1
    echo "variants rc=$?"; grep -E "prep_ms|worst|Error" "$OUT/prep_variants.log" | tail -n 32 | cut -c1-400 ;;
  split)
    timeout 240 python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider \
      -k "context_parallel or forced_short" > "$OUT/gpu_tests_cp.log" 2>&1
    grep -E "passed|failed|error" "$OUT/gpu_tests_cp.log" | tail -n 3
    timeout 330 python3 -P scripts/kernel_split.py "$OUT" > "$OUT/kernel_split.log" 2>&1
    echo "split rc=$?"; tail -n 40 "$OUT/kernel_split.log" | cut -c1-400 ;;
  *) echo "unknown step $1 (host-tests-ablation | host-cp-variants | first-x2 | tests-x2 | host-cp-half | half-oracle | pair | pair-prep | pair-cp-half | host-then-half | tests-x1 | gpu-tests | host-alone | host-ab | kernel-split | half | pair-score | pair-final | tests | host | sweep | fix-and-score | scoreboard | ncu | prep-ablation | tune-smoke | cp | eager-default | cp-bench | split | variants)" >&2; exit 2 ;;
esac
