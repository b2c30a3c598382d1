"""Diagnostic (device): our forward against the float64 oracle per head configuration, l2norm
and prep schedule, to localise a failure the GPU tests report.

    python -P scripts/diag_schedules.py
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")
from gdn_inputs import rel_l2  # noqa: E402
from test_gpu_forward import make_case, reference, run_ours  # noqa: E402

from flashqla_tune import ops, runtime  # noqa: E402
from flashqla_tune.cache import get_kernels  # noqa: E402

CONFIGS = [(4, 16, [777, 1500]), (2, 8, [777, 1500]), (4, 16, [2048]), (4, 4, [777, 1500])]
get_kernels([runtime.default_plan_for(ops._spec(h, v, 128, 128, True, False)) for h, v, _ in CONFIGS])
for hqk, hv, seqlens in CONFIGS:
    for l2norm in (False, True):
        inp = make_case(7, seqlens, hqk, hv, torch.bfloat16, "mixed", True, False, normalised=not l2norm)
        ref_o, ref_s = reference(inp, l2norm)
        for schedule in ("serial", "overlap"):
            with torch.no_grad():
                o, s = run_ours(inp, l2norm, schedule)
            torch.cuda.synchronize()
            print(f"{hqk}/{hv} {seqlens} l2norm={l2norm} {schedule:8s} o={rel_l2(o, ref_o):.2e} "
                  f"state={rel_l2(s, ref_s):.2e}", flush=True)
