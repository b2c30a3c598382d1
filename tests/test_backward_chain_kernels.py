"""The Python side of the backward's chain kernels, on the CPU: the template's constants, the specs
it refuses, where the kernels are used and where the torch loops, the launch's checks, the chunk
grid and scaling units the kernels take, the fallback without a library. Their build:
tests/test_backward_kernel_builds.py; their results: tests/test_gpu_backward_chain.py.
"""
from __future__ import annotations


import pytest
import torch

from flashqla_tune.backward import chain_kernels, chain_segments, chunked_torch
from flashqla_tune.backward.chain_kernels import ChainSpec


SPEC = ChainSpec()  # what the backward uses at K = V = 128


def test_template_only_fixes_constants():
    text = chain_kernels.render_source(ChainSpec(operand_dtype="bfloat16", head_k_dim=64, head_v_dim=256,
                                                 block_v=128, stages=1))
    assert '#include "gdn_bwd_chain_host.cuh"' in text
    assert "fqt::ChainConfig<cutlass::bfloat16_t, /*K=*/64, /*V=*/256," in text
    assert "/*block_v=*/128, /*stages=*/1" in text


@pytest.mark.parametrize("bad, match", [
    (dict(operand_dtype="float32"), "operand_dtype"), (dict(head_k_dim=96), "head_k_dim"),
    (dict(block_v=32), "block_v"), (dict(head_v_dim=64, block_v=128), "block_v"), (dict(stages=0), "stages")])
def test_spec_refuses_what_the_kernels_do_not_instantiate(bad, match):
    with pytest.raises(ValueError, match=match):
        ChainSpec(**bad)


def test_kernels_are_the_hopper_path_and_loops_the_cpu_path(monkeypatch):
    use = chunked_torch.uses_chain_kernels
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert use("auto", "cuda", torch.float32, 128, 128)
    assert not use("auto", "cuda", torch.float64, 128, 128)  # the float64 check runs the reference loops
    assert not use("auto", "cpu", torch.float32, 128, 128)
    assert not use("auto", "cuda", torch.float32, 16, 8)     # dims the chain library is not built for
    assert not use("auto", "cuda", torch.float32, 256, 256)  # K = 256 exceeds the shared memory at two stages
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not use("auto", "cuda", torch.float32, 128, 128)  # the library is sm_90a code
    assert not use("torch", "cuda", torch.float32, 128, 128)
    with pytest.raises(ValueError, match="needs CUDA"):
        use("kernels", "cpu", torch.float32, 128, 128)
    with pytest.raises(ValueError, match="sequential"):
        use("fast", "cuda", torch.float32, 128, 128)


def test_grid_hands_the_kernels_each_sequences_first_chunk():
    grid = chunked_torch.chunk_grid((0, 1, 1, 130, 194, 300), torch.device("cpu"))
    assert grid.chunk_offsets.tolist() == [0, 1, 1, 4, 5, 7]
    assert grid.chunk_offsets.dtype == torch.int64 and grid.num_chunks == 7


def test_add_tiles_layout():
    x = torch.arange(2 * 3 * 64 * 128, dtype=torch.float32).view(2, 3, 64, 128)
    tiles = chain_kernels.add_tiles(x, 64)
    assert tiles.shape == (2, 3, 2, 64, 64) and tiles.is_contiguous()
    assert torch.equal(tiles[1, 2, 1, 5], x[1, 2, 5, 64:])
    assert torch.equal(chain_kernels.from_add_tiles(tiles), x)


def test_launch_refuses_tensors_it_cannot_take():
    """Checked on the host before any library is opened: CPU tensors, a wrong operand dtype."""
    w = torch.zeros(2, 3, 64, 128, dtype=torch.float16)
    u = torch.zeros(2, 3, 64, 128)
    offsets = chain_segments.whole_sequences(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="w: expected a contiguous torch.float16 tensor .* on a CUDA device"):
        chain_kernels.chain_states(w, w, u, torch.ones(2, 3), offsets)
    with pytest.raises(ValueError, match="w: expected a contiguous torch.float16"):
        chain_kernels.chain_states(w.bfloat16(), w, u, torch.ones(2, 3), offsets)


def test_spec_for_names_the_dims_the_backward_is_built_for():
    assert chain_kernels.spec_for(128, 128) == SPEC
    with pytest.raises(ValueError, match=r"built for \(K, V\) in \[\(128, 128\)\], not K=256, V=256"):
        chain_kernels.spec_for(256, 256)


def test_auto_falls_back_to_the_loops_with_one_warning_where_no_library_can_be_had(monkeypatch):
    tries = []

    def unavailable(spec):
        tries.append(spec)
        raise chain_kernels.ChainKernelError("no nvcc here (test double)")

    monkeypatch.setattr(chain_kernels.LIBRARIES, "get", unavailable)
    monkeypatch.setattr(chunked_torch, "_LIBRARY_FAILURES", {})
    with pytest.warns(RuntimeWarning, match="no nvcc here .* torch loops"):
        assert chunked_torch._chain_library_or_none("auto", 128, 128) is None
    assert chunked_torch._chain_library_or_none("auto", 128, 128) is None   # remembered: no second try, no warning
    with pytest.raises(chain_kernels.ChainKernelError, match="no nvcc"):
        chunked_torch._chain_library_or_none("kernels", 128, 128)
    assert len(tries) == 1


def test_chain_units_are_powers_of_two_per_sequence_and_head():
    grid = chunked_torch.chunk_grid((0, 1, 1, 130, 194, 300), torch.device("cpu"))
    x = torch.randn(grid.num_chunks, 3, 64, 8) * 1e-7
    x[grid.chunk_sequence == 4] *= 1e9                      # one sequence far larger than the others
    x[:, 2][grid.chunk_sequence == 3] = 0                   # one head of one sequence all zero
    final = torch.randn(grid.num_seqs, 3, 4, 8) * 1e-9
    unit, per_chunk = chunked_torch._chain_units(grid, chunked_torch.tile_amax(x), final)
    assert unit.shape == (5, 3, 1, 1) and per_chunk.shape == (7, 3, 1, 1)
    assert torch.equal(per_chunk, unit[grid.chunk_sequence])
    assert torch.equal(torch.exp2(torch.round(torch.log2(unit))), unit)       # powers of two
    for s in range(5):
        rows = x[grid.chunk_sequence == s]
        peak = torch.maximum(rows.abs().amax(dim=(0, 2, 3)) if len(rows) else torch.zeros(3),
                             final[s].abs().amax(dim=(-2, -1)))
        scaled = peak * unit[s].flatten()
        assert ((scaled >= 1) & (scaled < 2) | (peak == 0)).all(), (s, scaled)
    alone, _ = chunked_torch._chain_units(
        grid, chunked_torch.tile_amax(x * (grid.chunk_sequence == 0)[:, None, None, None]), final)
    assert torch.equal(alone[0], unit[0])                   # a sequence's unit ignores the rest of the batch
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    assert torch.isnan(chunked_torch._chain_units(grid, chunked_torch.tile_amax(bad), None)[0][0, 0]).all()
    assert chunked_torch.tile_amax(x.bfloat16()).dtype == torch.float32     # a 16-bit tile's, exact in fp32
    assert torch.equal(chunked_torch.tile_amax(x.bfloat16()), x.bfloat16().abs().amax(dim=(2, 3)).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_chains_operand_is_the_unit_scaled_input_rounded_once(dtype):
    """chain_operand: unit * x in the operand dtype, contiguous, from a strided view, rounded once
    (as float64 then fp16 would round it), the unit's NaN kept; it is what the chains take for dO."""
    grid = chunked_torch.chunk_grid((0, 64, 192), torch.device("cpu"))
    rows = (torch.randn(192, 3, 16) * 1e-6).to(dtype)      # token rows [T, H, V]
    view = rows.view(3, 64, 3, 16).transpose(1, 2)            # the chunk layout's in-place view
    unit, per_chunk = chunked_torch._chain_units(grid, chunked_torch.tile_amax(view), None, per_chunk_scale=0.125)
    per_chunk = per_chunk.clone()
    per_chunk[2, 1] = float("nan")
    out = chunked_torch.chain_operand(view, per_chunk, torch.float16)
    assert out.dtype == torch.float16 and out.is_contiguous() and out.shape == view.shape
    want = (view.double() * per_chunk.double()).to(torch.float16)
    assert torch.equal(out[~torch.isnan(want)], want[~torch.isnan(want)])
    assert torch.isnan(out[2, 1]).all() and not torch.isnan(out[:2]).any()
    peaks = out.float().abs().amax(dim=(2, 3))               # 0.125 unit |x| in [1, 2): |unit x| in [8, 16)
    assert (peaks[0] >= 8).all() and (peaks[0] < 16).all()   # sequence 0: chunk 0
    assert (peaks[1:].nan_to_num(0).amax(0)[[0, 2]] >= 8).all() and (peaks[1:].nan_to_num(0) < 16).all()


def test_a_failed_library_is_tried_again_once_a_pack_offers_one(tmp_path, monkeypatch):
    """"auto" remembers a failure (one warning), but a library offered afterwards (a pack loaded) is
    tried; an offered file that does not match its sha256 is refused each time it is opened."""
    from flashqla_tune import environment
    from flashqla_tune.backward.kernel_library import LibraryTable

    table = LibraryTable(chain_kernels.KIND)
    monkeypatch.setattr(chain_kernels, "LIBRARIES", table)
    monkeypatch.setattr(chunked_torch, "_LIBRARY_FAILURES", {})

    def no_nvcc(*args, **kwargs):
        raise environment.ToolchainError("no nvcc here (test double)")

    monkeypatch.setattr(table, "cache_entry", no_nvcc)
    with pytest.warns(RuntimeWarning, match="no nvcc here"):
        assert chunked_torch._chain_library_or_none("auto", 128, 128) is None
    assert chunked_torch._chain_library_or_none("auto", 128, 128) is None   # remembered, no second warning
    changed = tmp_path / "chain.so"
    changed.write_bytes(b"not the file the pack recorded")
    chain_kernels.LIBRARIES.offer(chain_kernels.spec_for(128, 128), changed, sha256="0" * 64)
    with pytest.warns(RuntimeWarning, match="does not match the sha256"):
        assert chunked_torch._chain_library_or_none("auto", 128, 128) is None
    assert chunked_torch._chain_library_or_none("auto", 128, 128) is None   # that failure is remembered too
    for _ in range(2):   # still offered: opening it raises every time, never a silent build
        with pytest.raises(chain_kernels.ChainKernelError, match="does not match the sha256"):
            chain_kernels.LIBRARIES.get(chain_kernels.spec_for(128, 128))
