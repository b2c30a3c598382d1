"""Where a step of the exact chain (csrc/gdn_cp.cuh cp_chain_kernel) spends its time, on the H200:
a measurement build (FQT_CHAIN_CLOCKS=1) whose working chain CTAs of column slice 0 print the SM
cycles of each step's stages (issuing the next step's M fill and H loads, waiting for this step's
M, reading the start state, the barrier, the product, the stores and barrier). One eager call per
row after a warm-up call, on the calibrated column's table; the product's results are unchanged
(the build only adds clock reads and prints).

    python -P scripts/chain_clocks.py          (scripts/h200_next_session.sh chain-clocks)

CHAIN_CLOCK_FLAGS="-DNAME=VALUE ..." adds nvcc flags to the measurement build (a variant's
switches, e.g. -DFQT_CHAIN_PARTIALS=1).
"""
from __future__ import annotations

import os
import sys

import torch

from flashqla_tune import runtime
from flashqla_tune.bench.cases import Case, parse_seqlens
from flashqla_tune.bench.inputs import make_rotation, protocol_warmup_table
from flashqla_tune.bench.variants import build_variants, running
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec

ROWS = [((16, 16), "1x8192"), ((16, 16), "1x32768"), ((2, 8), "1x32768")]


def main() -> int:
    heads = sorted({h for h, _ in ROWS})
    plans = {h: default_plan(GDNSpec(*h)) for h in heads}
    extra = tuple(os.environ.get("CHAIN_CLOCK_FLAGS", "").split())
    entries = build_variants(list(plans.values()), {"clocks": ("-DNDEBUG", "-DFQT_CHAIN_CLOCKS=1", *extra)})["clocks"]
    by_heads = dict(zip(plans, entries))
    for (hqk, hv), label in ROWS:
        plan, table = plans[(hqk, hv)], protocol_warmup_table(hv)
        x = make_rotation(Case(hqk, hv, parse_seqlens(label)), 1, "cuda")[0]
        with running(by_heads[(hqk, hv)], plan), torch.no_grad():
            def call():
                return runtime.forward(plan, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens_long, x.initial_state, x.scale,
                                       True, False, warmup=table)
            # the device's printf output reaches stdout at the synchronize after each call
            for which in ("first call (loads the library)", "second call"):
                print(f"== {hqk}/{hv} {label}, {which} (SM clock {torch.cuda.clock_rate()} MHz per nvidia-smi)",
                      flush=True)
                call()
                torch.cuda.synchronize()
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
