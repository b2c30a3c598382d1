"""Tile sweep on the H200: each KernelPlan variant is checked against the float64 oracle on fresh
inputs (a wrong variant is reported, never timed), then timed by CUDA-graph replay with rotated
inputs on a few scoreboard rows. The default plan is the baseline. This is the manual precursor
of `flashqla-tune tune`; results go to the kernel notes.

    python -P scripts/tile_sweep.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
import time

import torch

from flashqla_tune import cache, runtime
from flashqla_tune.bench.cases import Case
from flashqla_tune.bench.inputs import make_rotation
from flashqla_tune.bench.timing import CudaTimer, rotation_count
from flashqla_tune.oracle import chunk_gated_delta_rule_chunked
from flashqla_tune.plan import KernelPlan, TileParams, default_plan
from flashqla_tune.spec import GDNSpec

VARIANTS = [TileParams(), TileParams(block_v=32), TileParams(block_v=32, stages=3), TileParams(stages=3),
            TileParams(stages=1, producer_regs=24, ctas_per_sm=2),
            TileParams(block_v=32, stages=1, producer_regs=24, ctas_per_sm=2)]
ROWS = [Case(2, 8, (32768,)), Case(2, 8, (8192,)), Case(2, 8, (1024,) * 8),
        Case(16, 64, (8192,)), Case(16, 64, (8192,) * 4), Case(8, 32, (32768,))]


def call(plan, x):
    return runtime.forward(plan, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens_long, x.initial_state, x.scale, True, False)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main(out_dir: str) -> int:
    specs = sorted({(c.num_qk_heads, c.num_v_heads) for c in ROWS})
    plans = {(h, v, t): KernelPlan(default_plan(GDNSpec(h, v)).spec, t) for h, v in specs for t in VARIANTS}
    t0 = time.time()
    cache.get_kernels(list(plans.values()))
    print(f"built {len(plans)} plans in {time.time() - t0:.1f} s", flush=True)
    # correctness first: 2 varlen sequences with a tail, vs the float64 chunked oracle
    verdict = {}
    for (h, v, t), plan in plans.items():
        x = make_rotation(Case(h, v, (700, 1100)), 1, "cuda", seed=int(time.time()) % 1000)[0]
        with torch.no_grad():
            o, s = call(plan, x)
        ref_o, ref_s = chunk_gated_delta_rule_chunked(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state,
                                                      output_final_state=True, cu_seqlens=x.cu_seqlens_long)
        err = (rel(o, ref_o), rel(s, ref_s))
        verdict[plan.name] = err
        print(f"check {plan.name}: o {err[0]:.2e} state {err[1]:.2e}", flush=True)
    timer = CudaTimer(budget_s=0.3)
    rows = []
    for case in ROWS:
        sets = make_rotation(case, rotation_count(make_rotation(case, 1, "cuda")[0].nbytes(), 60 << 20, 8 << 30), "cuda")
        line = {"heads": case.heads, "seqlens": case.seqlens_label}
        for t in VARIANTS:
            plan = plans[(case.num_qk_heads, case.num_v_heads, t)]
            if max(verdict[plan.name]) > 1e-2:
                line[plan.name] = None
                continue
            with torch.no_grad():
                timer.warmup(lambda x: call(plan, x), sets, rounds=1)
                line[plan.name.split("__")[1]] = timer.graph(lambda x: call(plan, x), sets).median_ms
        rows.append(line)
        print(json.dumps(line), flush=True)
    with open(f"{out_dir}/tile_sweep.json", "w") as f:
        json.dump({"checks": verdict, "rows": rows, "gpu": torch.cuda.get_device_name()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
