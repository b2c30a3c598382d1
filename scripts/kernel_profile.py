"""Where the time of our forward goes on the H200, per scoreboard row:
  - with the kernels serialised (prep, then sequential), each kernel's time (torch.profiler);
  - one call's graph-replay time with the prep and sequential kernels serialised, overlapped
    (when the sequential grid leaves an SM free), and as the op picks by default ("auto").
Tells the next optimisation where the time goes (docs/kernel-notes.md).

    python -P scripts/kernel_profile.py OUT_DIR
"""
from __future__ import annotations

import json
import sys

import torch

from flashqla_tune.bench.cases import Case
from flashqla_tune.bench.inputs import make_rotation
from flashqla_tune.bench.timing import CudaTimer, kernel_ms_per_call
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec
from flashqla_tune.tune.measure import forward_on_inputs

ROWS = [Case(2, 8, (32768,)), Case(2, 8, (8192,)), Case(2, 8, (2048,)), Case(2, 8, (8192,) * 4),
        Case(2, 8, (4096, 28672)), Case(4, 16, (32768,)), Case(16, 16, (32768,)), Case(16, 16, (8192,)),
        Case(16, 64, (32768,)), Case(16, 64, (1024,) * 8), Case(8, 32, (8192,) * 4)]
REPEATS = 5
SCHEDULES = ("serial", "overlap", "auto")


def serial_kernel_ms(plan, x) -> dict:
    def name_of(kernel: str) -> str:
        return "prep" if "gdn_prep_kernel" in kernel else "sequential" if "gdn_fwd_kernel" in kernel else kernel[:40]
    return kernel_ms_per_call(lambda: forward_on_inputs(plan, x, prep_schedule="serial"), REPEATS, name_of)


def row(case: Case, timer: CudaTimer) -> dict:
    plan = default_plan(GDNSpec(case.num_qk_heads, case.num_v_heads))
    sets = make_rotation(case, 4, "cuda")
    graph_ms = {}
    with torch.no_grad():
        for schedule in SCHEDULES:
            def call(x, schedule=schedule):
                return forward_on_inputs(plan, x, prep_schedule=schedule)
            timer.warmup(call, sets, rounds=1)
            t = timer.graph(call, sets)
            graph_ms[schedule] = t.median_ms if t.error is None else t.error
    return {"heads": case.heads, "seqlens": case.seqlens_label, "serial_kernels_ms": serial_kernel_ms(plan, sets[0]),
            "graph_ms": graph_ms}


def main(out_dir: str) -> int:
    timer = CudaTimer(budget_s=0.2)
    rows = []
    for case in ROWS:
        rows.append(row(case, timer))
        print(json.dumps(rows[-1]), flush=True)
    with open(f"{out_dir}/kernel_profile.json", "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
