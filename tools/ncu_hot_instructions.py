"""Where a kernel's warps wait, per SASS instruction: reads `ncu --import REP --page source --csv
--print-source sass` (the SourceCounters section's warp-state samples) and prints, per profiled
launch, the instructions with the most samples and the samples summed per opcode (LDS, FFMA,
BAR, SYNCS, STG, MUFU, HGMMA, ...) to standard output. tools/h200_ncu.sh runs it on the prep kernel.

    python3 tools/ncu_hot_instructions.py SOURCE.csv [TOP]
"""
from __future__ import annotations

import collections
import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def tables(lines: list[str]):
    """The CSV tables in the export: each starts at a header row that has a 'Source' column."""
    header, rows = None, []
    for row in csv.reader(lines):
        if "Source" in row and any("Sampl" in cell for cell in row):
            if header is not None:
                yield header, rows
            header, rows = row, []
        elif header is not None and len(row) == len(header):
            rows.append(row)
    if header is not None:
        yield header, rows


def main(argv: list[str]) -> int:
    path = argv[0]
    top = int(argv[1]) if len(argv) > 1 else 25
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    found = False
    for index, (header, rows) in enumerate(tables(lines)):
        found = True
        source = header.index("Source")
        sampled = [i for i, cell in enumerate(header) if "Sampl" in cell]  # tables() keeps only those with one
        samples = next((i for i in sampled if "All" in header[i]), sampled[0])
        total = sum(number(r[samples]) for r in rows) or 1.0
        print(f"== launch {index}: {len(rows)} instructions, {total:.0f} samples ({header[samples]})")
        for r in sorted(rows, key=lambda r: -number(r[samples]))[:top]:
            print(f"  {100 * number(r[samples]) / total:5.1f}%  {r[source].strip()[:110]}")
        per_opcode = collections.Counter()
        for r in rows:
            text = r[source].strip().split()
            opcode = next((t for t in text if not t.startswith("@")), "?").split(".")[0]
            per_opcode[opcode] += number(r[samples])
        print("  by opcode: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in per_opcode.most_common(12)))
    if not found:
        print("no source table with sampling columns in " + path + "; its first lines:")
        print("\n".join(lines[:8]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
