"""Build variants of the context-parallel launch side by side on the H200: each variant's forward
with CP against the float64 oracle (and bit for bit against the first variant), then the
graph-replay time of the calibrated column's call (the protocol's warm-up table, the cost model's
segment lengths) on the rows CP splits, and the GPU time per kernel (prep, jobs, state pass, chain,
forward pass) on a few.
A variant is a set of extra nvcc flags (measurement switches in csrc/gdn_fwd_host.cuh and
csrc/gdn_cp.cuh); "product" is what the defaults build. With FQT_BASE_CSRC=DIR (a copy of an
older commit's csrc/, carried to the device), "base" is that tree built with the defaults: a
change that has no switch timed beside the tree before it.

    python -P scripts/cp_variants.py OUT_DIR [--tables]     (scripts/h200_next_session.sh cp-variants-x2)

--tables also times the product with the protocol's table, every head warmed up and every head
exact: what the exact heads cost a call.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, "tests")
from test_gpu_forward import make_case, reference, run_ours  # noqa: E402

from flashqla_tune import runtime  # noqa: E402
from flashqla_tune.build import BuildConfig  # noqa: E402
from flashqla_tune.bench.cases import Case, parse_seqlens  # noqa: E402
from flashqla_tune.bench.inputs import make_rotation, protocol_warmup_table  # noqa: E402
from flashqla_tune.bench.timing import CudaTimer, kernel_ms_per_call  # noqa: E402
from flashqla_tune.bench.variants import build_variants, check_fields, running  # noqa: E402
from flashqla_tune.plan import default_plan  # noqa: E402
from flashqla_tune.spec import GDNSpec  # noqa: E402

# name: extra nvcc flags (measurement switches in csrc/gdn_cp.cuh and csrc/gdn_fwd_host.cuh:
# FQT_CHAIN_PARTIALS=1 sums each chain output in one running sum instead of four;
# FQT_CHAIN_FAST_EXIT=0 lets a chain CTA find its first exact boundary by walking the boundaries
# one load after another; FQT_CHAIN_EARLY_TRIGGER=0 launches the forward pass only once the chain
# has finished; FQT_CHAIN_SKIP=1 leaves the chain's work out, so its results are wrong by design:
# the call's time without the chain). Earlier sessions measured the chain's column widths, the
# jobs kernel's place, the forward pass's job order and the CP passes on the two-per-SM kernel;
# the sixteenth, an exact boundary's H and M in two parts (docs/pending/cp-exact-parts.patch), the
# state pass and chain as programmatic dependents; the seventeenth, the chain's M by one bulk copy
# (kept); the eighteenth, each boundary's H stored v-major for coalesced chain loads (lost, 1.009x
# the product's time): docs/kernel-notes.md has the results.
VARIANTS = {"product": ()}
WRONG_BY_DESIGN: set[str] = set()  # variants timed only (FQT_CHAIN_SKIP): left out of the oracle summary
HEADS = [(16, 16), (2, 8), (8, 32), (8, 24)]
# (heads index, seqlens, decay, warm-up table, forced segment length): exact and warm-up heads, a
# guard that fails (weak decay), varlen with a tail off a multiple of 64
CHECKS = [(0, [8192 + 17, 300], "mixed", [-1, 4, 5, -1] * 4, 16),
          (1, [8192 + 100], "weak", [2] * 8, 8),
          (1, [6000, 17, 3000], "strong", [-1, 3, -1, 3, 5, 5, 5, -1], 8),
          (2, [4096 + 33], "mixed", [-1, 4] * 16, 8)]
TIMED = {(16, 16): ["1x8192", "1x32768", "12288+4096", "28672+4096", "16384+16384", "1024+7168", "8192x4"],
         (2, 8): ["1x8192", "1x32768", "12288+4096", "28672+4096", "16384+16384", "8192x4"],
         (8, 32): ["1x32768", "28672+4096", "16384+16384", "12288+4096"],
         (8, 24): ["1x32768", "16384+16384", "12288+4096"]}
SPLIT_ROWS = [((16, 16), "1x8192"), ((2, 8), "1x32768")]


def kernel_kind(name: str) -> str:
    """A CP call's kernels by role (the state pass is gdn_fwd_kernel's StateOnly = true copy)."""
    for part in ("prep", "jobs", "segments", "chain"):
        if f"cp_{part}_kernel" in name or f"gdn_{part}_kernel" in name:
            return part
    if "gdn_fwd_kernel" in name:
        return "state" if ", true>" in name else "forward"
    return "other"


def cp_call(plan, table):
    def call(x):
        return runtime.forward(plan, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens_long, x.initial_state, x.scale,
                               True, False, warmup=table)
    return call


def main(out_dir: str, tables: bool = False) -> int:
    plans = [default_plan(GDNSpec(hqk, hv)) for hqk, hv in HEADS]
    variants = dict(VARIANTS)  # what this run builds: VARIANTS, and "base" with FQT_BASE_CSRC
    builds = {name: ("-DNDEBUG",) + flags for name, flags in variants.items()}
    base_csrc = os.environ.get("FQT_BASE_CSRC")
    if base_csrc:
        variants["base"] = (f"csrc={base_csrc}",)
        builds["base"] = BuildConfig(csrc=base_csrc, extra_flags=("-DNDEBUG",))
    entries = build_variants(plans, builds)
    result = {"gpu": torch.cuda.get_device_name(), "variants": variants, "checks": [], "graph_ms": [], "kernel_us": []}
    first = {}
    for c, (index, seqlens, decay, table, length) in enumerate(CHECKS):
        hqk, hv = HEADS[index]
        inp = make_case(31 + c, seqlens, hqk, hv, torch.bfloat16, decay, True, False)
        ref_o, ref_s = reference(inp, False)
        for name in variants:
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
            for name in variants:
                with running(entries[name][index], plans[index]), torch.no_grad():
                    call = cp_call(plans[index], table)
                    timer.warmup(call, sets, rounds=1)
                    t = timer.graph(call, sets)
                    times[name] = round(t.median_ms, 4) if t.error is None else t.error
                    if ((hqk, hv), label) in SPLIT_ROWS:
                        per = kernel_ms_per_call(lambda: call(sets[0]), 5, kernel_kind)
                        result["kernel_us"].append({"heads": f"{hqk}/{hv}", "seqlens": label, "variant": name,
                                                    **{k: round(1000 * v, 1) for k, v in per.items()}})
                        print(json.dumps(result["kernel_us"][-1]), flush=True)
            row = {"heads": f"{hqk}/{hv}", "seqlens": label, "graph_ms": times}
            result["graph_ms"].append(row)
            print(json.dumps(row), flush=True)
            with open(f"{out_dir}/cp_variants.json", "w") as f:
                json.dump(result, f, indent=1)
    # What the exact heads cost a call: the product with the protocol's table, beside every head
    # warmed up (the exact heads' gates replaced by a warm-up head's, so the guard passes, and
    # their window the table's longest; other inputs than the row's: a time, not a result) and
    # every head exact.
    result["tables_ms"] = []
    for index, (hqk, hv) in enumerate(HEADS if tables else []):
        table = protocol_warmup_table(hv)
        warm_head = next(h for h, n in enumerate(table) if n > 0)
        by_table = {"protocol": table, "all_warm": tuple(max(table) if n < 0 else n for n in table),
                    "all_exact": (-1,) * hv}
        for label in TIMED[(hqk, hv)]:
            sets = make_rotation(Case(hqk, hv, parse_seqlens(label)), 2, "cuda")
            decaying = []
            for x in sets:
                g = x.g.clone()
                g[..., [h for h, n in enumerate(table) if n < 0]] = g[..., warm_head:warm_head + 1]
                decaying.append(dataclasses.replace(x, g=g))
            times = {}
            for name, t_table in by_table.items():
                with running(entries["product"][index], plans[index]), torch.no_grad():
                    call = cp_call(plans[index], t_table)
                    t_sets = decaying if name == "all_warm" else sets
                    timer.warmup(call, t_sets, rounds=1)
                    t = timer.graph(call, t_sets)
                    times[name] = round(t.median_ms, 4) if t.error is None else t.error
            row = {"heads": f"{hqk}/{hv}", "seqlens": label, "tables_ms": times}
            result["tables_ms"].append(row)
            print(json.dumps(row), flush=True)
    with open(f"{out_dir}/cp_variants.json", "w") as f:
        json.dump(result, f, indent=1)
    kept = [r for r in result["checks"] if r["variant"] not in WRONG_BY_DESIGN]
    worst = max(max(r["o"], r["state"]) for r in kept)
    print(f"worst rel L2 over variants and checks {worst:.2e}; any NaN {any(r['nan'] for r in kept)}; "
          f"all bitwise as the first {all(r['bitwise_as_first'] for r in kept)} "
          f"(left out, wrong by design: {sorted(WRONG_BY_DESIGN)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], tables="--tables" in sys.argv[2:]))
