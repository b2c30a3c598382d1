#!/usr/bin/env bash
# Packs and the tuner on the H200, one step per device call (each fits the 10-minute limit; repository
# root). Carry [".whl", ".whl-hf", ".fla"] (about 42 MB):
#   .whl     nvidia-cutlass, filelock, optuna and its wheels (the H200 image has none of them)
#   .whl-hf  transformers and its wheels, for the shipped model's prefill
#   .fla     FLA alone (fla/ + dist-info, cut from ../shared/tools/anchor-bundle.sh's archive by
#            tools/make_device_bundles.sh), the dispatch target and the error bar of the tests
# Steps:
#   bash benchmarks/h200_pack.sh tests     the pack GPU tests (tests/test_gpu_pack.py): $OUT/gpu_tests.log
#                                          (published: docs/results/gpu-tests-pack.log)
#   bash benchmarks/h200_pack.sh build     `flashqla-tune build` of the shipped checkpoint with tuning
#                                          (TUNE_BUDGET seconds, default 300): $OUT/build.log and the pack's
#                                          manifest and calibration in $OUT/pack (published:
#                                          docs/results/tuned-build.log, tuned-build-manifest.json)
#   bash benchmarks/h200_pack.sh workers   two tuner processes sharing one journal (WORKER_GPUS=2 on an
#                                          nvidia-h200-x2 gives each its own GPU): $OUT/worker{1,2}.log
#                                          (published: docs/results/tuner-two-workers-{1,2}.log), $OUT/study.tar
# The tuning journals (names carry '@', which the device's file return drops) come back as
# $OUT/tuning.tar; copy it to .carry/tuning.tar and add ".carry/tuning.tar" to carry, and the next
# call resumes those studies (a build may span two calls). $OUT/env.txt names the machine.
set -uo pipefail
STEP=${1:-tests}
case "$STEP" in
  tests|build|workers) ;;
  *) echo "unknown step '$STEP' (tests | build | workers)" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/pack_out}
mkdir -p "$OUT"
source tools/device_setup.sh
[ -f .fla/fla.tar.xz ] || { echo "carry .fla (tools/make_device_bundles.sh)" >&2; exit 1; }
device_setup .whl .whl-hf || exit 1
device_report "$OUT"
mkdir -p "$FLASHQLA_TUNE_CACHE"
if [ -f .carry/tuning.tar ]; then tar -C "$FLASHQLA_TUNE_CACHE" -xf .carry/tuning.tar && echo "resuming carried studies"; fi
save_tuning() { [ -d "$FLASHQLA_TUNE_CACHE/tuning" ] && tar -C "$FLASHQLA_TUNE_CACHE" -cf "$OUT/tuning.tar" tuning; }
trap save_tuning EXIT  # also when a timeout cuts the build: the journal is what a later call resumes
python3 -c "import transformers, fla; print('transformers', transformers.__version__, 'fla', fla.__version__)" | tee -a "$OUT/env.txt"
if [ "$STEP" = workers ]; then
# Two tuner processes share one journal (--study-dir) and split the trials; each closing table
# lists the trials per worker. TUNE_BUDGET seconds each (default 240). On one GPU both share it;
# WORKER_GPUS=2 (on an nvidia-h200-x2 machine) gives each worker its own.
jobs=$(( $(nproc) / 2 ))
for w in 1 2; do
  gpu=0; [ "${WORKER_GPUS:-1}" = 2 ] && gpu=$(( w - 1 ))
  CUDA_VISIBLE_DEVICES=$gpu python3 -c "from flashqla_tune.cli import main; import sys; sys.exit(main(sys.argv[1:]))" \
    tune --hqk 2 --hv 8 --study-dir "$OUT/study" --budget "${TUNE_BUDGET:-240}" --jobs "$jobs" --no-progress \
    > "$OUT/worker$w.log" 2>&1 &
done
wait
for w in 1 2; do echo "== worker $w"; tail -n 22 "$OUT/worker$w.log"; done
tar -C "$OUT" -cf "$OUT/study.tar" study && rm -rf "$OUT/study"
exit 0
fi
if [ "$STEP" = tests ]; then
timeout "${TEST_TIMEOUT:-450}" python3 -m pytest -q -s -m gpu tests/test_gpu_pack.py \
  -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|error|load \+ first|prefill" "$OUT/gpu_tests.log" | tail -n 8
exit 0
fi
# the budget covers the tile search; calibration, compiling, the segment stage and the pack come on top
timeout "$(( ${TUNE_BUDGET:-300} + 240 ))" python3 -c "from flashqla_tune.cli import main; import sys; sys.exit(main(sys.argv[1:]))" \
  build calibrate/data/default_model --out "$OUT/pack" --budget "${TUNE_BUDGET:-300}" --no-progress > "$OUT/build.log" 2>&1
echo "build rc=$?"; tail -n 25 "$OUT/build.log"
rm -rf "$OUT/pack/binaries" 2>/dev/null  # binaries stay on the device; the manifest and calibration come back
