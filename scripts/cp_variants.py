"""Build variants of the context-parallel launch side by side on the H200: each variant's forward
with CP against the float64 oracle (and bit for bit against the first variant), then the
graph-replay time of the calibrated column's call (the protocol's warm-up table, the cost model's
segment lengths) on the rows CP splits, and the chain's and the jobs kernel's GPU time on a few.
A variant is a set of extra nvcc flags (a measurement switch in csrc/gdn_fwd_host.cuh); "product"
is what the defaults build.

    python -P scripts/cp_variants.py OUT_DIR     (scripts/h200_next_session.sh cp-variants)
"""
from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "tests")
from test_gpu_forward import make_case, reference, run_ours  # noqa: E402

from flashqla_tune import runtime  # noqa: E402
from flashqla_tune.bench.cases import Case, parse_seqlens  # noqa: E402
from flashqla_tune.bench.inputs import make_rotation, protocol_warmup_table  # noqa: E402
from flashqla_tune.bench.timing import CudaTimer, kernel_ms_per_call  # noqa: E402
from flashqla_tune.bench.variants import build_variants, check_fields, running  # noqa: E402
from flashqla_tune.plan import default_plan  # noqa: E402
from flashqla_tune.spec import GDNSpec  # noqa: E402

# name: extra nvcc flags (csrc/gdn_fwd_host.cuh: FQT_FWD_JOB_ORDER=0 runs the forward pass's
# unchained jobs in segment order instead of unsplit sequences first; FQT_CHAIN_COLUMNS=4|8|16
# forces the chain's column width; FQT_JOBS_BESIDE_PREP=0 launches the jobs kernel after the prep
# in plain stream order). The fifteenth session measured each, and the CP passes on the two-per-SM
# kernel (a switch since deleted): docs/kernel-notes.md has the results.
VARIANTS = {"product": (), "segment_order": ("-DFQT_FWD_JOB_ORDER=0",), "columns16": ("-DFQT_CHAIN_COLUMNS=16",)}
HEADS = [(16, 16), (2, 8), (8, 32)]
# (heads index, seqlens, decay, warm-up table, forced segment length): exact and warm-up heads, a
# guard that fails (weak decay), varlen with a tail off a multiple of 64
CHECKS = [(0, [8192 + 17, 300], "mixed", [-1, 4, 5, -1] * 4, 16),
          (1, [8192 + 100], "weak", [2] * 8, 8),
          (1, [6000, 17, 3000], "strong", [-1, 3, -1, 3, 5, 5, 5, -1], 8),
          (2, [4096 + 33], "mixed", [-1, 4] * 16, 8)]
TIMED = {(16, 16): ["12288+4096", "28672+4096", "4096+28672", "1024+7168", "1x8192"],
         (2, 8): ["12288+4096", "28672+4096", "1024+7168", "1x32768"],
         (8, 32): ["12288+4096", "28672+4096"]}
SPLIT_ROWS = [((2, 8), "12288+4096")]


def cp_call(plan, table):
    def call(x):
        return runtime.forward(plan, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens_long, x.initial_state, x.scale,
                               True, False, warmup=table)
    return call


def main(out_dir: str) -> int:
    plans = [default_plan(GDNSpec(hqk, hv)) for hqk, hv in HEADS]
    entries = build_variants(plans, {name: ("-DNDEBUG",) + flags for name, flags in VARIANTS.items()})
    result = {"gpu": torch.cuda.get_device_name(), "variants": VARIANTS, "checks": [], "graph_ms": [], "kernel_us": []}
    first = {}
    for c, (index, seqlens, decay, table, length) in enumerate(CHECKS):
        hqk, hv = HEADS[index]
        inp = make_case(31 + c, seqlens, hqk, hv, torch.bfloat16, decay, True, False)
        ref_o, ref_s = reference(inp, False)
        for name in VARIANTS:
            with running(entries[name][index], plans[index]), torch.no_grad():
                o, s = run_ours(inp, False, plan=plans[index], warmup=table, segment_lengths=(length,) * 32)
                torch.cuda.synchronize()
            same = first.setdefault(c, (o, s))
            row = {"variant": name, "heads": f"{hqk}/{hv}", "seqlens": seqlens, "decay": decay, "warmup": table,
                   "length": length, **check_fields(o, s, ref_o, ref_s, same)}
            result["checks"].append(row)
            print(json.dumps(row), flush=True)
    timer = CudaTimer(budget_s=0.1)
    for index, (hqk, hv) in enumerate(HEADS):
        table = protocol_warmup_table(hv)
        for label in TIMED[(hqk, hv)]:
            sets = make_rotation(Case(hqk, hv, parse_seqlens(label)), 2, "cuda")
            times = {}
            for name in VARIANTS:
                with running(entries[name][index], plans[index]), torch.no_grad():
                    call = cp_call(plans[index], table)
                    timer.warmup(call, sets, rounds=1)
                    t = timer.graph(call, sets)
                    times[name] = round(t.median_ms, 4) if t.error is None else t.error
                    if ((hqk, hv), label) in SPLIT_ROWS:
                        per = kernel_ms_per_call(lambda: call(sets[0]), 5,
                                                 lambda k: "chain" if "chain" in k else "jobs" if "jobs" in k else "other")
                        result["kernel_us"].append({"heads": f"{hqk}/{hv}", "seqlens": label, "variant": name,
                                                    **{k: round(1000 * v, 1) for k, v in per.items()}})
                        print(json.dumps(result["kernel_us"][-1]), flush=True)
            row = {"heads": f"{hqk}/{hv}", "seqlens": label, "graph_ms": times}
            result["graph_ms"].append(row)
            print(json.dumps(row), flush=True)
            with open(f"{out_dir}/cp_variants.json", "w") as f:
                json.dump(result, f, indent=1)
    worst = max(max(r["o"], r["state"]) for r in result["checks"])
    print(f"worst rel L2 over variants and checks {worst:.2e}; any NaN {any(r['nan'] for r in result['checks'])}; "
          f"all bitwise as the first {all(r['bitwise_as_first'] for r in result['checks'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
