#!/usr/bin/env bash
# Issue 6's GPU half in one device call. Carry [".whl", ".whl-hf", ".fla"] (about 42 MB):
#   .whl     nvidia-cutlass, filelock, optuna and its wheels (the H200 image has none of them)
#   .whl-hf  transformers 5.24 and its wheels, for the shipped model's prefill
#   .fla     FLA 0.6.0 alone (fla/ + dist-info, from ../shared/tools/anchor-bundle.sh's archive),
#            the dispatch target and the error bar of the forward tests
# The tuning journals (names carry '@', which the device's file return drops) come back as
# $OUT/tuning.tar; copy it to .carry/tuning.tar and add ".carry/tuning.tar" to carry, and the next
# call resumes those studies (issue 6: a build may span two calls).
# `tests`: the GPU tests of packs (the forward's are scripts/h200_next_session.sh tests). `build`: `flashqla-tune build` of the shipped
# checkpoint with tuning (TUNE_BUDGET seconds, default 300), leaving its log, the tuning journal
# and the pack's manifest and calibration in $OUT. `workers`: two tuner processes sharing one
# journal on one GPU. One step per call (each fits the 10-minute limit):
#   bash scripts/h200_pack_session.sh tests ; bash scripts/h200_pack_session.sh build
#   bash scripts/h200_pack_session.sh workers
set -uo pipefail
OUT=${OUT:-/tmp/pack_out}
mkdir -p "$OUT"
source scripts/device_setup.sh
[ -f .fla/fla.tar.xz ] || { echo "carry .fla (scripts/make_device_bundles.sh)" >&2; exit 1; }
device_setup .whl .whl-hf || exit 1
device_report "$OUT"
mkdir -p "$FLASHQLA_TUNE_CACHE"
if [ -f .carry/tuning.tar ]; then tar -C "$FLASHQLA_TUNE_CACHE" -xf .carry/tuning.tar && echo "resuming carried studies"; fi
save_tuning() { [ -d "$FLASHQLA_TUNE_CACHE/tuning" ] && tar -C "$FLASHQLA_TUNE_CACHE" -cf "$OUT/tuning.tar" tuning; }
trap save_tuning EXIT  # also when a timeout cuts the build: the journal is what a later call resumes
python3 -c "import transformers, fla; print('transformers', transformers.__version__, 'fla', fla.__version__)" | tee -a "$OUT/env.txt"
STEP=${1:-tests}
if [ "$STEP" = workers ]; then
# Issue 6, part 4: two tuner processes share one journal (--study-dir) and split the trials; each
# closing table lists the trials per worker. TUNE_BUDGET seconds each (default 240). On one GPU
# both share it; WORKER_GPUS=2 (on an nvidia-h200-x2 machine) gives each worker its own.
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
