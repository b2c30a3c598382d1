"""Which source lines own a kernel's SASS instructions, without a GPU: the plan is built with
-lineinfo (same registers and schedule as the product as far as ptxas is concerned), its cubin is
disassembled with line information (nvdisasm -g), and every instruction is counted under the last
source line nvdisasm names before it. The counts are static (unrolled loops count once per
unrolled copy, a loop body once), so they say where the code is, not where the time goes; Nsight
Compute's source view on the H200 (tools/h200_ncu.sh) weighs them. Prints the counts per source
line (standard output).

    python tools/sass_by_line.py 16/16 [--kernel gdn_prep_kernel] [--top 30]
        [--opcode STL --opcode LDL]   (only those opcodes: where the spills are)
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from flashqla_tune import cache
from flashqla_tune.measure.cases import parse_heads
from flashqla_tune.build import BuildConfig
from flashqla_tune.plan import default_plan
from flashqla_tune.sass import find_tool, opcode_of
from flashqla_tune.spec import GDNSpec

_LINE_RE = re.compile(r'//## File "([^"]+)", line (\d+)')
_SECTION = "//--------------------- .text."


def attribute(disassembly: str, kernel: str) -> tuple[Counter, dict]:
    """{(file, line): instructions} and {(file, line): Counter(opcode)} for the first function
    whose mangled name contains `kernel`."""
    counts: Counter = Counter()
    opcodes: dict = defaultdict(Counter)
    inside, where = False, None
    for line in disassembly.splitlines():
        if line.startswith(_SECTION):
            if inside:
                break  # the next function
            inside = kernel in line
            continue
        if not inside:
            continue
        found = _LINE_RE.search(line)
        if found:
            where = (Path(found.group(1)).name, int(found.group(2)))
            continue
        op = opcode_of(line)
        if op:
            counts[where] += 1
            opcodes[where][op] += 1
    if not counts:
        raise SystemExit(f"no function whose name contains {kernel!r} in the disassembly")
    return counts, opcodes


def disassemble(library: Path) -> str:
    """nvdisasm -g -c of the library's sm_90a cubin (cuobjdump -xelf extracts it)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(find_tool("cuobjdump")), "-xelf", "all", str(library)], cwd=tmp, check=True,
                       capture_output=True)
        cubins = sorted(Path(tmp).glob("*.cubin"))
        if not cubins:
            raise SystemExit(f"cuobjdump found no cubin in {library}")
        return subprocess.run([str(find_tool("nvdisasm")), "-g", "-c", str(cubins[0])], check=True,
                              capture_output=True, text=True).stdout


def source_text(csrc: Path, file: str, line: int) -> str:
    path = csrc / file
    if not path.is_file():
        return ""
    lines = path.read_text().splitlines()
    return lines[line - 1].strip() if 0 < line <= len(lines) else ""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", help="H_qk/H_v, e.g. 16/16 (the default plan of that head configuration)")
    parser.add_argument("--kernel", default="gdn_prep_kernel", help="part of the mangled function name")
    parser.add_argument("--top", type=int, default=30, help="source lines to print")
    parser.add_argument("--opcode", action="append", default=[], help="count only this opcode (repeatable)")
    args = parser.parse_args(argv)
    hqk, hv = parse_heads(args.heads)
    plan = default_plan(GDNSpec(hqk, hv))
    config = BuildConfig(extra_flags=("-DNDEBUG", "-lineinfo"))
    entry = cache.get_kernels([plan], config=config)[0]
    counts, opcodes = attribute(disassemble(entry.so_path), args.kernel)
    if args.opcode:
        opcodes = {where: Counter({op: n for op, n in ops.items() if op in args.opcode}) for where, ops in opcodes.items()}
        counts = Counter({where: sum(ops.values()) for where, ops in opcodes.items() if ops})
    total = sum(counts.values())
    which = f"{'/'.join(args.opcode)} instructions" if args.opcode else "SASS instructions"
    print(f"{plan.name} {args.kernel}: {total} {which}")
    for (file, line), n in counts.most_common(args.top):
        ops = ", ".join(f"{op} {k}" for op, k in opcodes[(file, line)].most_common(4))
        text = source_text(config.csrc_dir, file, line)[:90]
        print(f"{n:6d} {100 * n / total:5.1f}%  {file}:{line}  [{ops}]  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
