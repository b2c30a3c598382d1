"""Context parallelism on the H200: graph-replay time of our forward per forced segment length
(every bucket of the segment table = L) for exact chaining (warmup all -1) and the protocol's
calibrated warm-up, beside no CP and the cost model's own table; plus the per-kernel split of
the cost model's choice (torch.profiler, serialised). The data the CP cost model is fitted to
(flashqla_tune/cp_cost_model.py's Machine, refitted by tools/fit_cp_model.py). Writes
OUT_DIR/cp_profile.json and prints each row as it finishes.

    python -P tools/cp_profile.py OUT_DIR [--heads 8/32 ... --seqlens 1x16384 ...]    (repository root)

With --heads and --seqlens, every (heads, seqlens) pair replaces the default rows (e.g. the lone
12288- and 16384-token rows that decide whether 8/24 and 8/32 split bucket 256).
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from flashqla_tune import runtime, warmup_tables
from flashqla_tune.measure.cases import Case, parse_seqlens
from flashqla_tune.measure.inputs import make_rotation, protocol_warmup_table
from flashqla_tune.measure.timing import CudaTimer, kernel_ms_per_call
from flashqla_tune.segment_policy import SEGMENT_BUCKETS
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec

ROWS = [Case(2, 8, (32768,)), Case(2, 8, (8192,)), Case(2, 8, (2048,)), Case(2, 8, (1024,) * 8),
        Case(2, 8, (8192,) * 4), Case(4, 16, (32768,)), Case(16, 16, (32768,))]
LENGTHS = (8, 16, 32, 64, 128)
REPEATS = 5


def call_of(plan, warmup, lengths):
    def call(x):
        return runtime.forward(plan, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens_long, x.initial_state, x.scale,
                               True, False, warmup=warmup, segment_lengths=lengths)
    return call


def kernel_ms(call, x) -> dict:
    per_kernel = kernel_ms_per_call(lambda: call(x), REPEATS, lambda kernel: kernel[:48])
    return {k: round(v, 4) for k, v in per_kernel.items()}


def row(case: Case, timer: CudaTimer) -> dict:
    plan = default_plan(GDNSpec(case.num_qk_heads, case.num_v_heads))
    sets = make_rotation(case, 2, "cuda")
    hv = case.num_v_heads
    tables = {"exact": (-1,) * hv, "warm": protocol_warmup_table(hv)}
    longest = max(case.seqlens) // 64
    variants = [("none", None, None)]
    for kind, table in tables.items():
        variants.append((f"{kind}@model", table, None))
        variants += [(f"{kind}@L{length}", table, (length,) * SEGMENT_BUCKETS) for length in LENGTHS if length < longest]
    graph_ms = {}
    with torch.no_grad():
        for label, table, lengths in variants:
            call = call_of(plan, table, lengths)
            timer.warmup(call, sets, rounds=1)
            t = timer.graph(call, sets)
            graph_ms[label] = round(t.median_ms, 4) if t.error is None else t.error
    model = {kind: warmup_tables.segment_lengths(table, plan, warmup_tables.sm_count(sets[0].q.device))
             for kind, table in tables.items()}
    kernels = {kind: kernel_ms(call_of(plan, table, None), sets[0]) for kind, table in tables.items()}
    return {"heads": case.heads, "seqlens": case.seqlens_label, "warm_table": tables["warm"],
            "model_lengths": {k: v[:16] for k, v in model.items()}, "graph_ms": graph_ms, "model_kernels_ms": kernels}


def cases_of(heads: list[str] | None, seqlens: list[str] | None) -> list[Case]:
    """The default ROWS, or every pair of --heads H_qk/H_v and --seqlens (both needed)."""
    if not heads and not seqlens:
        return ROWS
    if not heads or not seqlens:
        raise SystemExit("give both --heads and --seqlens (every pair is a row), or neither")
    cases = []
    for h in heads:
        try:
            hqk, hv = (int(x) for x in h.split("/"))
        except ValueError:
            raise SystemExit(f"--heads {h!r}: use H_qk/H_v, e.g. 8/32") from None
        cases += [Case(hqk, hv, parse_seqlens(s)) for s in seqlens]
    return cases


def main(out_dir: str, cases: list[Case]) -> int:
    timer = CudaTimer(budget_s=0.1)
    plans = {default_plan(GDNSpec(c.num_qk_heads, c.num_v_heads)) for c in cases}
    with ThreadPoolExecutor(len(plans)) as pool:  # nvcc runs in subprocesses: build every plan at once
        list(pool.map(runtime.library, plans))
    rows = []
    for case in cases:
        rows.append(row(case, timer))
        print(json.dumps(rows[-1]), flush=True)
        with open(f"{out_dir}/cp_profile.json", "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=".")
    parser.add_argument("--heads", action="append", help="H_qk/H_v (with --seqlens: every pair is a row)")
    parser.add_argument("--seqlens", action="append", help="a length mix, e.g. 1x16384 or 12288+4096")
    args = parser.parse_args()
    sys.exit(main(args.out_dir, cases_of(args.heads, args.seqlens)))
