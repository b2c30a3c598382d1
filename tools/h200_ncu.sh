#!/usr/bin/env bash
# Nsight Compute on the prep and sequential kernels on the H200 (device tool `run`, carry
# [".whl-bench"]): one profiled eager call per case of tools/ncu_target.py (its default cases, or
# H/V:SEQLENS arguments), with stall reasons, memory, occupancy and per-instruction warp samples;
# then tools/ncu_hot_instructions.py on the prep kernel's SASS (--backward: the backward's). The clocks stay as they are
# (--clock-control none). Writes to $OUT: kernels.ncu-rep, ncu.log, ncu_details.txt,
# ncu_hot_source.csv, ncu_hot.txt (the prep's, or with --backward the
# per-chunk kernel's); prints the headline counters last.
#   bash tools/h200_ncu.sh [16/16:1024x8 ...]      (repository root)
#   bash tools/h200_ncu.sh --backward [16/32:1x32768 ...]   the backward's kernels instead (prep,
#       chains, per-chunk gradients) over one forward + backward step; the hot instructions are the
#       per-chunk kernel's
set -uo pipefail
KERNELS='gdn_prep_kernel|gdn_fwd_kernel' HOT=gdn_prep_kernel
if [ "${1:-}" = --backward ]; then KERNELS='gdn_bwd_' HOT=gdn_bwd_chunk_kernel; fi
OUT=${OUT:-/tmp/ncu_out}
mkdir -p "$OUT"
source tools/device_setup.sh
device_setup "$( [ -d .whl-bench ] && echo .whl-bench || echo .whl )" || exit 1
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$ncu_bin" ] || { echo "no ncu on this machine" >&2; exit 1; }
timeout 420 "$ncu_bin" --clock-control none --profile-from-start off \
  --kernel-name regex:"$KERNELS" \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
  -o "$OUT/kernels" python3 -P tools/ncu_target.py "$@" > "$OUT/ncu.log" 2>&1
echo "ncu rc=$?"; tail -n 5 "$OUT/ncu.log"
"$ncu_bin" --import "$OUT/kernels.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
grep -E "gdn_|Duration|Warp Cycles Per Issued|Stall|Achieved Occupancy|Memory Throughput" "$OUT/ncu_details.txt" | head -n 40
# per SASS instruction: where the hot kernel's warps wait
"$ncu_bin" --import "$OUT/kernels.ncu-rep" --page source --print-source sass --csv \
  --kernel-name regex:"$HOT" > "$OUT/ncu_hot_source.csv" 2>&1
python3 tools/ncu_hot_instructions.py "$OUT/ncu_hot_source.csv" 30 > "$OUT/ncu_hot.txt" 2>&1
grep -E "^== |by opcode" "$OUT/ncu_hot.txt" | cut -c1-300
