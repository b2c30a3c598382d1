"""The prep kernel's build variants side by side on the H200: each variant's forward against the
float64 oracle, then its prep kernel's time (torch.profiler, serial schedule) on the rows the prep
matters most. A variant is a set of extra nvcc flags (a measurement switch in csrc/gdn_prep.cuh,
written for the comparison and deleted with the losing code afterwards; docs/kernel-notes.md keeps
the results); "product" is what the defaults build. With no switch in the code it times and
checks the product alone.

    python -P scripts/prep_variants.py OUT_DIR     (scripts/h200_next_session.sh variants)
"""
from __future__ import annotations

import dataclasses
import json
import sys

import torch

sys.path.insert(0, "tests")
from test_gpu_forward import make_case, reference, run_ours  # noqa: E402

from flashqla_tune.bench.cases import Case  # noqa: E402
from flashqla_tune.bench.inputs import make_rotation  # noqa: E402
from flashqla_tune.bench.variants import build_variants, check_fields, prep_ms, running  # noqa: E402
from flashqla_tune.plan import KernelPlan, default_plan  # noqa: E402
from flashqla_tune.spec import GDNSpec  # noqa: E402
from flashqla_tune.tune.measure import forward_on_inputs  # noqa: E402

# name: extra nvcc flags. FQT_PREP_WIDE_STORES (P's octets and the normalised q/k quartets by one
# 16- / 8-byte store each) and FQT_PREP_SEQ_CACHE (items decoded from a shared-memory copy of
# cu_seqlens) won together in the eighteenth session and are the product now, as are
# FQT_PREP_AW_SPLIT, FQT_PREP_QK_IN_Q and FQT_PREP_AW_ALL_HEADS (fourteenth session).
# FQT_PREP_AW_PAIRS (Aw by packed 4-byte column pairs, one shuffle per two elements) lost in the
# eighteenth session (1.05x the prep's time) and is gone.
# FQT_PREP_ITEM_SMEM (thread 0 decodes each next item once into shared memory for the others) and
# FQT_SOLVE_TF32_TRUNC (the tensor-core solve's 3xTF32 split by truncation instead of cvt.rna) won
# together in the nineteenth session (0.79-0.97x the prep's time, the oracle's error unchanged) and
# are the product now. A new switch goes in beside "product" as name: ("-DNAME=1",).
# FQT_PREP_TC_HEADS (the 256-thread prep of two to four v-heads per q/k head solves them at once on
# the tensor cores, each warp pair into an X tile of its own) won in the twentieth session (prep
# 0.83-0.89x on 2/8, 4/16 and 8/32) and is the product now.
VARIANTS: dict[str, tuple[str, ...]] = {"product": ()}
# (hqk, hv, prep_threads or None for the default plan's): one, four, two and three v-heads per
# q/k head on their default plans (128 threads but for four v-heads; fifteenth session), two and
# three at 256 threads (the tuner may pick them; they take the at-once solve too), and the other
# four-head plans. The 128- and 256-thread solves differ in bits, so the plan chooses, not the
# call's shape (batch invariance).
PLANS = [(16, 16, None), (2, 8, None), (16, 32, None), (8, 24, None),
         (16, 32, 256), (8, 24, 256), (4, 16, None), (8, 32, None)]
# (plan index, seqlens, decay, l2norm): tails that are not a multiple of 64, varlen, strong/weak/zero
CHECKS = [(0, [1000, 37], "mixed", True), (1, [777, 1500, 63], "strong", False), (2, [2100, 300], "zero", False),
          (3, [5000, 129], "weak", True),
          (1, [37] * 100 + [100] * 31, "mixed", True),  # more sequences than shared memory keeps
          (4, [777, 1500, 63], "strong", False), (5, [3000, 200], "weak", True), (7, [2100, 300], "zero", False),
          (6, [3000, 200], "mixed", True), (7, [5000, 129], "weak", True)]
TIMED = [(i, Case(hqk, hv, seqlens)) for i, (hqk, hv, _) in enumerate(PLANS)
         for seqlens in ((32768,), (8192,) * 4, (1024,) * 8)]


def plan_of(hqk: int, hv: int, threads: int | None) -> KernelPlan:
    plan = default_plan(GDNSpec(hqk, hv))
    return plan if threads is None else KernelPlan(plan.spec, dataclasses.replace(plan.tiles, prep_threads=threads))


def main(out_dir: str) -> int:
    plans = [plan_of(*p) for p in PLANS]
    entries = build_variants(plans, {name: ("-DNDEBUG",) + flags for name, flags in VARIANTS.items()})
    result = {"gpu": torch.cuda.get_device_name(), "variants": VARIANTS, "resources": {}, "checks": [], "prep_ms": []}
    for name in VARIANTS:
        result["resources"][name] = {plan.name: {k: v for k, v in e.resources.items() if "prep" in k}
                                     for plan, e in zip(plans, entries[name])}
    references = []
    for index, seqlens, decay, l2norm in CHECKS:
        spec = plans[index].spec
        inp = make_case(13, seqlens, spec.num_qk_heads, spec.num_v_heads, torch.bfloat16, decay, True, False,
                        normalised=not l2norm)
        references.append((inp, reference(inp, l2norm)))
    first = {}  # the first variant's outputs per check: a variant that only moves work between
    # threads must give the same bits
    for name in VARIANTS:
        for c, ((index, seqlens, decay, l2norm), (inp, (ref_o, ref_s))) in enumerate(zip(CHECKS, references)):
            with running(entries[name][index], plans[index]), torch.no_grad():
                o, s = run_ours(inp, l2norm, plan=plans[index])
                torch.cuda.synchronize()
            same = first.setdefault(c, (o, s))
            row = {"variant": name, "plan": plans[index].name, "seqlens": seqlens, "decay": decay, "l2norm": l2norm,
                   **check_fields(o, s, ref_o, ref_s, same)}
            result["checks"].append(row)
            print(json.dumps(row), flush=True)
    for index, case in TIMED:
        x = make_rotation(case, 1, "cuda")[0]
        times = {}
        for name in VARIANTS:
            with running(entries[name][index], plans[index]):
                times[name] = prep_ms(lambda: forward_on_inputs(plans[index], x, prep_schedule="serial"))
        row = {"plan": plans[index].name, "seqlens": case.seqlens_label, "prep_ms": times}
        result["prep_ms"].append(row)
        print(json.dumps(row), flush=True)
    with open(f"{out_dir}/prep_variants.json", "w") as f:
        json.dump(result, f, indent=1)
    for name in VARIANTS:  # a variant that changes arithmetic by design is judged by the oracle alone
        rows = [r for r in result["checks"] if r["variant"] == name]
        print(f"{name}: worst rel L2 {max(max(r['o'], r['state']) for r in rows):.2e}, "
              f"bitwise as the product {all(r['bitwise_as_first'] for r in rows)}")
    worst = max(max(r["o"], r["state"]) for r in result["checks"])
    print(f"worst rel L2 over variants and checks {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
