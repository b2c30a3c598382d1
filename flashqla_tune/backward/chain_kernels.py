"""The backward's sequential chains on Hopper: csrc/gdn_bwd_chain.cuh through templates/gdn_bwd_chain.cu.j2.

Two directions of one kernel family, for the batched PyTorch backward (chunked_torch) to call on
CUDA devices in place of its two loops over chunk positions:

- `chain_states`: every chunk's incoming state S_c (and the new values Vn = u - w S_c),
  S_{c+1} = e^{gamma_C} S_c + Kd^T Vn, from h0 or zeros;
- `chain_gradients`: every chunk's end-state gradient dS_{c+1} (and dVn = scale P^T dO + Kd dS_{c+1}),
  dS_c = e^{gamma_C} dS_{c+1} + (D Q)^T (scale dO) - w^T dVn, from dht or zeros, ending at dh0.

Their inputs are the batched part's per-chunk tensors in its padded chunk layout [chunks, Hv, 64, D]
(pad rows zero): w, Kd, D Q and dO as the 16-bit wgmma operands (the scale split between the last two) (`OPERAND_DTYPE`,
fp16 by default: three more mantissa bits than bf16; chunked_torch hands each chain its inputs
scaled by a power of two per (sequence, v-head) that takes them near unit magnitude (dO to within
a factor of 4 of it), so a training step's loss scale does not decide
the range; the states themselves, rounded to fp16 as A operands, must stay below 65504 after that
scaling, which normalised k and a decaying gate keep them far from),
u and scale P^T dO in fp32, e^{gamma_C} in fp32. The chains accumulate in fp32; the start and end
states are fp32 [., Hv, K, V] (a state_v_first call's states are transposed outside, by the caller),
and what they store per chunk (the states and values the per-chunk gradients read) is in the
operand dtype, rounded as the wgmma operands that carry it to the chain's next phase are.

A library is built once per ChainSpec with the project's build (ninja driving nvcc, build.py), kept
in the kernel cache under a content-addressed key over the rendered source, every csrc/ header it
includes, the toolchain's versions, the flags and the arch, and opened through ctypes (no PyTorch C++
extension). Launches go on the current stream and never synchronise.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .chain_segments import FIELDS as SEGMENT_FIELDS
from .chain_segments import ChainSegments
from .kernel_library import (CHUNK, ELEMENT_TYPES, BackwardKernelError, LibraryKind, LibrarySpec, LibraryTable,
                             check_tensor, ptr, render_template, spec_json, stream_handle)

TEMPLATE_NAME = "gdn_bwd_chain.cu.j2"
ABI_VERSION = 4      # csrc/gdn_bwd_chain_host.cuh FQT_BWD_CHAIN_ABI_VERSION
STATES, GRADIENTS = 0, 1


class ChainKernelError(BackwardKernelError):
    """The chain kernels cannot be built, loaded or launched here; the message says why."""


@dataclass(frozen=True)
class ChainSpec(LibrarySpec):
    """What one chain library is compiled for: the operand dtype, the head dims, the V columns of a
    CTA (64: one consumer warp group; 128: two) and the stage ring's depth."""
    operand_dtype: str = "float16"
    head_k_dim: int = 128
    head_v_dim: int = 128
    block_v: int = 64
    stages: int = 2

    def __post_init__(self) -> None:
        self._check_operand_dtype()
        if self.head_k_dim % 64 or not 64 <= self.head_k_dim <= 256:
            raise ValueError(f"ChainSpec.head_k_dim={self.head_k_dim} must be 64, 128, 192 or 256")
        if self.block_v not in (64, 128) or self.head_v_dim % self.block_v or self.head_v_dim <= 0:
            raise ValueError(f"ChainSpec.block_v={self.block_v} must be 64 or 128 and divide "
                             f"head_v_dim={self.head_v_dim}")
        if not 1 <= self.stages <= 4:
            raise ValueError(f"ChainSpec.stages={self.stages} must be 1 to 4")

    @property
    def name(self) -> str:
        return (f"gdn_bwd_chain_{self.operand_dtype}_k{self.head_k_dim}_v{self.head_v_dim}"
                f"_bv{self.block_v}_s{self.stages}")


OPERAND_DTYPE = "float16"
# The head dims (K, V) whose chain library the backward uses: built and checked for spills and
# shared memory here, and run against the float64 loops on the H200. Other dims ChainSpec takes
# (K up to 256) compile, but at K = 256 two stages exceed the shared memory and one spills.
BACKWARD_DIMS = frozenset({(128, 128)})


def spec_for(head_k_dim: int, head_v_dim: int) -> ChainSpec:
    """The chain library the backward uses for these head dims; ValueError for dims outside
    BACKWARD_DIMS."""
    if (head_k_dim, head_v_dim) not in BACKWARD_DIMS:
        raise ValueError(f"the backward's chain kernels are built for (K, V) in {sorted(BACKWARD_DIMS)}, "
                         f"not K={head_k_dim}, V={head_v_dim}")
    return ChainSpec(OPERAND_DTYPE, head_k_dim, head_v_dim)


def render_source(spec: ChainSpec) -> str:
    """The .cu text of a chain library (the template only fixes constants)."""
    return render_template(
        TEMPLATE_NAME, name=spec.name, abi_version=ABI_VERSION, spec_json=spec_json(spec),
        element_type=ELEMENT_TYPES[spec.operand_dtype],
        head_k_dim=spec.head_k_dim, head_v_dim=spec.head_v_dim, block_v=spec.block_v, stages=spec.stages)


# ---------------------------------------------------------------- build, cache and open

class ChainArgs(ctypes.Structure):
    """ctypes mirror of FqtBwdChainArgs (csrc/gdn_bwd_chain_host.cuh); the library reports its size."""
    _fields_ = [
        ("direction", ctypes.c_int32), ("num_heads", ctypes.c_int32),
        ("num_chunks", ctypes.c_int64), ("num_seqs", ctypes.c_int64), ("num_segments", ctypes.c_int64),
        ("log_eps", ctypes.c_float), ("reserved", ctypes.c_int32),
        ("w", ctypes.c_void_p), ("kd", ctypes.c_void_p), ("qd", ctypes.c_void_p), ("dout", ctypes.c_void_p),
        ("add", ctypes.c_void_p), ("add_scale", ctypes.c_void_p), ("decay", ctypes.c_void_p), ("segments", ctypes.c_void_p),
        ("warmup", ctypes.c_void_p), ("window_log_decay", ctypes.c_void_p),
        ("state_in", ctypes.c_void_p), ("state_out", ctypes.c_void_p),
        ("chunk_states", ctypes.c_void_p), ("chunk_values", ctypes.c_void_p),
    ]


KIND = LibraryKind("fqt_bwd_chain", "the backward's chain kernels", ABI_VERSION, ChainArgs, ChainKernelError,
                   render_source)
LIBRARIES = LibraryTable(KIND)   # this process's chain libraries: get(spec), offer, register, open, cache_entry


# ---------------------------------------------------------------- launches on torch tensors

def add_tiles(x: torch.Tensor, block_v: int) -> torch.Tensor:
    """[chunks, Hv, 64, V] fp32 -> the kernels' [chunks, Hv, V / block_v, 64, block_v] tiles."""
    NC, Hv, C, V = x.shape
    return x.reshape(NC, Hv, C, V // block_v, block_v).transpose(2, 3).contiguous()


def from_add_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """add_tiles' inverse: [chunks, Hv, V / block_v, 64, block_v] -> [chunks, Hv, 64, V] (a copy)."""
    NC, Hv, n, C, bv = tiles.shape
    return tiles.transpose(2, 3).reshape(NC, Hv, C, n * bv)


def _add_operand(add: torch.Tensor, block_v: int, shape: tuple, device) -> torch.Tensor:
    """The fp32 term of phase 1 as the kernels read it: [chunks, Hv, 64, V] (tiled here, a copy) or
    already tiled (add_tiles' layout, contiguous: the prep kernel writes it so)."""
    NC, Hv, C, V = shape
    if add.dim() == 5:
        check_tensor("add", add, (NC, Hv, V // block_v, C, block_v), torch.float32, device)
        return add
    check_tensor("add", add, shape, torch.float32, device)
    return add_tiles(add, block_v)


def _run(direction: int, *, w, kd, add, add_scale, decay, segments, window_log_decay, state_in, values, qd=None,
         dout=None, out=None):
    NC, Hv, C, K = w.shape
    V = add.shape[-1] * (add.shape[2] if add.dim() == 5 else 1)
    if not isinstance(segments, ChainSegments):
        raise TypeError(f"segments must be chain_segments.ChainSegments, got {type(segments).__name__}")
    N, S = segments.num_seqs, segments.num_segments
    spec = spec_for(K, V)
    op = spec.torch_dtype
    if C != CHUNK:
        raise ValueError(f"chunk layout rows must be {CHUNK}, got {C}")
    dev = w.device
    check_tensor("w", w, (NC, Hv, C, K), op)
    check_tensor("kd", kd, (NC, Hv, C, K), op, dev)
    check_tensor("decay", decay, (NC, Hv), torch.float32, dev)
    if add_scale is not None:
        check_tensor("add_scale", add_scale, (NC, Hv), torch.float32, dev)
    check_tensor("segments", segments.table, (S, SEGMENT_FIELDS), torch.int64, dev)
    if S < N:
        raise ValueError(f"{S} segments for {N} sequences: every sequence needs one")
    if segments.splits:
        check_tensor("warmup", segments.warmup, (Hv,), torch.int32, dev)
        if window_log_decay is None:
            raise ValueError("a split (segments with warm-up windows) needs window_log_decay, the guard's input")
        check_tensor("window_log_decay", window_log_decay, (NC, Hv), torch.float32, dev)
        if not segments.log_eps < 0.0:
            raise ValueError(f"log_eps={segments.log_eps} must be negative (eps < 1)")
    if direction == GRADIENTS:
        check_tensor("qd", qd, (NC, Hv, C, K), op, dev)
        check_tensor("dout", dout, (NC, Hv, C, V), op, dev)
    if state_in is not None:
        check_tensor("state_in", state_in, (N, Hv, K, V), torch.float32, dev)
    if NC * Hv * CHUNK >= 2 ** 31:
        raise ValueError(f"{NC} chunks x {Hv} heads x {CHUNK} rows = {NC * Hv * CHUNK} rows: the chain kernels' TMA "
                         f"coordinates are int32 (fewer than 2^31 rows); split the batch")
    tiles = _add_operand(add, spec.block_v, (NC, Hv, C, V), dev)
    if out is None:
        chunk_states = torch.empty(NC, Hv, K, V, dtype=op, device=dev)
        chunk_values = torch.empty(NC, Hv, C, V, dtype=op, device=dev) if values else None
        state_out = torch.empty(N, Hv, K, V, dtype=torch.float32, device=dev)
    else:  # the caller's buffers (tests pass NaN-filled ones to see that every element is written)
        chunk_states, chunk_values, state_out = out
        check_tensor("out chunk_states", chunk_states, (NC, Hv, K, V), op, dev)
        if chunk_values is not None:
            check_tensor("out chunk_values", chunk_values, (NC, Hv, C, V), op, dev)
        check_tensor("out state", state_out, (N, Hv, K, V), torch.float32, dev)
    split = segments.splits
    args = ChainArgs(direction=direction, num_heads=Hv, num_chunks=NC, num_seqs=N, num_segments=S,
                     log_eps=segments.log_eps if split else 0.0, reserved=0, w=ptr(w), kd=ptr(kd),
                     qd=ptr(qd), dout=ptr(dout), add=ptr(tiles), add_scale=ptr(add_scale), decay=ptr(decay), segments=ptr(segments.table),
                     warmup=ptr(segments.warmup) if split else None,
                     window_log_decay=ptr(window_log_decay) if split else None,
                     state_in=ptr(state_in), state_out=ptr(state_out),
                     chunk_states=ptr(chunk_states), chunk_values=ptr(chunk_values))
    lib = LIBRARIES.get(spec)
    with torch.cuda.device(dev):  # the launch goes to the current device: make it the tensors'
        lib.launch(args, stream_handle(dev))
    return chunk_states, chunk_values, state_out


def chain_states(w, kd, u, decay, segments, h0=None, values=True, out=None, window_log_decay=None, u_scale=None):
    """The forward chain over every sequence's chunks, on the device's current stream.

    w, kd [chunks, Hv, 64, K] in the operand dtype; u [chunks, Hv, 64, V] fp32, or its add_tiles
    layout; u_scale [chunks, Hv] fp32 or None: the chain runs on u times it per chunk; decay (e^{gamma_C})
    [chunks, Hv] fp32; segments (chain_segments.ChainSegments, on the device) what the CTAs walk:
    whole_sequences(chunk_offsets), or split_sequences(...) with window_log_decay [chunks, Hv] fp32
    (chain_segments.window_log_decay) for the guard; h0 fp32 [N, Hv, K, V] or None (zeros).
    Returns (S_c [chunks, Hv, K, V], Vn [chunks, Hv, 64, V] or None, in the operand dtype; final state
    [N, Hv, K, V] fp32), written into `out` (those three buffers) when given."""
    return _run(STATES, w=w, kd=kd, add=u, add_scale=u_scale, decay=decay, segments=segments, window_log_decay=window_log_decay,
                state_in=h0, values=values, out=out)


def chain_gradients(w, kd, qd, dout, ptdo, decay, segments, dht=None, values=True, out=None, window_log_decay=None,
                    ptdo_scale=None):
    """The reverse chain of the state gradient, on the device's current stream.

    w, kd, qd [chunks, Hv, 64, K] and dout [chunks, Hv, 64, V] in the operand dtype, qd^T dout being
    (D Q)^T scale dO (the backward passes m D Q and 2^e dO for scale m 2^e: chunked_torch.split_scale);
    ptdo (scale P^T dO) [chunks, Hv, 64, V] fp32 or its add_tiles layout, taken times ptdo_scale
    [chunks, Hv] fp32 per chunk where given (qd^T dout must then carry the same factor); decay, segments, window_log_decay as for chain_states; dht fp32
    [N, Hv, K, V] or None (zeros). Returns (dS_{c+1} [chunks, Hv, K, V], dVn [chunks, Hv, 64, V] or
    None, in the operand dtype; dh0 [N, Hv, K, V] fp32), written into `out` when given."""
    return _run(GRADIENTS, w=w, kd=kd, add=ptdo, add_scale=ptdo_scale, decay=decay, segments=segments, window_log_decay=window_log_decay,
                state_in=dht, values=values, qd=qd, dout=dout, out=out)


__all__ = ["ABI_VERSION", "ChainArgs", "ChainKernelError", "ChainSpec", "KIND", "LIBRARIES", "OPERAND_DTYPE",
           "add_tiles", "chain_gradients", "from_add_tiles", "chain_states", "render_source", "spec_for"]
