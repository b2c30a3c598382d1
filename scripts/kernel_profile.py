"""Per-kernel time of our forward on the H200 (torch.profiler / CUPTI): how the time of a call
splits between the chunk-prep kernel and the sequential TMA + wgmma kernel, per scoreboard row.
Tells the next optimisation where the time goes (docs/kernel-notes.md).

    python -P scripts/kernel_profile.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from flashqla_tune.bench.cases import Case
from flashqla_tune.bench.inputs import make_rotation
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec
from flashqla_tune.tune.measure import forward_on_inputs

ROWS = [Case(2, 8, (32768,)), Case(2, 8, (2048,)), Case(16, 64, (32768,)), Case(16, 64, (1024,) * 8),
        Case(8, 32, (8192,) * 4)]
REPEATS = 5


def kernel_times(case: Case) -> dict:
    plan = default_plan(GDNSpec(case.num_qk_heads, case.num_v_heads))
    x = make_rotation(case, 1, "cuda")[0]

    def call():
        return forward_on_inputs(plan, x)

    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPEATS):
                call()
            torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            name = "prep" if "gdn_prep_kernel" in evt.name else "sequential" if "gdn_fwd_kernel" in evt.name else evt.name[:40]
            per_kernel[name] += evt.device_time_total / 1e3 / REPEATS  # ms per call
    return {"heads": case.heads, "seqlens": case.seqlens_label, "ms": dict(per_kernel)}


def main(out_dir: str) -> int:
    rows = [kernel_times(c) for c in ROWS]
    for r in rows:
        print(json.dumps(r), flush=True)
    with open(f"{out_dir}/kernel_profile.json", "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
