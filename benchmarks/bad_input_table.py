"""The bad-input table: each listed case, the tests that cover it and what they get now.

    python -P benchmarks/bad_input_table.py CASES.md OUT.md [pytest arguments]

CASES.md is a case list in the form of ../shared/reference/bad-input-cases.md (a Markdown table
with the columns class | case | command | what was seen). The tests under tests/ name the cases
they cover with `@pytest.mark.bad_input("<case>", ...)`; this script runs the tests that carry
the marker (CPU, `-m "not gpu"`), then writes OUT.md: per case its class, the covering tests and
their outcome, and a count of cases covered, passing and not covered. A case no test names is
listed as not covered; a marker naming no listed case is listed at the end.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def read_cases(path: Path) -> list[tuple[str, str]]:
    """(class, case) per row of the list's table."""
    cases = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0] in {"a", "b", "c", "d"}:
            cases.append((cells[0], cells[1]))
    if not cases:
        raise SystemExit(f"{path}: no case rows (class | case | command | what was seen)")
    return cases


# Cases that stay as they are by design, with the reason the table gives where no test covers them.
INHERENT = {
    "cu_seqlens_cpu disagrees with cu_seqlens": "inherent: comparing the two would synchronise with the GPU; "
    "the kernels read cu_seqlens and clamp offsets, so a wrong host copy costs speed (a CP decision), never "
    "memory safety (flashqla_tune/ops.py's docstring)",
}


class Collector:
    """A pytest plugin: the bad_input marker's cases per test, and each test's outcome."""

    def __init__(self):
        self.cases: dict[str, list[str]] = {}
        self.outcome: dict[str, str] = {}

    def pytest_collection_modifyitems(self, items):
        keep = []
        for item in items:
            names = [c for m in item.iter_markers("bad_input") for c in m.args]
            if names:
                self.cases[item.nodeid] = names
                keep.append(item)
        items[:] = keep

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            previous = self.outcome.get(report.nodeid)
            if previous in (None, "passed"):
                self.outcome[report.nodeid] = report.outcome


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args(argv)
    listed = read_cases(args.cases)
    collector = Collector()
    rc = pytest.main(["-q", "-m", "not gpu", "-p", "no:cacheprovider", str(ROOT / "tests"), *args.pytest_args],
                     plugins=[collector])
    by_case: dict[str, list[str]] = defaultdict(list)
    for nodeid, names in collector.cases.items():
        for name in names:
            by_case[name].append(nodeid)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    rows, passing, covered = [], 0, 0
    for cls, case in listed:
        tests = by_case.get(case, [])
        outcomes = {collector.outcome.get(t, "not run") for t in tests}
        if tests:
            covered += 1
            passing += outcomes == {"passed"}
        state = (INHERENT.get(case, "not covered") if not tests else "passes" if outcomes == {"passed"} else
                 ", ".join(sorted(outcomes)))
        where = "<br>".join(f"`{t}`" for t in tests)
        rows.append(f"| {cls} | {case.replace('|', '/')} | {state} | {where} |")
    stray = sorted(name for name in by_case if name not in {c for _, c in listed})
    lines = [
        "<!-- result metadata",
        f"what: the bad-input and fault cases of {args.cases.name}, each with the tests that cover it",
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"machine: CPU, Python {platform.python_version()}, pytest {pytest.__version__}",
        f"commit: {commit} (the tree the tests ran on; uncommitted changes not included)",
        f"how: python -P benchmarks/bad_input_table.py {args.cases.name} OUT.md",
        "-->", "",
        "# Bad inputs and faults: what each listed case gets now", "",
        f"{len(listed)} listed cases: {covered} covered by a test, {passing} of them passing, "
        f"{len(listed) - covered} not covered ({sum(c in INHERENT for _, c in listed)} of them inherent). Class d: data lost, b: a traceback or an unexplained "
        "message, c: accepted silently (as first seen); a passing test asserts the case now gets a "
        "clear error naming the value, or correct behaviour.", "",
        "| class | case | now | tests |", "|---|---|---|---|", *rows,
    ]
    if stray:
        lines += ["", "Markers that name no listed case: " + ", ".join(f"`{s}`" for s in stray)]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{covered} of {len(listed)} cases covered, {passing} passing; pytest rc {rc}; wrote {args.out}")
    return 0 if rc in (0, 5) else int(rc)


if __name__ == "__main__":
    sys.exit(main())
