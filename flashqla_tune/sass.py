"""Read the SASS of a built library with cuobjdump: which instructions each kernel uses.

CI has no GPU, so this is how it checks that a kernel really runs on the tensor cores (HGMMA)
and the TMA engine (UTMALDG). cuobjdump comes from the nvidia-cuda-cuobjdump wheel and needs
nvdisasm (nvidia-cuda-nvdisasm wheel) on PATH to print sm_90 SASS; /usr/local/cuda/bin is the
fallback for both.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


class SassError(RuntimeError):
    """cuobjdump or nvdisasm is missing, or cuobjdump failed on the library."""


def _wheel_bins(tool: str) -> list[Path]:
    # The CUDA 13 wheels put tools under nvidia/cu13/bin; older ones under nvidia/cuda_<tool>/bin.
    try:
        import nvidia  # namespace package shared by the NVIDIA wheels
    except ImportError:
        return []
    found = []
    for base in getattr(nvidia, "__path__", []):
        found += sorted(Path(base).glob(f"*/bin/{tool}"))
    return found


def find_tool(tool: str) -> Path:
    """cuobjdump or nvdisasm: from the pip wheels, else PATH, else CUDA_HOME, else /usr/local/cuda."""
    candidates = _wheel_bins(tool)
    if shutil.which(tool):
        candidates.append(Path(shutil.which(tool)))
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "bin" / tool)
    candidates.append(Path("/usr/local/cuda/bin") / tool)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise SassError(f"{tool} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
                    f"(or put a CUDA toolkit's bin/ on PATH)")


def sass_text(library: Path) -> str:
    """`cuobjdump -sass` of a library, with nvdisasm's folder put first on PATH."""
    library = Path(library)
    if not library.is_file():
        raise SassError(f"no such library: {library}")
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    env = dict(os.environ, PATH=f"{nvdisasm.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run([str(cuobjdump), "-sass", str(library)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SassError(f"cuobjdump -sass {library} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


_FUNCTION_RE = re.compile(r"^\s*Function\s*:\s*(\S+)")
# "        /*0040*/                   @!P0 HGMMA.64x64x16.F32.BF16 gdesc[UR4], ... ;"
_INSTR_RE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[\w.]*)?")


@dataclass(frozen=True)
class SassSummary:
    """Opcode counts (modifiers dropped: HGMMA.64x64x16.F32 counts as HGMMA) per kernel and in all."""
    per_function: dict[str, Counter]

    @property
    def total(self) -> Counter:
        out: Counter = Counter()
        for counts in self.per_function.values():
            out.update(counts)
        return out

    def count(self, opcode: str, function: str | None = None) -> int:
        counts = self.total if function is None else self.per_function.get(function, Counter())
        return counts.get(opcode, 0)


def opcode_of(line: str) -> str | None:
    """The opcode of a disassembled instruction line (modifiers dropped), None for other lines;
    cuobjdump's and nvdisasm's listings share the form."""
    m = _INSTR_RE.match(line)
    return m.group(1) if m else None


def parse_sass(text: str) -> SassSummary:
    per_function: dict[str, Counter] = {}
    current: Counter | None = None
    for line in text.splitlines():
        if m := _FUNCTION_RE.match(line):
            current = per_function.setdefault(m.group(1), Counter())
        elif current is not None and (op := opcode_of(line)):
            current[op] += 1
    return SassSummary(per_function)


def instruction_counts(library: Path) -> SassSummary:
    """Opcode counts of every kernel in a built library (HGMMA, UTMALDG, LDSM, ...)."""
    return parse_sass(sass_text(library))


__all__ = ["SassError", "SassSummary", "find_tool", "instruction_counts", "opcode_of", "parse_sass", "sass_text"]
