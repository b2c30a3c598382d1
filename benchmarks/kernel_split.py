"""GPU time per kernel of one forward call: ours (the calibrated column), FLA and FlashQLA on the
same protocol inputs, in one run (torch.profiler's CUDA activity, no hardware counters). It shows
which stage of which implementation wins on the rows where ours is slower than FlashQLA, e.g.
whether FlashQLA's WY/solve kernels take less time than our prep.

Each implementation gets 3 warm-up calls (JIT, autotuning, our plan's build), then CALLS profiled
eager calls on the same inputs (measure.timing.kernel_launches_and_ms_per_call); per kernel name:
launches per call and us per call. Kernel time only: launch gaps and host time are not in it.
Writes OUT_DIR/kernel_split.json and prints each row (the published per-kernel profile:
docs/results/kernel-split.json and .log).

    FLA_DISABLE_BACKEND_DISPATCH=1 python -P benchmarks/kernel_split.py OUT_DIR [--heads 16/16 ...]
        [--seqlens 8192x4 ...] [--impl flashqla_tune_single_chain ...]    (repository root;
        benchmarks/h200_steps.sh kernel-split)
"""
from __future__ import annotations

import argparse
import json
import re
import sys

import torch

from flashqla_tune.measure.cases import Case, parse_seqlens
from flashqla_tune.measure.impls import call, load_impls
from flashqla_tune.measure.inputs import make_rotation
from flashqla_tune.measure.timing import kernel_launches_and_ms_per_call

CALLS = 5
SEQLENS = [(32768,), (16384, 16384), (8192,) * 4, (1024,) * 8, (2048,)]
IMPLS = ["flashqla_tune_warmup", "fla", "flashqla"]


def short_name(kernel: str) -> str:
    """A kernel's name without template arguments and parameter lists (readable in a table)."""
    name = re.sub(r"<.*", "", kernel)
    name = re.sub(r"\(.*", "", name)
    return name.split("::")[-1][:60]


def split_of(impl, x) -> dict:
    for _ in range(2):  # with the helper's own warm-up call: JIT and autotuning are done before the profile
        call(impl, x)
    per_kernel = kernel_launches_and_ms_per_call(lambda: call(impl, x), CALLS, short_name)
    kernels = sorted(((name, n, ms * 1e3) for name, (n, ms) in per_kernel.items()), key=lambda r: -r[2])
    return {"kernel_us": round(sum(us for _, _, us in kernels), 1),
            "kernels": [{"name": name, "launches": round(n, 2), "us": round(us, 1)} for name, n, us in kernels]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--heads", action="append", default=None, help="H_qk/H_v (default 16/16 and 2/8)")
    parser.add_argument("--seqlens", action="append", default=None,
                        help="a row's lengths as the scoreboard writes them, e.g. 8192x4 or 16384+16384 (default: five rows)")
    parser.add_argument("--impl", action="append", default=None, help=f"implementations (default {IMPLS})")
    args = parser.parse_args(argv)
    impls, skipped = load_impls(args.impl or IMPLS)
    seqlens_rows = [parse_seqlens(label) for label in args.seqlens] if args.seqlens else SEQLENS
    rows = []
    with torch.no_grad():
        for heads in args.heads or ["16/16", "2/8"]:
            hqk, hv = (int(h) for h in heads.split("/"))
            for seqlens in seqlens_rows:
                case = Case(hqk, hv, seqlens)
                x = make_rotation(case, 1, "cuda")[0]
                row = {"heads": heads, "seqlens": case.seqlens_label, "impls": {}}
                for impl in impls:
                    try:
                        row["impls"][impl.name] = split_of(impl, x)
                    except Exception as error:  # one implementation failing must not cost the others' rows
                        row["impls"][impl.name] = {"error": f"{type(error).__name__}: {error}"[:300]}
                rows.append(row)
                summary = ", ".join(f"{name} {r.get('kernel_us', 'error')}" for name, r in row["impls"].items())
                print(f"{heads} {case.seqlens_label}: {summary} (us of kernel time per call)", flush=True)
                del x
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": CALLS,
              "skipped": skipped, "rows": rows}
    with open(f"{args.out_dir}/kernel_split.json", "w") as f:
        json.dump(result, f, indent=1)
    for row in rows:
        print(f"== {row['heads']} {row['seqlens']}")
        for name, r in row["impls"].items():
            top = "; ".join(f"{k['name']} x{k['launches']:g} {k['us']}" for k in r.get("kernels", [])[:6])
            print(f"  {name}: {r.get('kernel_us', r.get('error'))} us | {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
