"""The plan's shared-memory estimate equals the kernel's real SharedStorage size (host-only nvcc
probe over several tile shapes), so plan validation refuses exactly what would fail to launch."""
from __future__ import annotations

import pytest

from flashqla_tune.plan import TileParams, default_plan
from flashqla_tune.spec import GDNSpec

from toolchain import have_toolchain, run_host_program

SHAPES = [(64, 2, 0), (64, 3, 0), (128, 2, 0), (64, 1, 0), (128, 1, 0), (64, 2, 1), (64, 3, 1)]


@pytest.mark.slow
def test_shared_memory_estimate_matches_the_kernel(tmp_path):
    if not have_toolchain():   # CI has nvcc; a bare machine reports why it skipped
        pytest.skip("no nvcc or CUTLASS headers")
    lines = [f'  std::printf("%d\\n", fqt::FwdConfig<cutlass::bfloat16_t, 2, 8, 128, 128, {bv}, {st}, false, 24, 232, 1, {str(bool(og)).lower()}>::SmemBytes);'
             for bv, st, og in SHAPES]
    source = '#include <cstdio>\n#include "gdn_fwd_mainloop.cuh"\nint main() {\n' + "\n".join(lines) + "\n}\n"
    sizes = [int(x) for x in run_host_program(source, tmp_path).split()]
    spec = default_plan(GDNSpec(2, 8)).spec
    assert sizes == [TileParams(block_v=bv, stages=st, output_group=og).shared_memory_bytes(spec)
                     for bv, st, og in SHAPES]
