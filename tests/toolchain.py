"""Whether this machine can build CUDA: the skip marker of the tests that run nvcc."""
from __future__ import annotations

import pytest

from flashqla_tune import environment


def have_toolchain() -> bool:
    """nvcc and the nvidia-cutlass headers are both found (CI has them; a bare machine may not)."""
    try:
        environment.find_nvcc()
        environment.cutlass_include_dir()
        return True
    except environment.ToolchainError:
        return False


needs_nvcc = pytest.mark.skipif(not have_toolchain(), reason="needs nvcc and the nvidia-cutlass headers")
