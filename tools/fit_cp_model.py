"""Fit the CP cost model (flashqla_tune/cp_cost_model.py Machine) to the H200's measurements.

Two kinds of data:
- tools/cp_profile.py rows: graph time per forced segment length, exact chaining and the
  calibrated warm-up, beside no CP;
- scoreboard rows (`--scoreboard JSON`) with the op's default column (the default window, planned
  by OPDEFAULT_RUN_MACHINE) beside the single chain: two measured choices per row.
For each row and mode the candidate Machine picks segment lengths; its regret is the measured
time of that choice over the best measured variant of the row. The script prints the current
Machine's regrets, then grid-searches the costs that minimise the geometric-mean regret. A
choice that was not measured counts as MISSING_REGRET, so the fit cannot hide in unmeasured
lengths.

    python tools/fit_cp_model.py PROFILE.json [...] [--scoreboard SCOREBOARD.json ...] [--single SINGLE.json ...]

It prints the regrets and the fitted costs (standard output); a refit goes into cp_cost_model.py's
Machine by hand, with its evidence in docs/results/.

`--single` names earlier scoreboards whose flashqla_tune column was the single chain, for runs
that did not time it beside the op.
"""
from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import replace

from flashqla_tune.cp_cost_model import Machine, WarmupProfile, segment_table
from flashqla_tune.segment_policy import bucket_of_chunks

MISSING_REGRET = 1.5
# A call that does not know its longest sequence (no cu_seqlens_cpu) bounds it by ceil(T/64)
# chunks; where that bound falls in a split bucket the CP kernels run even when no sequence
# splits, at this cost. Scoreboards whose rows were timed that way carry it.
UNSPLIT_CP_OVERHEAD_MS = 0.015
V_TILES = 2  # the default plans' block_v = 64 for V = 128
# The costs cp_cost_model.py had when the op-default scoreboards this script reads were taken (the
# tables those runs used).
OPDEFAULT_RUN_MACHINE = Machine(cta_start=2.0, chain_step=4.0, cp_fixed=8.0, state_step=0.4, prep_item=7.5,
                                batch_weight=0.35, min_segment=32, wave_tail=0.0)
DEFAULT_PROFILE = WarmupProfile(exact_share=0.25, mean_window=8.0, max_window=8)  # flashqla_tune/warmup_tables.py


def _row_inputs(row: dict) -> tuple[int, int, list[int]]:
    qk, v = (int(x) for x in row["heads"].split("/"))
    if "lengths" in row:  # a scoreboard row
        return qk, v, list(row["lengths"])
    # cp_profile labels are "1x32768" (one sequence) or "8192x4" (four of 8192 tokens)
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


def _choices(table: dict[int, int], seqlens: list[int]) -> tuple[tuple[int, ...], bool]:
    """Per sequence its segment length (0: one chain), and whether the CP kernels run at all."""
    lengths = []
    for n in seqlens:
        chunks = -(-n // 64)
        length = _length_for(table, chunks)
        lengths.append(length if 0 < length < chunks else 0)
    bound = -(-sum(seqlens) // 64)
    return tuple(lengths), any(lengths) or 0 < _length_for(table, bound) < bound


def scoreboard_regrets(rows: list[dict], machine: Machine) -> list[tuple[str, float]]:
    """Rows with the op default ('op', planned by OPDEFAULT_RUN_MACHINE) and the single chain."""
    out = []
    for row in rows:
        qk, v, seqlens = _row_inputs(row)
        measured_choice = _choices(segment_table(V_TILES * v, DEFAULT_PROFILE, OPDEFAULT_RUN_MACHINE, qk_heads=qk),
                                   seqlens)
        choice = _choices(segment_table(V_TILES * v, DEFAULT_PROFILE, machine, qk_heads=qk), seqlens)
        op, single = row["op_ms"], row["single_ms"]
        best = min(op, single)
        if choice == measured_choice:
            regret = op / best
            key = "op" if any(choice[0]) else "one chain" + (" + CP kernels" if choice[1] else "")
        elif not any(choice[0]):
            regret = (single + (UNSPLIT_CP_OVERHEAD_MS if choice[1] else 0.0)) / best
            key = "one chain" + (" + CP kernels" if choice[1] else "")
        else:
            regret, key = MISSING_REGRET, f"unmeasured {choice[0]}"
        out.append((f"{row['heads']} {row['seqlens']} default: {key}", regret))
    return out


def load_scoreboard_rows(paths: list[str], single_paths: list[str]) -> list[dict]:
    """{heads, seqlens, lengths, op_ms, single_ms} per row that has both times."""
    def graph_ms(row, impl):
        timing = row["times"].get(impl, {}).get("graph") or {}
        return timing.get("median_ms") if not timing.get("error") else None

    single_of = {}
    for path in single_paths:
        for row in json.load(open(path))["rows"]:
            single_of[(row["heads"].split()[0], row["seqlens"])] = graph_ms(row, "flashqla_tune")
    rows = []
    for path in paths:
        for row in json.load(open(path))["rows"]:
            heads = row["heads"].split()[0]
            single = graph_ms(row, "flashqla_tune_single_chain") or single_of.get((heads, row["seqlens"]))
            op = graph_ms(row, "flashqla_tune")
            if op and single:
                rows.append({"heads": heads, "seqlens": row["seqlens"], "lengths": row["lengths"],
                             "op_ms": op, "single_ms": single})
    return rows


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(x) for x in values) / len(values))


GRID = {
    "chain_step": (1.0, 2.0, 3.0, 4.0),
    "state_step": (0.35, 0.4, 0.5, 0.6, 0.75),
    "prep_item": (2.5, 5.0, 7.5),
    "cp_fixed": (4.0, 8.0, 16.0),
    "batch_weight": (0.0, 0.15, 0.25, 0.35),
    "min_segment": (16, 32),
    "wave_tail": (0.0, 25.0),
}


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profiles", nargs="*")
    ap.add_argument("--scoreboard", action="append", default=[])
    ap.add_argument("--single", action="append", default=[])
    args = ap.parse_args(argv)
    rows = [row for path in args.profiles for row in json.load(open(path))["rows"]]
    board = load_scoreboard_rows(args.scoreboard, args.single)

    def all_regrets(machine):
        return regrets(rows, machine) + scoreboard_regrets(board, machine)

    current = Machine()
    scored = all_regrets(current)
    print(f"current {current}: geomean regret {geomean(r for _, r in scored):.3f}")
    for label, r in scored:
        print(f"  {label:40s} {r:.3f}")
    results = []
    for values in itertools.product(*GRID.values()):
        machine = replace(current, **dict(zip(GRID, values)))
        scored = all_regrets(machine)
        results.append((geomean(r for _, r in scored), max(r for _, r in scored), values))
    results.sort()
    print("best grid points (geomean regret, worst regret, " + ", ".join(GRID) + "):")
    for g, worst, values in results[:12]:
        print(f"  {g:.3f} {worst:.3f} {values}")
    best = replace(current, **dict(zip(GRID, results[0][2])))
    for label, r in all_regrets(best):
        print(f"  {label:40s} {r:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
