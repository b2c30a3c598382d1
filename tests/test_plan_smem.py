"""The plan's shared-memory estimate equals the kernel's real SharedStorage size (host-only nvcc
probe over several tile shapes), so plan validation refuses exactly what would fail to launch."""
from __future__ import annotations

import subprocess

import pytest

from flashqla_tune.environment import cutlass_include_dir, find_nvcc
from flashqla_tune.plan import TileParams, default_plan
from flashqla_tune.render import csrc_dir
from flashqla_tune.spec import GDNSpec

SHAPES = [(64, 2, 0), (64, 3, 0), (128, 2, 0), (64, 1, 0), (128, 1, 0), (64, 2, 1), (64, 3, 1)]


@pytest.mark.slow
def test_shared_memory_estimate_matches_the_kernel(tmp_path):
    try:
        nvcc = find_nvcc()
    except Exception as exc:  # noqa: BLE001 - CI has nvcc; a bare machine reports why it skipped
        pytest.skip(f"no nvcc: {exc}")
    lines = [f'  std::printf("%d\\n", fqt::FwdConfig<cutlass::bfloat16_t, 2, 8, 128, 128, {bv}, {st}, false, 24, 232, 1, {str(bool(og)).lower()}>::SmemBytes);'
             for bv, st, og in SHAPES]
    src = tmp_path / "probe.cu"
    src.write_text('#include <cstdio>\n#include "gdn_fwd_mainloop.cuh"\nint main() {\n' + "\n".join(lines) + "\n}\n")
    exe = tmp_path / "probe"
    subprocess.run([str(nvcc), "-std=c++17", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
                    f"-I{csrc_dir()}", f"-I{cutlass_include_dir()}", str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    sizes = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    spec = default_plan(GDNSpec(2, 8)).spec
    assert sizes == [TileParams(block_v=bv, stages=st, output_group=og).shared_memory_bytes(spec)
                     for bv, st, og in SHAPES]
