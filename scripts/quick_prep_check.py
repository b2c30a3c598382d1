"""A quick device check of a prep change for one v-head per q/k head (G = 1), for a call with little
device time left: the default plans of 16/16 and 4/4 against the float64 oracle (mixed, strong
and zero decay, a tail that is not a multiple of 64, varlen, initial state, in-kernel L2 norm),
then the prep kernel's time on 16/16 1x32768 and 1x8192 (serial schedule, torch.profiler).
The GPU tests (scripts/h200_next_session.sh tests) remain the full check.

    python -P scripts/quick_prep_check.py OUT_DIR
"""
from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "tests")
from gdn_inputs import rel_l2  # noqa: E402
from test_gpu_forward import make_case, reference, run_ours  # noqa: E402

from flashqla_tune.bench.cases import Case  # noqa: E402
from flashqla_tune.bench.inputs import make_rotation  # noqa: E402
from flashqla_tune.bench.timing import kernel_ms_per_call  # noqa: E402
from flashqla_tune.cache import get_kernels  # noqa: E402
from flashqla_tune.plan import default_plan  # noqa: E402
from flashqla_tune.spec import GDNSpec  # noqa: E402
from flashqla_tune.tune.measure import forward_on_inputs  # noqa: E402

CHECKS = [(16, 16, [5000], "mixed", False), (4, 4, [777, 1500, 63], "strong", False),
          (16, 16, [1000, 37], "zero", False), (4, 4, [2100], "weak", True)]
TIMED = [Case(16, 16, (32768,)), Case(16, 16, (8192,))]


def main(out_dir: str) -> int:
    get_kernels([default_plan(GDNSpec(h, v)) for h, v in {(c[0], c[1]) for c in CHECKS}])
    result = {"gpu": torch.cuda.get_device_name(), "checks": [], "prep_ms": {}}
    worst = 0.0
    for hqk, hv, seqlens, decay, l2norm in CHECKS:
        inp = make_case(11, seqlens, hqk, hv, torch.bfloat16, decay, True, False, normalised=not l2norm)
        ref_o, ref_s = reference(inp, l2norm)
        with torch.no_grad():
            o, s = run_ours(inp, l2norm)
        torch.cuda.synchronize()
        row = {"heads": f"{hqk}/{hv}", "seqlens": seqlens, "decay": decay, "l2norm": l2norm,
               "o": float(rel_l2(o, ref_o)), "state": float(rel_l2(s, ref_s)), "nan": bool(torch.isnan(o).any())}
        worst = max(worst, row["o"], row["state"])
        result["checks"].append(row)
        print(json.dumps(row), flush=True)
    for case in TIMED:
        plan = default_plan(GDNSpec(case.num_qk_heads, case.num_v_heads))
        x = make_rotation(case, 1, "cuda")[0]
        ms = kernel_ms_per_call(lambda: forward_on_inputs(plan, x, prep_schedule="serial"), 5,
                                lambda k: "prep" if "gdn_prep_kernel" in k else "sequential")
        result["prep_ms"][f"{case.heads} {case.seqlens_label}"] = {k: round(v, 4) for k, v in ms.items()}
        print(case.heads, case.seqlens_label, result["prep_ms"][f"{case.heads} {case.seqlens_label}"], flush=True)
    with open(f"{out_dir}/quick_prep_check.json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"worst rel L2 {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
