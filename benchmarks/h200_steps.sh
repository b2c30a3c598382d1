#!/usr/bin/env bash
# The forward's measurements on the H200, one step per device call (device tool `run`, repository
# root; carry [".whl-bench", ".anchors"], see tools/make_device_bundles.sh). Each step fits the
# 10-minute limit and writes to $OUT (the device returns at most 8 files a call, so a step that
# writes more tars them); its summary prints last.
#   bash benchmarks/h200_steps.sh setup        install and describe the machine: $OUT/env.txt, $OUT/info.txt
#   bash benchmarks/h200_steps.sh tests        tests/test_gpu_forward.py in four pytest processes on one GPU:
#                                              $OUT/gpu_tests.log (published: docs/results/gpu-tests-forward.log)
#   bash benchmarks/h200_steps.sh tests-x2     the same on nvidia-h200-x2, two processes per GPU
#   bash benchmarks/h200_steps.sh gpu-tests EXPR   the forward GPU tests matching the -k expression EXPR
#   bash benchmarks/h200_steps.sh half 1|2     one half of the scoreboard (all our columns, FLA, FlashQLA)
#                                              on GPU 0: $OUT/scoreboard-gpu0.tar.gz
#   bash benchmarks/h200_steps.sh pair-score   both halves at once on nvidia-h200-x2:
#                                              $OUT/scoreboard-gpu0.tar.gz and scoreboard-gpu1.tar.gz
#   bash benchmarks/h200_steps.sh join DIR PART.tar.gz PART.tar.gz...   (here, no GPU) two or more
#                                              halves or parts unpacked into DIR and joined into
#                                              DIR/scoreboard.{md,json} (published: docs/results/scoreboard.md,
#                                              scoreboard-half-*.json)
#   bash benchmarks/h200_steps.sh flashinfer-stage   (carry one .whl-fi-* part instead, e.g. [".whl-fi-a"], then
#                                              [".whl-fi-b"] in the next call) stages the FlashInfer bundle's
#                                              part in /tmp (it stays while the machine is warm) and installs
#                                              the bundle once every part is there
#   bash benchmarks/h200_steps.sh flashinfer-rows ROWS [BENCH ARGS]   (after flashinfer-stage, same warm
#                                              machine) the scoreboard rows of the row set ROWS (protocol,
#                                              users, all; --heads / --seqlens pick a part) with FlashInfer and
#                                              cuDNN beside ours, FLA and FlashQLA, accuracy on rows of at most
#                                              8192 tokens: $OUT/scoreboard-fi-ROWS.tar.gz (joinable by join)
#   bash benchmarks/h200_steps.sh cold-start   benchmarks/cold_start.py: ours (an untuned pack of the shipped
#                                              model, built first), FlashQLA, FLA, and FlashInfer when its
#                                              bundle is installed (flashinfer-stage): $OUT/cold/cold_start.json
#                                              (published: docs/results/cold-start.json)
#   bash benchmarks/h200_steps.sh host         eager host time: tools/host_overhead.py, then
#                                              benchmarks/host_queue_probe.py (published:
#                                              docs/results/host-queue-probe.json); needs a quiet machine
#   bash benchmarks/h200_steps.sh host-ab      (carry .carry too, .carry/base-csrc holding the csrc/ to compare)
#                                              benchmarks/host_launch_ab.py (published:
#                                              docs/results/host-launch-ab.json), then the host step
#   bash benchmarks/h200_steps.sh kernel-split ARGS   benchmarks/kernel_split.py with ARGS (--heads,
#                                              --seqlens, --impl): $OUT/kernel_split.json and .log
#                                              (published: docs/results/kernel-split.json)
#   bash benchmarks/h200_steps.sh backward-tests   the backward's three libraries built, then
#                                              tests/test_gpu_backward_{chain,prep,chunk}.py (each kernel against
#                                              float64, then the op's gradients) and
#                                              tests/test_gpu_backward.py (FLA's reference errors from its
#                                              Triton kernels with its TileLang chunk_bwd_dqkwg, FlashQLA's
#                                              backend off): $OUT/gpu_tests_backward.log
#                                              (published: docs/results/gpu-tests-backward.log)
#   bash benchmarks/h200_steps.sh backward-variants [ARGS]   the per-chunk kernel's library variants (one
#                                              or two warp groups a CTA, walking CTAs) timed on the same inputs:
#                                              benchmarks/backward_chunk_variants.py with ARGS (--heads, --tokens):
#                                              $OUT/bwd/backward_chunk_variants.json, $OUT/backward_chunk_variants.log
#                                              (published: docs/results/backward-chunk-variants.{json,log})
#   bash benchmarks/h200_steps.sh gate-tests   tests/test_gpu_gate_options.py, FLA's in-kernel gate and beta
#                                              options against the float64 oracle beside FLA's own:
#                                              $OUT/gpu_tests_gates.log (published: docs/results/gpu-tests-gates.log)
#   bash benchmarks/h200_steps.sh backward-bench [ARGS]   benchmarks/backward_bench.py --prewarm with ARGS
#                                              (--heads, --seqlens, --impl, --fla-dispatch, --budget-s): forward
#                                              plus backward of ours, FlashQLA, FLA: $OUT/bwd/backward_bench.{json,md}
#   bash benchmarks/h200_steps.sh train-compare [ARGS]   (carry [".whl-bench", ".whl-hf"] instead: transformers,
#                                              no FLA) benchmarks/train_compare.py with ARGS: the shipped model's
#                                              architecture trained on our op and on the float32 PyTorch path:
#                                              $OUT/train/train_compare.{json,log,png}
# Packs and the tuner: benchmarks/h200_pack.sh. Nsight Compute: tools/h200_ncu.sh.
set -uo pipefail
OUT=${OUT:-/tmp/steps_out}
mkdir -p "$OUT"
STEP=${1:-tests}
case "$STEP" in
  setup|tests|tests-x2|gpu-tests|half|pair-score|join|host|host-ab|kernel-split|flashinfer-stage|flashinfer-rows|cold-start) ;;
  backward-tests|backward-variants|backward-bench|train-compare|gate-tests) ;;
  *) echo "unknown step '$STEP' (setup | tests | tests-x2 | gpu-tests | half | pair-score | join | host |" \
       "host-ab | kernel-split | flashinfer-stage | flashinfer-rows | cold-start | backward-tests |" \
       "backward-variants | backward-bench | train-compare | gate-tests)" >&2
     exit 2 ;;
esac

if [ "$STEP" = join ]; then
  # Runs where the halves came back: no device set-up, no GPU (the join reads JSON alone).
  [ $# -ge 4 ] || { echo "join takes DIR PART.tar.gz PART.tar.gz..." >&2; exit 2; }
  # Each part unpacks into DIR/<archive name>/ and stays there beside the joined table.
  dest=$2 joins=()
  for archive in "${@:3}"; do
    part="$dest/$(basename "$archive" .tar.gz)"
    mkdir -p "$part" && tar -C "$part" -xzf "$archive" || exit 1
    json=$(ls "$part"/gpu*/scoreboard.json 2>/dev/null | head -n 1)
    [ -n "$json" ] || { echo "$archive holds no gpu*/scoreboard.json" >&2; exit 1; }
    joins+=(--join "$json")
  done
  exec python3 -m flashqla_tune.cli.bench "${joins[@]}" --out "$dest" --stem scoreboard
fi

source tools/device_setup.sh
if [ "$STEP" = flashinfer-stage ]; then  # copies and unpacks only: no install of the checkout, no GPU
  device_fi_stage
  exit $?
fi
# .whl-bench (no optuna storage wheels) keeps [wheels, .anchors] under the 64 MiB a call carries
# .whl-hf (transformers) is installed too when a step carries it (train-compare)
device_setup "$( [ -d .whl-bench ] && echo .whl-bench || echo .whl )" $( [ -d .whl-hf ] && echo .whl-hf ) || exit 1
export FLA_DISABLE_BACKEND_DISPATCH=1

# The scoreboard's two halves of three head configurations each: one GPU's share in OUT/gpuN (the
# bench writes scoreboard.* there); --prewarm compiles every head configuration's kernels (FLA,
# FlashQLA, ours) in parallel first; --budget-s stops starting new rows in time for the table to
# be written. score_half GPU --heads H/V ...
FIRST_HALF=(--heads 16/16 --heads 2/8 --heads 4/16)
SECOND_HALF=(--heads 8/24 --heads 16/32 --heads 8/32)
score_half() {
  local gpu=$1
  shift
  mkdir -p "$OUT/gpu$gpu"
  CUDA_VISIBLE_DEVICES=$gpu OUT="$OUT/gpu$gpu" timeout "${SCORE_TIMEOUT_S:-440}" bash benchmarks/h200_scoreboard.sh \
    --impl flashqla_tune --impl flashqla_tune_single_chain --impl flashqla_tune_warmup --impl flashqla_tune_exact_cp \
    --impl fla --impl flashqla "$@" --accuracy-max-tokens 0 --sample-budget-s 0.05 --budget-s "${SCORE_BUDGET_S:-370}" --prewarm \
    > "$OUT/gpu$gpu/scoreboard_run.log" 2>&1
}
# What a call keeps of a half: its calibrated column's summary line printed, its folder as one archive.
pack_score_half() {
  grep -A12 "^Summary, graph" "$OUT/gpu$1/scoreboard.md" | grep flashqla_tune_warmup
  tar -C "$OUT" -czf "$OUT/scoreboard-gpu$1.tar.gz" "gpu$1" && rm -rf "${OUT:?}/gpu$1"
}
# The forward module in four groups of similar length: the oracle cases in two, the other tests
# in two (nothing in them is timed, so groups may share a GPU; the plans build once, the cache's
# file lock makes the other processes wait). forward_group I GPU TIMEOUT_S runs group I;
# collect_forward_groups joins their logs into gpu_tests.log and prints the counts and failures.
ORACLE="test_forward_matches_float64_oracle"
CP_TESTS="context_parallel or forced_short or cpp_host or graph or two_ctas or malformed or no_sequence or int32 or 16_byte"
FORWARD_GROUPS=("$ORACLE and (gva_varlen_bf16 or l2norm or strong or weak or zero or gqa2)"
                "$ORACLE and not (gva_varlen_bf16 or l2norm or strong or weak or zero or gqa2)"
                "not $ORACLE and ($CP_TESTS)" "not $ORACLE and not ($CP_TESTS)")
forward_group() {
  CUDA_VISIBLE_DEVICES=$2 timeout "$3" python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py \
    -p no:cacheprovider --durations=0 -k "${FORWARD_GROUPS[$1]}" > "$OUT/gpu_tests_$1.log" 2>&1
}
collect_forward_groups() {
  cat "$OUT"/gpu_tests_[0123].log > "$OUT/gpu_tests.log"; rm -f "$OUT"/gpu_tests_[0123].log
  grep -E "passed|failed|error" "$OUT/gpu_tests.log" | grep -v "^cp "
  grep -E "^FAILED" "$OUT/gpu_tests.log" | head -n 12 | cut -c1-300 || true  # no failure is not an error
}
# parallel_gpu_tests LOG TIMEOUT_S FILE...: the GPU tests of FILE... in TEST_WORKERS (default 6) pytest
# processes on GPU 0, test by test in turn (the cases are long because of the peers' JIT compiles, which
# are CPU-bound, so processes overlap them); LOG is their logs one after another, each ending with its
# own counts; prints the counts and the failures.
parallel_gpu_tests() {
  local log=$1 limit=$2 workers=${TEST_WORKERS:-6} ids=() w i
  shift 2
  mapfile -t ids < <(python3 -m pytest -q -m gpu --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep "::")
  [ ${#ids[@]} -gt 0 ] || { echo "no GPU tests collected in $*" >&2; return 1; }
  for ((w = 0; w < workers && w < ${#ids[@]}; w++)); do
    local mine=()
    for ((i = w; i < ${#ids[@]}; i += workers)); do mine+=("${ids[$i]}"); done
    CUDA_VISIBLE_DEVICES=0 timeout "$limit" python3 -m pytest -q -s -m gpu -p no:cacheprovider --durations=0 \
      "${mine[@]}" > "$log.$w" 2>&1 &
  done
  wait
  cat "$log".[0-9]* > "$log" && rm -f "$log".[0-9]*
  echo "${#ids[@]} tests in $w processes:"; grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)" "$log"
  grep -E "^FAILED" "$log" | head -n 12 | cut -c1-300 || true  # no failure is not an error
}
# The backward's chain and prep libraries for K = V = 128 in the kernel cache, and the per-chunk
# gradient kernel as each of its variants (chunk_kernels.variants_for: one or two warp groups a
# CTA), built side by side where missing, with each one's registers and spills.
backward_libraries() {
  python3 - <<'PY'
from concurrent.futures import ThreadPoolExecutor
from flashqla_tune.backward import chain_kernels, chunk_kernels, prep_kernels
wanted = [(m, m.spec_for(128, 128)) for m in (chain_kernels, prep_kernels)]
wanted += [(chunk_kernels, s) for s in chunk_kernels.variants_for(128, 128).values()]
with ThreadPoolExecutor(len(wanted)) as pool:
    entries = list(pool.map(lambda ms: ms[0].LIBRARIES.cache_entry(ms[1]), wanted))
for e in entries:
    for name, info in e.resources.items():
        if info.get("entry"):
            print(e.so_path.name, name[:60], {k: info.get(k) for k in ("registers", "spill_stores", "spill_loads")})
PY
}
info() {
  python3 -c "from flashqla_tune.cli import main; main(['info'])" > "$OUT/info.txt" 2>&1
}
# The host step on GPU 0, alone on the machine (parallel builds inflate host times 1.5-2x): the
# per-layer split without FLA and FlashQLA, then calls one at a time after a synchronize.
host_step() {
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -P tools/host_overhead.py "$OUT" --no-anchors > "$OUT/host_overhead.log" 2>&1
  tail -n 1 "$OUT/host_overhead.log" | cut -c1-700
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -P benchmarks/host_queue_probe.py "$OUT" > "$OUT/host_queue_probe.log" 2>&1
  tail -n 4 "$OUT/host_queue_probe.log" | cut -c1-600
}

case "$STEP" in
  setup)
    device_report "$OUT"
    info
    cat "$OUT/info.txt" ;;
  tests)
    info
    for i in 0 1 2 3; do forward_group "$i" 0 "${TESTS_TIMEOUT_S:-540}" & done
    wait
    collect_forward_groups ;;
  tests-x2)
    info
    for i in 0 1 2 3; do forward_group "$i" $((i / 2)) "${TESTS_TIMEOUT_S:-450}" & done
    wait
    collect_forward_groups ;;
  gpu-tests)
    [ -n "${2:-}" ] || { echo "gpu-tests takes a -k expression" >&2; exit 2; }
    timeout "${TESTS_TIMEOUT_S:-400}" python3 -m pytest -q -s -m gpu tests/test_gpu_forward.py -p no:cacheprovider \
      --durations=0 -k "$2" > "$OUT/gpu_tests.log" 2>&1
    echo "gpu-tests rc=$?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -n 2
    grep -E "^FAILED" "$OUT/gpu_tests.log" | head -n 12 | cut -c1-300 || true ;;
  half)
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
    pack_score_half 0; pack_score_half 1 ;;
  host)
    host_step ;;
  host-ab)
    FQT_BASE_CSRC=.carry/base-csrc timeout 200 python3 -P benchmarks/host_launch_ab.py "$OUT" > "$OUT/host_launch_ab.log" 2>&1
    tail -n 1 "$OUT/host_launch_ab.log" | cut -c1-900
    host_step ;;
  flashinfer-rows)
    # The peers' columns beside our default and calibrated ones; FlashInfer compiles its CuTe-DSL
    # kernels in its first row's warm-up (not prewarmed). One GPU's share in OUT/gpu0, as a half's.
    case "${2:-}" in
      protocol|users|all) rows=$2 ;;
      *) echo "flashinfer-rows takes a row set (protocol, users, all), not '${2:-}'" >&2; exit 2 ;;
    esac
    device_fi_env || exit 1
    mkdir -p "$OUT/gpu0"
    CUDA_VISIBLE_DEVICES=0 OUT="$OUT/gpu0" timeout "${SCORE_TIMEOUT_S:-540}" bash benchmarks/h200_scoreboard.sh \
      --rows "$rows" --impl flashqla_tune --impl flashqla_tune_warmup --impl fla --impl flashqla --impl flashinfer \
      --impl cudnn "${@:3}" --sample-budget-s 0.05 --budget-s "${SCORE_BUDGET_S:-450}" --prewarm \
      > "$OUT/gpu0/scoreboard_run.log" 2>&1
    echo "flashinfer-rows rc=$?"
    grep -E "skipping|^- implementations" "$OUT/gpu0/scoreboard_run.log" | cut -c1-900
    grep -A16 "^Summary, graph" "$OUT/gpu0/scoreboard.md" | grep -E "flashinfer|best peer"
    tar -C "$OUT" -czf "$OUT/scoreboard-fi-$rows.tar.gz" gpu0 && rm -rf "${OUT:?}/gpu0" ;;
  cold-start)
    # the page cache and the peers' JIT caches are warm from each implementation's second run
    impls=(--impl ours --impl flashqla --impl fla)
    if device_fi_env 2>/dev/null; then impls+=(--impl flashinfer); else echo "FlashInfer bundle not installed: not timed"; fi
    timeout "${COLD_TIMEOUT_S:-540}" python3 -P benchmarks/cold_start.py "$OUT/cold" "${impls[@]}" --runs 2 \
      > "$OUT/cold_start.log" 2>&1
    echo "cold-start rc=$?"; grep -E "run [12]:|cold start" "$OUT/cold_start.log" | cut -c1-330 ;;
  kernel-split)
    timeout "${SPLIT_TIMEOUT_S:-420}" python3 -P benchmarks/kernel_split.py "$OUT" "${@:2}" > "$OUT/kernel_split.log" 2>&1
    echo "kernel-split rc=$?"; grep -E "us of kernel time" "$OUT/kernel_split.log" | cut -c1-300 ;;
  backward-tests)
    # the three backward libraries built once, side by side, before the test processes share the cache
    backward_libraries
    # FLA's Triton chunk_bwd_dqkwg raises on Hopper with Triton < 3.7.1 unless its TileLang backend
    # serves it, which needs FLA's dispatch on; FLA_FLASH_QLA=0 keeps FLA's whole op from going to FlashQLA.
    FLA_DISABLE_BACKEND_DISPATCH=0 FLA_FLASH_QLA=0 parallel_gpu_tests "$OUT/gpu_tests_backward.log" \
      "${TESTS_TIMEOUT_S:-420}" tests/test_gpu_backward_chain.py tests/test_gpu_backward_prep.py \
      tests/test_gpu_backward_chunk.py tests/test_gpu_backward.py ;;
  gate-tests)
    parallel_gpu_tests "$OUT/gpu_tests_gates.log" "${TESTS_TIMEOUT_S:-480}" tests/test_gpu_gate_options.py ;;
  backward-variants)
    # the per-chunk kernel's library variants timed on the same inputs
    backward_libraries
    timeout "${VARIANTS_TIMEOUT_S:-240}" python3 -P benchmarks/backward_chunk_variants.py "$OUT/bwd" "${@:2}" \
      2>&1 | tee "$OUT/backward_chunk_variants.log"
    echo "backward-variants rc=${PIPESTATUS[0]}" ;;
  backward-bench)
    # the script sets FLA's environment itself (--fla-dispatch) before it imports FLA
    timeout "${BWD_TIMEOUT_S:-560}" python3 -P benchmarks/backward_bench.py "$OUT/bwd" --prewarm "${@:2}" \
      > "$OUT/backward_bench.log" 2>&1
    echo "backward-bench rc=$?"; grep -E "skipping|geomean|prewarm:|graph replay|-> " "$OUT/backward_bench.log" | cut -c1-400
    grep -A7 "^## One GDN layer" "$OUT/bwd/backward_bench.md" 2>/dev/null || true ;;
  train-compare)
    timeout "${TRAIN_TIMEOUT_S:-560}" python3 -P benchmarks/train_compare.py --out "$OUT/train" "${@:2}" \
      > "$OUT/train_compare_run.log" 2>&1
    echo "train-compare rc=$?"; grep -E "tokens/s|max \|MA gap\||-> " "$OUT/train/train_compare.log" | cut -c1-300 ;;
esac
