"""Diagnostic (device): our forward against the float64 oracle per head configuration, in-kernel
L2 norm, prep schedule and prep CTA size, to localise a failure the GPU tests report in about a
minute (it found v4's L2-norm miscompile).

    python -P scripts/diag_schedules.py
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")
from gdn_inputs import rel_l2  # noqa: E402
from test_gpu_forward import make_case, reference, run_ours, variant_plan  # noqa: E402

from flashqla_tune.cache import get_kernels  # noqa: E402
from flashqla_tune.plan import TileParams  # noqa: E402

# (hqk, hv, seqlens): G = 4, 1, 4 over a long row, and 8 (two head batches in the prep)
CONFIGS = [(4, 16, [777, 1500]), (4, 4, [777, 1500]), (2, 8, [5000]), (2, 16, [777, 1500])]
PREP_THREADS = (256, 128)
get_kernels([variant_plan(h, v, TileParams(prep_threads=t)) for h, v, _ in CONFIGS for t in PREP_THREADS])
for hqk, hv, seqlens in CONFIGS:
    for l2norm in (False, True):
        inp = make_case(7, seqlens, hqk, hv, torch.bfloat16, "mixed", True, False, normalised=not l2norm)
        ref_o, ref_s = reference(inp, l2norm)
        for threads in PREP_THREADS:
            plan = variant_plan(hqk, hv, TileParams(prep_threads=threads))
            for schedule in ("serial", "overlap"):
                with torch.no_grad():
                    o, s = run_ours(inp, l2norm, schedule, plan=plan)
                torch.cuda.synchronize()
                print(f"{hqk}/{hv} {seqlens} l2norm={l2norm} prep_threads={threads} {schedule:8s} "
                      f"o={rel_l2(o, ref_o):.2e} state={rel_l2(s, ref_s):.2e} nan={bool(torch.isnan(o).any())}",
                      flush=True)
