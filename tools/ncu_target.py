"""The program tools/h200_ncu.sh runs under Nsight Compute: one eager call of our
forward per case (serial prep schedule, so each kernel runs alone), or with --backward one
forward + backward step of the op (gradients for q, k, v, g, beta and h0 from a bf16 output
gradient and an fp32 final-state gradient, as benchmarks/backward_bench.py steps), after a warm-up
call that builds and loads the kernels outside the profiled range (cudaProfilerStart/Stop bracket
the calls; ncu runs with --profile-from-start off).

    python -P tools/ncu_target.py [--backward] [H/V:SEQLENS ...]   (under ncu; alone it just runs the calls)

Cases default to CASES below (BACKWARD_CASES with --backward); e.g. 16/16:1024x8 2/8:1024x8
profiles the short-sequence rows.
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
# The backward's one-layer row (docs/results/backward-bench-graph.md).
BACKWARD_CASES = [Case(16, 32, (32768,))]


def cases_from(args: list[str], default: list[Case] = CASES) -> list[Case]:
    """H/V:SEQLENS arguments (scoreboard spellings) as cases; none: default."""
    if not args:
        return default
    cases = []
    for arg in args:
        heads, _, seqlens = arg.partition(":")
        cases.append(Case(*parse_heads(heads), parse_seqlens(seqlens)))
    return cases


def backward_step(case: Case):
    """A function that runs one forward + backward step of the op on fresh inputs of case."""
    from flashqla_tune.ops import chunk_gated_delta_rule

    x = make_rotation(case, 1, "cuda")[0]
    leaves = (x.q, x.k, x.v, x.g, x.beta, x.initial_state)
    for t in leaves:
        t.requires_grad_(True)
    do = torch.randn_like(x.v)
    dht = torch.randn_like(x.initial_state)

    def run():
        for t in leaves:
            t.grad = None
        o, final = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.initial_state,
                                          output_final_state=True, cu_seqlens=x.cu_seqlens_long,
                                          cu_seqlens_cpu=x.cu_seqlens_cpu)
        torch.autograd.backward([o, final], [do, dht])
    return run


def main_backward(args: list[str]) -> None:
    calls = []
    for case in cases_from(args, BACKWARD_CASES):
        run = backward_step(case)
        run()   # build, load, first launch
        calls.append((case, run))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for case, run in calls:
        torch.cuda.nvtx.range_push(f"backward {case.heads} {case.seqlens_label}")
        run()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled (forward + backward):", ", ".join(f"{c.heads} {c.seqlens_label}" for c, _ in calls))


def main(args: list[str]) -> None:
    if args[:1] == ["--backward"]:
        return main_backward(args[1:])
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
