"""The backward's per-chunk gradients on Hopper: csrc/gdn_bwd_chunk.cuh through templates/gdn_bwd_chunk.cu.j2.

Step 3 of chunked_torch's backward as one kernel launch: once the chains (chain_kernels) have given
every chunk's incoming state S_c and outgoing state gradient dS_{c+1}, `chunk_gradients` computes,
per (chunk, v-head), dq, dk, dv, dbeta and dg (the reverse cumulative sum over the chunk already
applied), in the padded chunk layout [chunks, H, 64, .], fp32: dq and dk per q/k head, summed over
its v-heads in the kernel, the rest per v-head; through the output buffers' strides: the backward
hands it views of token-major chunks, so that each gradient goes back to token rows in one row
gather.

Its inputs are the batched backward's per-chunk tensors: q and k per q/k head (not repeated over
the v-heads: the kernel reads each v-head's q/k head), v and dO, these four in the call's dtype
(fp32, fp16 or bf16, read in place: views of the call's token rows need no copy); beta, the
in-chunk cumulative gate gamma and A0 = (I + strictly_lower(diag(b) K K^T))^{-1}, all three fp32;
and the chains' results as
the chain kernels return them, still scaled per (sequence, v-head) by chunked_torch._chain_units:
S_c and Vn by unit_u, dS_{c+1} and dVn by unit_d, with those units per chunk. The kernel rounds
everything to 16-bit wgmma operands itself (fp16 by default, `OPERAND_DTYPE`), with dO scaled by
unit_d and q, k, v and A0 each scaled by a power of two of their own tile (csrc/gdn_bwd_chunk.cuh
says why that holds the range); it accumulates in fp32 and returns true (unscaled) gradients.

A library is built once per ChunkSpec through the kernel cache like the chain libraries (same
renderer protocol, its own ABI) and opened through ctypes; launches go on the current stream and
never synchronise.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from . import chain_kernels
from .kernel_library import (CHUNK, ELEMENT_TYPES, BackwardKernelError, LibraryKind, LibrarySpec, LibraryTable,
                             check_pieces, check_tensor, input_dtype_code, ptr, render_template, spec_json,
                             stream_handle)

TEMPLATE_NAME = "gdn_bwd_chunk.cu.j2"
ABI_VERSION = 6      # csrc/gdn_bwd_chunk_host.cuh FQT_BWD_CHUNK_ABI_VERSION


class ChunkKernelError(BackwardKernelError):
    """The per-chunk gradient kernel cannot be built, loaded or launched here; the message says why.
    A BackwardKernelError, which the backward's fallbacks catch."""


@dataclass(frozen=True)
class ChunkSpec(LibrarySpec):
    """What one per-chunk gradient library is compiled for: the operand dtype, the head dims, the
    warp groups of a CTA (two split every GEMM's output columns between them; K = V = 128), and
    whether a CTA walks (walk: one CTA per SM takes (chunk, q/k head) after (chunk, q/k head), each
    its v-heads' tiles in order, and has L2 fetch its next tile's inputs while it computes the current
    one; else one CTA per (chunk, q/k head))."""
    operand_dtype: str = "float16"
    head_k_dim: int = 128
    head_v_dim: int = 128
    warp_groups: int = 2
    walk: bool = False

    def __post_init__(self) -> None:
        self._check_operand_dtype()
        for name in ("head_k_dim", "head_v_dim"):
            if getattr(self, name) not in (64, 128):
                raise ValueError(f"ChunkSpec.{name}={getattr(self, name)} must be 64 or 128 (64 x D fp32 "
                                 f"accumulators of one warp group)")
        if self.warp_groups not in (1, 2):
            raise ValueError(f"ChunkSpec.warp_groups={self.warp_groups!r} must be 1 or 2")
        if not isinstance(self.walk, bool):
            raise ValueError(f"ChunkSpec.walk={self.walk!r} must be a bool")
        if self.walk and self.warp_groups != 2:
            raise ValueError(f"ChunkSpec.walk needs warp_groups=2, not {self.warp_groups}: a one-group CTA that "
                             f"walks tiles spills registers (ptxas, K = V = 128)")
        if self.warp_groups == 2 and (self.head_k_dim, self.head_v_dim) != (128, 128):
            raise ValueError(f"ChunkSpec.warp_groups=2 needs K = V = 128 (each group takes 64 columns, whole "
                             f"swizzle atoms), not K={self.head_k_dim}, V={self.head_v_dim}")

    @property
    def name(self) -> str:
        return (f"gdn_bwd_chunk_{self.operand_dtype}_k{self.head_k_dim}_v{self.head_v_dim}_wg{self.warp_groups}"
                + ("_walk" if self.walk else ""))


OPERAND_DTYPE = "float16"
WARP_GROUPS = 2   # the H200's faster of the two (docs/results/backward-chunk-variants.log)
WALK = True       # CTAs walk the tiles: faster on the H200 (the same log)
# The head dims whose library the backward uses (built and checked for spills, run against float64
# on the H200): the chain kernels'.
BACKWARD_DIMS = chain_kernels.BACKWARD_DIMS


def spec_for(head_k_dim: int, head_v_dim: int) -> ChunkSpec:
    """The library the backward uses for these head dims; ValueError outside BACKWARD_DIMS."""
    if (head_k_dim, head_v_dim) not in BACKWARD_DIMS:
        raise ValueError(f"the backward's per-chunk gradient kernel is built for (K, V) in {sorted(BACKWARD_DIMS)}, "
                         f"not K={head_k_dim}, V={head_v_dim}")
    return ChunkSpec(OPERAND_DTYPE, head_k_dim, head_v_dim, WARP_GROUPS, WALK)


def variants_for(head_k_dim: int, head_v_dim: int) -> dict[str, ChunkSpec]:
    """Every library the kernel can be built as for these head dims, with spec_for's operand dtype,
    by name ("wg1", "wg2": its warp groups a CTA; "-walk": CTAs that walk tiles), spec_for's among
    them: what the GPU tests check against float64 and benchmarks/backward_chunk_variants.py times."""
    spec_for(head_k_dim, head_v_dim)   # ValueError outside BACKWARD_DIMS
    out = {}
    for groups in (1, 2):
        for walk in (False, True):
            try:
                spec = ChunkSpec(OPERAND_DTYPE, head_k_dim, head_v_dim, groups, walk)
            except ValueError:   # a warp-group count (or walk) these dims do not allow
                continue
            out[f"wg{groups}" + ("-walk" if walk else "")] = spec
    return out


def render_source(spec: ChunkSpec) -> str:
    """The .cu text of a library (the template only fixes constants)."""
    return render_template(
        TEMPLATE_NAME, name=spec.name, abi_version=ABI_VERSION, spec_json=spec_json(spec),
        element_type=ELEMENT_TYPES[spec.operand_dtype], head_k_dim=spec.head_k_dim, head_v_dim=spec.head_v_dim,
        warp_groups=spec.warp_groups, walk="true" if spec.walk else "false")


STRIDED = ("q", "k", "v", "dout", "beta", "gamma")  # the inputs read in place through their strides
OUTPUTS = ("dq", "dk", "dv", "dbeta", "dg")          # written through their strides
_Strides = ctypes.c_int64 * 3                        # (chunk, head, row), in elements


class ChunkArgs(ctypes.Structure):
    """ctypes mirror of FqtBwdChunkArgs (csrc/gdn_bwd_chunk_host.cuh); the library reports its size."""
    _fields_ = [
        ("num_heads", ctypes.c_int32), ("num_qk_heads", ctypes.c_int32), ("num_chunks", ctypes.c_int64),
        ("dout_scale", ctypes.c_float), ("qk_dtype", ctypes.c_int32), ("vd_dtype", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in STRIDED),
        *((f"{name}_strides", _Strides) for name in STRIDED),
        *((name, ctypes.c_void_p) for name in (
            "a0", "state", "dstate", "vn", "dvn", "unit_u", "unit_d", *OUTPUTS)),
        *((f"{name}_strides", _Strides) for name in OUTPUTS),
    ]


KIND = LibraryKind("fqt_bwd_chunk", "the backward's per-chunk gradient kernel", ABI_VERSION, ChunkArgs, ChunkKernelError,
                   render_source)
LIBRARIES = LibraryTable(KIND)   # this process's chunk libraries: get(spec), offer, register, open, cache_entry


# ---------------------------------------------------------------- the launch on torch tensors

def _strides(name: str, t: torch.Tensor, shape: tuple, device, write: bool = False,
             dtypes: tuple = (torch.float32,)) -> tuple[int, int, int]:
    """The (chunk, head, row) element strides of a tensor the kernel reads or writes in place (0
    along a dim of size 1): of one of `dtypes` on `device`, non-negative strides; a tile ([chunks,
    H, 64, D]) with contiguous columns, its rows read in 16-byte pieces (kernel_library.check_pieces)
    or written as float2s (write: strides of multiples of 2 elements, an 8-byte aligned start).
    ValueError naming what is wrong."""
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes or not t.is_cuda or t.device != device:
        raise ValueError(f"{name}: expected a {' or '.join(map(str, dtypes))} tensor of shape {tuple(shape)} on "
                         f"{device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    strides = tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride()))
    if min(strides, default=0) < 0:
        raise ValueError(f"{name}: negative strides {t.stride()}")
    if len(shape) == 4 and not write:
        check_pieces(name, t.as_strided(t.shape, strides, t.storage_offset()))
    elif len(shape) == 4 and t.numel() and (strides[3] != 1 or any(s % 2 for s in strides[:3]) or t.data_ptr() % 8):
        raise ValueError(f"{name}: the kernel writes its rows as float2s: it needs contiguous columns, strides "
                         f"(chunk, head, row) of multiples of 2 elements and an 8-byte aligned start, got strides "
                         f"{t.stride()} at {t.data_ptr():#x}")
    return strides[:3]


def _check_no_overlap(name: str, t: torch.Tensor) -> None:
    """An output whose elements are distinct memory (one writer each): ValueError otherwise."""
    reach = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride < reach:
            raise ValueError(f"{name}: its elements overlap in memory (shape {tuple(t.shape)}, strides "
                             f"{t.stride()}); the kernel needs one address per output element")
        reach = stride * size


def chunk_gradients(q, k, v, dout, beta, gamma, a0, state, dstate, vn, dvn, unit_u, unit_d, dout_scale=1.0,
                    out=None, spec: ChunkSpec | None = None):
    """Step 3 of the backward for every (chunk, v-head), on the device's current stream.

    On one CUDA device, in the chunk layout: q, k [chunks, Hqk, 64, K] (Hqk dividing Hv; v-head h
    reads q/k head h // (Hv / Hqk)) of one dtype, v, dout (dO, taken times dout_scale, the op's
    scale) [chunks, Hv, 64, V] of one dtype, each pair fp32, fp16 or bf16; beta, gamma (the
    in-chunk cumulative gate) [chunks, Hv, 64] fp32 -- these six read in place through their
    strides (views of token rows need no copy; _strides says what they must be) --;
    and contiguous fp32: a0 [chunks, Hv, 64, 64]; unit_u, unit_d [chunks, Hv] (powers of two); and in the
    spec's operand dtype, as the chains store them: state (unit_u S_c) and dstate (unit_d dS_{c+1})
    [chunks, Hv, K, V], vn (unit_u Vn) and dvn (unit_d dVn) [chunks, Hv, 64, V].
    Returns (dq [chunks, Hqk, 64, K], dk [chunks, Hqk, 64, K] (each summed over the q/k head's
    v-heads, in v-head order), dv [chunks, Hv, 64, V], dbeta [chunks, Hv, 64], dg [chunks, Hv, 64]),
    fp32 and unscaled, written into `out` (those
    five buffers, of any strides _strides allows for writing, no two elements at one address) when
    given: the backward passes views of token-major chunks ([chunks, 64, Hv, D] in memory). spec: the library to launch (default spec_for(K, V), the backward's;
    a benchmark passes the variants it compares)."""
    NC, Hqk, C, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    if spec is None:
        spec = spec_for(K, V)
    elif (spec.head_k_dim, spec.head_v_dim) != (K, V):
        raise ValueError(f"spec {spec.name} is for K={spec.head_k_dim}, V={spec.head_v_dim}; the inputs have "
                         f"K={K}, V={V}")
    if C != CHUNK:
        raise ValueError(f"chunk layout rows must be {CHUNK}, got {C}")
    if Hv % Hqk:
        raise ValueError(f"the v-heads ({Hv}) must be a multiple of the q/k heads ({Hqk})")
    dev = q.device
    f32 = torch.float32
    if not q.is_cuda:
        raise ValueError(f"q: expected a CUDA tensor, got one on {q.device}")
    strided = dict(q=q, k=k, v=v, dout=dout, beta=beta, gamma=gamma)
    inputs = (torch.float32, torch.float16, torch.bfloat16)
    strides = {name: _strides(name, strided[name], shape, dev, dtypes=dtypes) for name, shape, dtypes in (
        ("q", (NC, Hqk, C, K), inputs), ("k", (NC, Hqk, C, K), (q.dtype,)), ("v", (NC, Hv, C, V), inputs),
        ("dout", (NC, Hv, C, V), (v.dtype,)), ("beta", (NC, Hv, C), (f32,)), ("gamma", (NC, Hv, C), (f32,)))}
    for name, t, shape in (("a0", a0, (NC, Hv, C, C)), ("unit_u", unit_u, (NC, Hv)), ("unit_d", unit_d, (NC, Hv))):
        check_tensor(name, t, shape, f32, dev)
    for name, t, shape in (("state", state, (NC, Hv, K, V)), ("dstate", dstate, (NC, Hv, K, V)),
                           ("vn", vn, (NC, Hv, C, V)), ("dvn", dvn, (NC, Hv, C, V))):
        check_tensor(name, t, shape, spec.torch_dtype, dev)   # the chains' results as they store them
    if NC * Hv >= 2 ** 31:
        raise ValueError(f"{NC} chunks x {Hv} heads = {NC * Hv} tiles: the kernel indexes them in int32 (fewer than 2^31); "
                         f"split the batch")
    shapes = ((NC, Hqk, C, K), (NC, Hqk, C, K), (NC, Hv, C, V), (NC, Hv, C), (NC, Hv, C))
    if out is None:
        out = tuple(torch.empty(shape, dtype=f32, device=dev) for shape in shapes)
    elif len(out) != len(OUTPUTS):
        raise ValueError(f"out: expected {len(OUTPUTS)} buffers {OUTPUTS}, got {len(out)}")
    # the caller's buffers (tests pass NaN-filled ones to see that every element is written)
    out_strides = {}
    for name, t, shape in zip(OUTPUTS, out, shapes):
        out_strides[name] = _strides(f"out {name}", t, shape, dev, write=True)
        _check_no_overlap(f"out {name}", t)
    dq, dk, dv, dbeta, dg = out
    if not math.isfinite(dout_scale):
        raise ValueError(f"dout_scale={dout_scale} must be finite")
    args = ChunkArgs(num_heads=Hv, num_qk_heads=Hqk, num_chunks=NC, dout_scale=float(dout_scale),
                     qk_dtype=input_dtype_code("q", q), vd_dtype=input_dtype_code("v", v),
                     **{name: ptr(t) for name, t in strided.items()},
                     **{f"{name}_strides": _Strides(*strides[name]) for name in STRIDED},
                     a0=ptr(a0), state=ptr(state),
                     dstate=ptr(dstate), vn=ptr(vn), dvn=ptr(dvn), unit_u=ptr(unit_u), unit_d=ptr(unit_d),
                     dq=ptr(dq), dk=ptr(dk), dv=ptr(dv), dbeta=ptr(dbeta), dg=ptr(dg),
                     **{f"{name}_strides": _Strides(*out_strides[name]) for name in OUTPUTS})
    lib = LIBRARIES.get(spec)
    with torch.cuda.device(dev):  # the launch goes to the current device: make it the tensors'
        lib.launch(args, stream_handle(dev))
    return dq, dk, dv, dbeta, dg


__all__ = ["ABI_VERSION", "BACKWARD_DIMS", "ChunkArgs", "ChunkKernelError", "ChunkSpec", "KIND", "LIBRARIES",
           "OPERAND_DTYPE", "WALK", "WARP_GROUPS", "chunk_gradients", "render_source", "spec_for", "variants_for"]
