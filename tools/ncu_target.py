"""The program tools/h200_ncu.sh runs under Nsight Compute: one eager call of our
forward per case (serial prep schedule, so each kernel runs alone), after a warm-up call that
builds and loads the plan outside the profiled range (cudaProfilerStart/Stop bracket the calls;
ncu runs with --profile-from-start off).

    python -P tools/ncu_target.py [H/V:SEQLENS ...]   (under ncu; alone it just runs the calls)

Cases default to CASES below; e.g. 16/16:1024x8 2/8:1024x8 profiles the short-sequence rows.
"""
from __future__ import annotations

import sys

import torch

from flashqla_tune.measure.cases import Case, parse_heads, parse_seqlens
from flashqla_tune.measure.inputs import make_rotation
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec
from flashqla_tune.tune.measure import forward_on_inputs

# The prep's worst rows (one and four v-heads per q/k head) and the sequential kernel's floor row.
CASES = [Case(16, 16, (32768,)), Case(16, 64, (8192,)), Case(2, 8, (32768,))]


def cases_from(args: list[str]) -> list[Case]:
    """H/V:SEQLENS arguments (scoreboard spellings) as cases; none: CASES."""
    if not args:
        return CASES
    cases = []
    for arg in args:
        heads, _, seqlens = arg.partition(":")
        cases.append(Case(*parse_heads(heads), parse_seqlens(seqlens)))
    return cases


def main(args: list[str]) -> None:
    with torch.no_grad():
        calls = []
        for case in cases_from(args):
            plan = default_plan(GDNSpec(case.num_qk_heads, case.num_v_heads))
            x = make_rotation(case, 1, "cuda")[0]
            forward_on_inputs(plan, x, prep_schedule="serial")   # build, load, first launch
            calls.append((case, plan, x))
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for case, plan, x in calls:
            torch.cuda.nvtx.range_push(f"{case.heads} {case.seqlens_label}")
            forward_on_inputs(plan, x, prep_schedule="serial")
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print("profiled:", ", ".join(f"{c.heads} {c.seqlens_label}" for c, _, _ in calls))


if __name__ == "__main__":
    main(sys.argv[1:])
