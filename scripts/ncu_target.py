"""The program `scripts/h200_next_session.sh ncu` runs under Nsight Compute: one eager call of our
forward per case (serial prep schedule, so each kernel runs alone), after a warm-up call that
builds and loads the plan outside the profiled range (cudaProfilerStart/Stop bracket the calls;
ncu runs with --profile-from-start off).

    python -P scripts/ncu_target.py            (under ncu; alone it just runs the calls)
"""
from __future__ import annotations

import torch

from flashqla_tune.bench.cases import Case
from flashqla_tune.bench.inputs import make_rotation
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec
from flashqla_tune.tune.measure import forward_on_inputs

# The prep's worst rows (one and four v-heads per q/k head) and the sequential kernel's floor row.
CASES = [Case(16, 16, (32768,)), Case(16, 64, (8192,)), Case(2, 8, (32768,))]


def main() -> None:
    with torch.no_grad():
        calls = []
        for case in CASES:
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
    main()
