"""Diagnostic (device): context parallelism against the float64 oracle, one path at a time, to
localise a failure of the CP GPU tests in about a minute. Each line is one (path, state layout,
initial state) on a short 2/8 row that the default segment table still splits:
  windows       strong decay, one-chunk windows: every boundary warms up
  exact         warmup all -1: H, M and the fp32 chain at every boundary
  guard         zero decay, two-chunk windows claimed: the guard must send every boundary to
                the exact path
Errors are rel. L2 of o and the final state against the oracle, then the worst v-head's state
error, and the no-CP errors on the same inputs for comparison.

    python -P scripts/diag_cp.py OUT_DIR
"""
from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "tests")
from gdn_inputs import rel_l2  # noqa: E402
from test_gpu_forward import make_case, reference, run_ours  # noqa: E402

from flashqla_tune import ops, runtime, warmup  # noqa: E402
from flashqla_tune.cache import get_kernels  # noqa: E402

PATHS = {  # name: (decay, warmup table)
    "windows": ("strong", [1] * 8),
    "exact": ("mixed", [-1] * 8),
    "guard": ("zero", [2] * 8),
}
SEQLENS = [4096 + 37, 1000]


def main(out_dir: str) -> int:
    get_kernels([runtime.default_plan_for(ops._spec(2, 8, 128, 128, True, vk)) for vk in (False, True)])
    rows = []
    for name, (decay, table) in PATHS.items():
        for vk in (False, True):
            for h0 in (True, False):
                inp = make_case(31, SEQLENS, 2, 8, torch.bfloat16, decay, h0, vk)
                plan = runtime.default_plan_for(ops.call_spec(inp["q"], inp["v"], vk))
                lengths = warmup.segment_lengths(tuple(table), plan, torch.cuda.get_device_properties(0).multi_processor_count)
                with torch.no_grad():
                    o, s = run_ours(inp, False, warmup=table)
                    o_ex, s_ex = run_ours(inp, False)
                torch.cuda.synchronize()
                ref_o, ref_s = reference(inp, False)
                per_head = [rel_l2(s[:, h], ref_s[:, h]) for h in range(8)]
                row = dict(path=name, state_v_first=vk, h0=h0, o=rel_l2(o, ref_o), state=rel_l2(s, ref_s),
                           worst_head=int(max(range(8), key=lambda h: per_head[h])), worst_head_state=max(per_head),
                           no_cp_o=rel_l2(o_ex, ref_o), no_cp_state=rel_l2(s_ex, ref_s),
                           nan=bool(torch.isnan(o).any() or torch.isnan(s).any()),
                           segment_chunks=lengths[:8])
                rows.append(row)
                print(f"{name:8s} vk={vk!s:5s} h0={h0!s:5s} o={row['o']:.2e} state={row['state']:.2e} "
                      f"worst head {row['worst_head']} {row['worst_head_state']:.2e} | no-CP o={row['no_cp_o']:.2e} "
                      f"state={row['no_cp_state']:.2e} nan={row['nan']}", flush=True)
    with open(f"{out_dir}/diag_cp.json", "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
