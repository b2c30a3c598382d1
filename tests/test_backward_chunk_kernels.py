"""The Python side of the backward's per-chunk gradient kernel, and its hand-written layout facts.

A host program, compiled by nvcc and run here (marked slow), checks the layout facts the kernel
writes out by hand against CuTe: where a swizzled tile keeps element (r, c), that a transposed view
is the same bytes, and which rows and columns each thread's wgmma accumulator holds. On the CPU:
the template's constants, the specs it refuses, the launch's checks, a failed build's error. Its
build: tests/test_backward_kernel_builds.py; its results: tests/test_gpu_backward_chunk.py.
"""
from __future__ import annotations

import pytest
import torch

from flashqla_tune import environment
from flashqla_tune.backward import chunk_kernels
from flashqla_tune.backward.chunk_kernels import ChunkSpec

from toolchain import needs_nvcc, run_host_program

SPEC = ChunkSpec(walk=True)  # what the backward uses at K = V = 128


LAYOUT_CHECK = r"""
#include "gdn_bwd_chunk.cuh"
#include <cstdio>
using namespace cute;
using Cfg = fqt::ChunkGradConfig<cutlass::half_t, 128, 128, 2>;   // the backward's
using Cfg1 = fqt::ChunkGradConfig<cutlass::half_t, 128, 128, 1>;
using Elem = cutlass::half_t;
static int failures = 0;
#define EXPECT(cond, ...) do { if (!(cond)) { if (failures++ < 10) std::printf(__VA_ARGS__); } } while (0)

// tile_offset is CuTe's swizzled offset, and TileT(c, r) is Tile(r, c)
template <int R, int C>
void check_tile(Elem* base) {
  Tensor t = make_tensor(make_smem_ptr(base), typename Cfg::template Tile<R, C>{});
  Tensor tt = make_tensor(make_smem_ptr(base), typename Cfg::template TileT<R, C>{});
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const long off = &t(r, c) - base;
      EXPECT(off == fqt::tile_offset<R>(r, c), "Tile<%d,%d>(%d,%d) at %ld, tile_offset %d\n", R, C, r, c, off,
             fqt::tile_offset<R>(r, c));
      EXPECT(&tt(c, r) == &t(r, c), "TileT<%d,%d>(%d,%d) is not Tile(%d,%d)\n", R, C, c, r, r, c);
    }
}

// a block of rows of a tile (a K-major B operand's) and of a transposed view's rows (an MN-major
// one's) from row_block / col_block: the tile's elements
template <int R, int C, int NB>
void check_blocks(Elem* base) {
  Tensor t = make_tensor(make_smem_ptr(base), typename Cfg::template Tile<R, C>{});
  Tensor tt = make_tensor(make_smem_ptr(base), typename Cfg::template TileT<R, C>{});
  for (int b = 0; b * NB < R; ++b) {
    Tensor rows = make_tensor(make_smem_ptr(base + fqt::row_block(b, NB)), typename Cfg::template TileRows<R, C, NB>{});
    for (int r = 0; r < NB; ++r)
      for (int c = 0; c < C; ++c)
        EXPECT(&rows(r, c) == &t(b * NB + r, c), "TileRows<%d,%d,%d> block %d (%d,%d)\n", R, C, NB, b, r, c);
  }
  if constexpr (NB % 64 == 0)
    for (int b = 0; b * NB < C; ++b) {
      Tensor cols = make_tensor(make_smem_ptr(base + fqt::col_block<R>(b, NB)),
                                typename Cfg::template TileTRows<R, C, NB>{});
      for (int c = 0; c < NB; ++c)
        for (int r = 0; r < R; ++r)
          EXPECT(&cols(c, r) == &tt(b * NB + c, r), "TileTRows<%d,%d,%d> block %d (%d,%d)\n", R, C, NB, b, c, r);
    }
}

// each thread's accumulator elements of a warp group's block of N columns from col0: rows r0 and
// r0 + 8 (r0 = 16 warp + lane / 4), columns col0 + 2 (lane % 4) + 8 j + b with elements e, e + 1
// neighbours; AccTileOffsets is tile_offset there
template <class Mma, int N>
void check_acc(int col0) {
  for (int tid = 0; tid < 128; ++tid) {
    Tensor crd = Mma{}.get_thread_slice(tid).partition_C(
        domain_offset(make_coord(0, col0), make_identity_tensor(Shape<_64, Int<N>>{})));
    const int r0 = get<0>(crd(0)), c0 = get<1>(crd(0));
    EXPECT(r0 == 16 * (tid / 32) + (tid % 32) / 4 && c0 == col0 + 2 * (tid % 4), "N=%d thread %d starts at (%d,%d)\n",
           N, tid, r0, c0);
    const fqt::AccTileOffsets<64> at(crd);
    for (int e = 0; e < size(crd); ++e) {
      const int r = get<0>(crd(e)), c = get<1>(crd(e));
      EXPECT(r == r0 || r == r0 + 8, "N=%d thread %d element %d in row %d\n", N, tid, e, r);
      EXPECT(c % 8 == c0 % 8 + e % 2 && c >= col0 && c < col0 + N, "N=%d thread %d element %d in column %d\n", N, tid,
             e, c);
      EXPECT(e % 2 == 0 || get<1>(crd(e - 1)) == c - 1, "N=%d thread %d: elements %d, %d not neighbours\n", N, tid,
             e - 1, e);
      EXPECT(at(r, c) == fqt::tile_offset<64>(r, c), "N=%d thread %d element %d: offset %d, tile_offset %d\n", N, tid,
             e, at(r, c), fqt::tile_offset<64>(r, c));
    }
  }
}

int main() {
  alignas(1024) static Elem buffer[128 * 128];
  check_tile<64, 64>(buffer);
  check_tile<64, 128>(buffer);
  check_tile<128, 128>(buffer);
  check_blocks<64, 64, 32>(buffer);
  check_blocks<64, 128, 32>(buffer);
  check_blocks<64, 128, 64>(buffer);
  check_blocks<128, 128, 64>(buffer);
  for (int col0 : {0, 32}) {
    check_acc<Cfg::MmaTokTokV, 32>(col0);
    check_acc<Cfg::MmaTokTokK, 32>(col0);
    check_acc<Cfg::MmaTokTokTokT, 32>(col0);
    check_acc<Cfg::MmaTokTokTok, 32>(col0);
  }
  for (int col0 : {0, 64}) {
    check_acc<Cfg::MmaTokKV, 64>(col0);
    check_acc<Cfg::MmaTokKTok, 64>(col0);
    check_acc<Cfg::MmaTokKTokT, 64>(col0);
    check_acc<Cfg::MmaTokVTokT, 64>(col0);
  }
  check_acc<Cfg1::MmaTokKV, 128>(0);
  check_acc<Cfg1::MmaTokTokV, 64>(0);
  std::printf("shared memory: %d bytes (two warp groups), %d bytes (one)\n", Cfg::SmemBytes, Cfg1::SmemBytes);
  std::printf("%s\n", failures ? "FAILED" : "layouts ok");
  return failures != 0;
}
"""


@pytest.mark.slow
@needs_nvcc
def test_hand_written_tile_offsets_are_cutes(tmp_path):
    out = run_host_program(LAYOUT_CHECK, tmp_path, "layout_check")
    assert "layouts ok" in out, out


def test_template_only_fixes_constants():
    text = chunk_kernels.render_source(ChunkSpec(operand_dtype="bfloat16", head_k_dim=64, head_v_dim=128,
                                                 warp_groups=1))
    assert '#include "gdn_bwd_chunk_host.cuh"' in text
    assert "fqt::ChunkGradConfig<cutlass::bfloat16_t, /*K=*/64, /*V=*/128,\n" in text
    assert "/*warp_groups=*/1, /*walk=*/false>" in text
    assert "/*walk=*/true>" in chunk_kernels.render_source(ChunkSpec(walk=True))
    assert f"FQT_BWD_CHUNK_ABI_VERSION == {chunk_kernels.ABI_VERSION}" in text


@pytest.mark.parametrize("bad, match", [
    (dict(operand_dtype="float32"), "operand_dtype"), (dict(head_k_dim=96), "head_k_dim"),
    (dict(head_v_dim=256), "head_v_dim"), (dict(warp_groups=3), "warp_groups"),
    (dict(head_k_dim=64), "warp_groups=2 needs K = V = 128"), (dict(walk=1), "walk=1 must be a bool"),
    (dict(warp_groups=1, walk=True), "walk needs warp_groups=2")])
def test_spec_refuses_what_the_kernel_does_not_instantiate(bad, match):
    with pytest.raises(ValueError, match=match):
        ChunkSpec(**bad)


def test_spec_for_covers_the_chain_kernels_dims():
    from flashqla_tune.backward import chain_kernels

    assert chunk_kernels.BACKWARD_DIMS == chain_kernels.BACKWARD_DIMS
    assert chunk_kernels.spec_for(128, 128) == SPEC
    with pytest.raises(ValueError, match="K=64, V=64"):
        chunk_kernels.spec_for(64, 64)


def test_variants_are_the_warp_group_counts_the_dims_allow():
    variants = chunk_kernels.variants_for(128, 128)
    assert variants == {"wg1": ChunkSpec(warp_groups=1), "wg2": ChunkSpec(warp_groups=2),
                        "wg2-walk": ChunkSpec(warp_groups=2, walk=True)}
    assert len({spec.name for spec in variants.values()}) == len(variants)   # each its own library
    assert chunk_kernels.spec_for(128, 128) in variants.values()
    with pytest.raises(ValueError, match="K=64, V=64"):
        chunk_kernels.variants_for(64, 64)


def test_a_build_failure_is_the_error_the_backward_falls_back_on(monkeypatch):
    """chunked_torch falls back to the torch step 3 on ChunkKernelError, a BackwardKernelError."""
    from flashqla_tune.backward.kernel_library import BackwardKernelError, LibraryTable

    def no_nvcc(*args, **kwargs):
        raise environment.ToolchainError("no nvcc here (test double)")

    table = LibraryTable(chunk_kernels.KIND)
    monkeypatch.setattr(chunk_kernels, "LIBRARIES", table)
    monkeypatch.setattr(table, "cache_entry", no_nvcc)
    with pytest.raises(chunk_kernels.ChunkKernelError, match="not available: ToolchainError: no nvcc here") as info:
        chunk_kernels.LIBRARIES.get(SPEC)
    assert isinstance(info.value, BackwardKernelError)


def test_launch_refuses_tensors_it_cannot_take():
    """Checked on the host before any library is opened: CPU tensors, a wrong dtype or shape."""
    NC, H = 2, 2
    f = lambda *s: torch.zeros(*s)  # noqa: E731
    args = [f(NC, H, 64, 128), f(NC, H, 64, 128), f(NC, H, 64, 128), f(NC, H, 64, 128), f(NC, H, 64), f(NC, H, 64),
            f(NC, H, 64, 64), f(NC, H, 128, 128), f(NC, H, 128, 128), f(NC, H, 64, 128), f(NC, H, 64, 128),
            f(NC, H), f(NC, H)]
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        chunk_kernels.chunk_gradients(*args)
    with pytest.raises(ValueError, match="v-heads"):
        chunk_kernels.chunk_gradients(f(NC, 3, 64, 128), *args[1:])
    with pytest.raises(ValueError, match="rows must be 64"):
        chunk_kernels.chunk_gradients(f(NC, H, 32, 128), *args[1:])
