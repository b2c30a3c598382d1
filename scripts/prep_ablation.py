"""Where the prep kernel's time goes, without hardware counters (../.library/device/H200.md):
build variants that leave one stage of each item out (csrc/gdn_prep.cuh, FQT_PREP_ABLATE) and
time the prep kernel of each (torch.profiler, prep then sequential kernel, serialised). A stage's
cost is the full kernel's time minus the time without it. The outputs of ablated variants are
wrong by construction; only their times are used.

    python -P scripts/prep_ablation.py OUT_DIR
"""
from __future__ import annotations

import json
import sys

import torch

from flashqla_tune.bench.cases import Case
from flashqla_tune.bench.inputs import make_rotation
from flashqla_tune.bench.variants import build_variants, prep_ms, running
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec
from flashqla_tune.tune.measure import forward_on_inputs

CASES = [Case(16, 16, (32768,)), Case(16, 16, (1024,) * 8), Case(16, 32, (32768,)), Case(8, 32, (8192,) * 4)]
# csrc/gdn_prep.cuh: 1 GEMMs, 2 solve, 4 Aw output, 8 P output, 16 the q tile (load and Q K^T).
# Leaving the Aw output out also drops the solve (its only reader), so the Aw output alone is
# stage(no_aw_out) - stage(no_solve). no_gemms changes register allocation (24 B of spills on
# 2/8), so its difference is approximate. no_q_p is the prep a sequential kernel that formed P
# itself would need (no q tile, no P): what moving P out of the prep can save at most. Since the
# 128-thread prep keeps Q K^T in the q tile (four CTAs per SM), no_q_p runs at three CTAs per SM
# there, and no_solve's column solve spills under the 128-register cap (172 B on 16/16): on
# 128-thread plans those two differences mix in an occupancy or spill change.
VARIANTS = {"full": 0, "no_solve": 2, "no_aw_out": 4, "no_p_out": 8, "no_q_p": 24, "walk_only": 31}
REPEATS = 5


def main(out_dir: str) -> int:
    plans = [default_plan(GDNSpec(c.num_qk_heads, c.num_v_heads)) for c in CASES]
    entries = build_variants(plans, {name: ("-DNDEBUG", f"-DFQT_PREP_ABLATE={bits}") for name, bits in VARIANTS.items()})
    rows = []
    for i, (case, plan) in enumerate(zip(CASES, plans)):
        x = make_rotation(case, 1, "cuda")[0]
        times = {}
        for name in VARIANTS:
            try:
                with running(entries[name][i], plan):  # this variant for the forward's launch
                    times[name] = prep_ms(lambda: forward_on_inputs(plan, x, prep_schedule="serial"), REPEATS)
            except Exception as exc:  # kept with the reason; the other variants still run
                times[name] = None
                print(f"{case.name} {name}: {type(exc).__name__}: {exc}", flush=True)
            print(f"{case.name} {name}: prep {times[name]} ms", flush=True)
        if times["full"] is None:
            rows.append({"case": case.name, "plan": plan.name, "prep_ms": times})
            continue
        items = -(-max(case.seqlens) // 64) * len(case.seqlens) * case.num_qk_heads
        stage = {name: round(times["full"] - t, 4) for name, t in times.items() if name != "full" and t is not None}
        if "no_aw_out" in stage and "no_solve" in stage:
            stage["aw_out_alone"] = round(stage["no_aw_out"] - stage["no_solve"], 4)
        rows.append({"case": case.name, "plan": plan.name, "items": items, "prep_ms": times,
                     "us_per_item_and_sm": round(times["full"] * 1e3 * torch.cuda.get_device_properties(0).multi_processor_count / items, 2),
                     "stage_ms": stage})
        print(json.dumps(rows[-1]), flush=True)
    with open(f"{out_dir}/prep_ablation.json", "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
