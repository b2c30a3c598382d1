"""Whether this machine can build CUDA: the skip marker of the tests that run nvcc, and the host
programs they build against csrc/ to check what the kernels' headers lay out."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flashqla_tune import environment
from flashqla_tune.package_data import csrc_dir


def have_toolchain() -> bool:
    """nvcc and the nvidia-cutlass headers are both found (CI has them; a bare machine may not)."""
    try:
        environment.find_nvcc()
        environment.cutlass_include_dir()
        return True
    except environment.ToolchainError:
        return False


needs_nvcc = pytest.mark.skipif(not have_toolchain(), reason="needs nvcc and the nvidia-cutlass headers")


def run_host_program(source: str, where: Path, name: str = "probe") -> str:
    """Build a host program against csrc/ and the CUTLASS headers with nvcc (sm_90a, no kernel
    launched) in `where` and run it: its stdout. A failed build or a non-zero exit fails the
    calling test with nvcc's or the program's output."""
    src, exe = Path(where) / f"{name}.cu", Path(where) / name
    src.write_text(source)
    cmd = [str(environment.find_nvcc()), "-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_90a",
           f"-I{csrc_dir()}", f"-I{environment.cutlass_include_dir()}", str(src), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout
