"""Fit the CP cost model (flashqla_tune/cp_plan.py Machine) to scripts/cp_profile.py measurements.

For each profiled row and mode (exact chaining, calibrated warm-up) the model picks a segment
length; its regret is the measured time of that choice over the best measured variant of the row
(no CP included). The script prints the current Machine's regrets, then grid-searches the costs
that minimise the geometric-mean regret. A choice the profile did not measure (an L outside
cp_profile.LENGTHS) counts as regret MISSING_REGRET, so the fit cannot hide in unmeasured lengths.

    python scripts/fit_cp_model.py docs/gpu-logs/2026-11-30-cp3-cp_profile.json [more.json ...]
"""
from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import replace

from flashqla_tune.cp_plan import Machine, WarmupProfile, bucket_of_chunks, segment_table

MISSING_REGRET = 1.5
# A batch whose longest possible sequence (ceil(T/64) chunks, the host's bound) falls in a split
# bucket runs the CP kernels even when none of its sequences splits: the prep then no longer hides
# behind the chains. Measured in the cp3 profile: 2/8 1024x8 warm@model 0.097 ms vs none 0.082.
UNSPLIT_CP_OVERHEAD_MS = 0.015
V_TILES = 2  # the default plans' block_v = 64 for V = 128


def _row_inputs(row: dict) -> tuple[int, int, list[int]]:
    qk, v = (int(x) for x in row["heads"].split("/"))
    # labels are "1x32768" (one sequence) or "8192x4" (four of 8192 tokens)
    first, second = (int(x) for x in row["seqlens"].split("x"))
    seqlens = [second] if first == 1 else [first] * second
    return qk, v, seqlens


def _length_for(table: dict[int, int], chunks: int) -> int:
    top = max(table).bit_length() - 1
    return table[2 ** min(bucket_of_chunks(chunks), top)]


def choice_key(mode: str, table: dict[int, int], seqlens: list[int]) -> tuple[str, bool]:
    """The measured variant that the model's table runs for this row, and whether the CP kernels
    run anyway (the bound's bucket splits though no sequence does)."""
    chunks = -(-max(seqlens) // 64)
    length = _length_for(table, chunks)  # cp_profile's rows hold sequences of one length
    if 0 < length < chunks:
        return f"{mode}@L{length}", True
    bound = -(-sum(seqlens) // 64)
    return "none", 0 < _length_for(table, bound) < bound


def regrets(rows: list[dict], machine: Machine) -> list[tuple[str, float]]:
    out = []
    for row in rows:
        qk, v, seqlens = _row_inputs(row)
        measured = {k: t for k, t in row["graph_ms"].items() if isinstance(t, (int, float))}
        for mode in ("exact", "warm"):
            values = [-1] * v if mode == "exact" else row["warm_table"]
            profile = WarmupProfile.from_tables([values])
            table = segment_table(V_TILES * v, profile, machine, qk_heads=qk)
            key, cp_kernels = choice_key(mode, table, seqlens)
            best = min(t for k, t in measured.items() if k == "none" or k.startswith(f"{mode}@L"))
            if key not in measured:
                regret = MISSING_REGRET
            else:
                regret = (measured[key] + (UNSPLIT_CP_OVERHEAD_MS if key == "none" and cp_kernels else 0)) / best
                key += " (+CP kernels)" if key == "none" and cp_kernels else ""
            out.append((f"{row['heads']} {row['seqlens']} {mode}: {key}", regret))
    return out


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(x) for x in values) / len(values))


GRID = {
    "chain_step": (1.0, 2.0, 3.0, 4.0),
    "state_step": (0.35, 0.5, 0.6, 0.75),
    "prep_item": (2.5, 5.0, 7.5),
    "cp_fixed": (4.0, 8.0, 16.0),
    "batch_weight": (0.0, 0.15, 0.25, 0.35),
    "min_segment": (16, 32),
}


def main(paths: list[str]) -> int:
    rows = [row for path in paths for row in json.load(open(path))["rows"]]
    current = Machine()
    scored = regrets(rows, current)
    print(f"current {current}: geomean regret {geomean(r for _, r in scored):.3f}")
    for label, r in scored:
        print(f"  {label:40s} {r:.3f}")
    results = []
    for values in itertools.product(*GRID.values()):
        machine = replace(current, **dict(zip(GRID, values)))
        scored = regrets(rows, machine)
        results.append((geomean(r for _, r in scored), max(r for _, r in scored), values))
    results.sort()
    print("best grid points (geomean regret, worst regret, " + ", ".join(GRID) + "):")
    for g, worst, values in results[:12]:
        print(f"  {g:.3f} {worst:.3f} {values}")
    best = replace(current, **dict(zip(GRID, results[0][2])))
    for label, r in regrets(rows, best):
        print(f"  {label:40s} {r:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
