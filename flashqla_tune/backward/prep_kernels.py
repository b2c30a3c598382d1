"""The backward's state-independent pieces on Hopper: csrc/gdn_bwd_prep.cuh through templates/gdn_bwd_prep.cu.j2.

One kernel launch computes, for every chunk and v-head, what chunked_torch batches in torch before
its chains: the chain kernels' inputs w, Kd and D Q (in the chains' 16-bit operand dtype), u and
scale P^T dO (fp32, in the tiles the chains read: chain_kernels.add_tiles), e^{gamma_C} and each
tile's largest |dO| and |u| (the chains' units are taken from them), and for the per-chunk
gradients gamma, A = Gamma * A0 and A0 (fp32), all else in the padded chunk layout [chunks, Hv,
64, D]. It reads the chunk layout too: q and k [chunks, Hqk, 64, K] in the operand dtype
(normalised by torch where the op normalises), v and dO [chunks, Hv, 64, V] in the call's dtype,
fp32, fp16 or bf16 (any chunk, head and row strides of whole 16-byte pieces: views of the call's
token rows are read in place), g and beta [chunks, Hv, 64] fp32. The head counts are runtime
values, so one library serves every head configuration of a (K, V).

A library is built once per PrepSpec into the kernel cache beside the chain libraries (the same
renderer protocol, key and checks: chain_kernels) and opened through ctypes; launches go on the
current stream and never synchronise.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from .kernel_library import (CHUNK, ELEMENT_TYPES, BackwardKernelError, LibraryKind, LibrarySpec, LibraryTable,
                             check_pieces, check_tensor, input_dtype_code, ptr, render_template, spec_json,
                             stream_handle)

TEMPLATE_NAME = "gdn_bwd_prep.cu.j2"
ABI_VERSION = 4      # csrc/gdn_bwd_prep_host.cuh FQT_BWD_PREP_ABI_VERSION

class PrepKernelError(BackwardKernelError):
    """The prep kernel cannot be built, loaded or launched here; the message says why."""


@dataclass(frozen=True)
class PrepSpec(LibrarySpec):
    """What one prep library is compiled for: the 16-bit operand dtype (the chains'), the head dims
    and the V tile of the u and P^T dO it writes (the chains' block_v)."""
    operand_dtype: str = "float16"
    head_k_dim: int = 128
    head_v_dim: int = 128
    add_block_v: int = 64

    def __post_init__(self) -> None:
        self._check_operand_dtype()
        if self.head_k_dim != 128:
            raise ValueError(f"PrepSpec.head_k_dim={self.head_k_dim} must be 128 (Q K^T's fp32 tile lives in the q tile)")
        if self.head_v_dim not in (64, 128):
            raise ValueError(f"PrepSpec.head_v_dim={self.head_v_dim} must be 64 or 128")
        if self.add_block_v not in (64, 128) or self.head_v_dim % self.add_block_v:
            raise ValueError(f"PrepSpec.add_block_v={self.add_block_v} must be 64 or 128 and divide "
                             f"head_v_dim={self.head_v_dim}")

    @property
    def name(self) -> str:
        return f"gdn_bwd_prep_{self.operand_dtype}_k{self.head_k_dim}_v{self.head_v_dim}_bv{self.add_block_v}"


def spec_for(head_k_dim: int, head_v_dim: int) -> PrepSpec:
    """The prep library the backward uses beside chain_kernels.spec_for(K, V): its operand dtype and
    V tile, for the dims the chains are built for (ValueError elsewhere)."""
    from . import chain_kernels

    chain = chain_kernels.spec_for(head_k_dim, head_v_dim)
    return PrepSpec(chain.operand_dtype, head_k_dim, head_v_dim, chain.block_v)


def render_source(spec: PrepSpec) -> str:
    """The .cu text of a prep library (the template only fixes constants)."""
    return render_template(
        TEMPLATE_NAME, name=spec.name, abi_version=ABI_VERSION,
        spec_json=spec_json(spec),
        element_type=ELEMENT_TYPES[spec.operand_dtype], head_k_dim=spec.head_k_dim, head_v_dim=spec.head_v_dim,
        add_block_v=spec.add_block_v)


class PrepArgs(ctypes.Structure):
    """ctypes mirror of FqtBwdPrepArgs (csrc/gdn_bwd_prep_host.cuh); the library reports its size."""
    _fields_ = [
        ("num_heads", ctypes.c_int32), ("num_qk_heads", ctypes.c_int32), ("num_chunks", ctypes.c_int64),
        ("dout_scale", ctypes.c_float), ("qd_scale", ctypes.c_float), ("add_block_v", ctypes.c_int32),
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("g", ctypes.c_void_p), ("beta", ctypes.c_void_p),
        ("v", ctypes.c_void_p), ("dout", ctypes.c_void_p),
        ("v_stride", ctypes.c_int64 * 3), ("dout_stride", ctypes.c_int64 * 3), ("vd_dtype", ctypes.c_int32),
        ("w", ctypes.c_void_p), ("kd", ctypes.c_void_p), ("qd", ctypes.c_void_p), ("u", ctypes.c_void_p),
        ("ptdo", ctypes.c_void_p), ("decay", ctypes.c_void_p), ("gamma", ctypes.c_void_p),
        ("a", ctypes.c_void_p), ("a0", ctypes.c_void_p), ("dout_amax", ctypes.c_void_p), ("u_amax", ctypes.c_void_p),
    ]


KIND = LibraryKind("fqt_bwd_prep", "the backward's prep kernel", ABI_VERSION, PrepArgs, PrepKernelError,
                   render_source)
LIBRARIES = LibraryTable(KIND)   # this process's prep libraries: get(spec), offer, register, open, cache_entry


# ---------------------------------------------------------------- the launch on torch tensors

@dataclass
class PrepPieces:
    """The kernel's outputs, [chunks, Hv, ...] in the padded chunk layout."""
    w: torch.Tensor       # operand dtype [., 64, K]: T D K
    kd: torch.Tensor      # operand dtype [., 64, K]: diag(e^{gamma_C - gamma}) K
    qd: torch.Tensor      # operand dtype [., 64, K]: qd_scale D Q
    u: torch.Tensor       # fp32 [chunks, Hv, V / bv, 64, bv] (chain_kernels.add_tiles, bv = add_block_v): T V
    ptdo: torch.Tensor    # fp32, as u: scale P^T dO
    decay: torch.Tensor   # fp32 [chunks, Hv]: e^{gamma_C}
    gamma: torch.Tensor   # fp32 [., 64]
    a: torch.Tensor | None   # fp32 [., 64, 64]: Gamma * A0
    a0: torch.Tensor | None  # fp32 [., 64, 64]: A0
    dout_amax: torch.Tensor  # fp32 [chunks, Hv]: each tile's largest |dO|, the scale not applied (a NaN
                             # is not seen: it is in dO)
    u_amax: torch.Tensor     # fp32 [chunks, Hv]: each tile's largest |u| as stored (a NaN is not seen: it
                             # is in u)


def _check_rows(name: str, t: torch.Tensor, shape: tuple, device, dtype: torch.dtype | None = None) -> None:
    """[chunks, H, 64, D] on `device` of `dtype` (None: fp32, fp16 or bf16), read in 16-byte pieces
    (kernel_library.check_pieces)."""
    if tuple(t.shape) != tuple(shape) or t.device != device or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{name}: expected a tensor of shape {tuple(shape)}{'' if dtype is None else f' of {dtype}'} "
                         f"on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    input_dtype_code(name, t)
    check_pieces(name, t)


def backward_prep(q, k, v, dout, g, beta, dout_scale=1.0, gated_inverse=True, gate_free_inverse=True,
                  out=None, qd_scale=1.0) -> PrepPieces:
    """The state-independent pieces of the backward, one launch on the device's current stream.

    q, k [chunks, Hqk, 64, K] contiguous in the operand dtype (PrepSpec.torch_dtype); v and dout
    (dO) [chunks, Hv, 64, V] of one dtype, fp32, fp16 or bf16, read in place in 16-byte pieces (last
    dim contiguous; views of the call's token rows qualify); g, beta fp32 [chunks, Hv, 64] contiguous;
    all in the padded chunk layout (pad rows zero). dout_scale: the op's scale, folded into ptdo; qd_scale: qd's factor (the backward passes the
    mantissa of the op's scale: chunked_torch.split_scale). gated_inverse / gate_free_inverse:
    whether A and A0 are written. out: a PrepPieces of the caller's buffers (tests pass NaN-filled
    ones to see that every element is written)."""
    NC, Hqk, C, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    spec = spec_for(K, V)
    op = spec.torch_dtype
    if C != CHUNK:
        raise ValueError(f"chunk layout rows must be {CHUNK}, got {C}")
    if Hv % Hqk:
        raise ValueError(f"v-heads {Hv} must be a multiple of q/k heads {Hqk}")
    dev = q.device
    check_tensor("q", q, (NC, Hqk, C, K), op)
    check_tensor("k", k, (NC, Hqk, C, K), op, dev)
    _check_rows("v", v, (NC, Hv, C, V), dev)
    _check_rows("dout", dout, (NC, Hv, C, V), dev, v.dtype)
    check_tensor("g", g, (NC, Hv, C), torch.float32, dev)
    check_tensor("beta", beta, (NC, Hv, C), torch.float32, dev)
    if NC * max(Hqk, Hv) * CHUNK >= 2 ** 31:
        raise ValueError(f"{NC} chunks x {max(Hqk, Hv)} heads x {CHUNK} rows: the prep kernel's TMA coordinates "
                         f"and grid are int32 (fewer than 2^31 rows); split the batch")
    bv = spec.add_block_v
    if not math.isfinite(dout_scale) or not math.isfinite(qd_scale):
        raise ValueError(f"dout_scale={dout_scale} and qd_scale={qd_scale} must be finite")
    shapes = dict(w=(NC, Hv, C, K), kd=(NC, Hv, C, K), qd=(NC, Hv, C, K), u=(NC, Hv, V // bv, C, bv),
                  ptdo=(NC, Hv, V // bv, C, bv),
                  decay=(NC, Hv), gamma=(NC, Hv, C), a=(NC, Hv, C, C), a0=(NC, Hv, C, C), dout_amax=(NC, Hv),
                  u_amax=(NC, Hv))
    dtypes = dict(w=op, kd=op, qd=op)
    wanted = dict(a=gated_inverse, a0=gate_free_inverse)
    if out is None:
        out = PrepPieces(**{n: torch.empty(s, dtype=dtypes.get(n, torch.float32), device=dev)
                            if wanted.get(n, True) else None for n, s in shapes.items()})
    else:
        for n, s in shapes.items():
            t = getattr(out, n)
            if t is None and wanted.get(n, True):
                raise ValueError(f"out.{n} is None but is asked for")
            if t is not None:
                check_tensor(f"out {n}", t, s, dtypes.get(n, torch.float32), dev)
    args = PrepArgs(num_heads=Hv, num_qk_heads=Hqk, num_chunks=NC, dout_scale=float(dout_scale),
                    qd_scale=float(qd_scale), add_block_v=bv,
                    q=ptr(q), k=ptr(k), g=ptr(g), beta=ptr(beta),
                    v=ptr(v), dout=ptr(dout), v_stride=(ctypes.c_int64 * 3)(*v.stride()[:3]),
                    dout_stride=(ctypes.c_int64 * 3)(*dout.stride()[:3]), vd_dtype=input_dtype_code("v", v),
                    **{n: ptr(getattr(out, n) if wanted.get(n, True) else None) for n in shapes})
    lib = LIBRARIES.get(spec)
    with torch.cuda.device(dev):
        lib.launch(args, stream_handle(dev))
    return out


__all__ = ["ABI_VERSION", "KIND", "LIBRARIES", "PrepArgs", "PrepKernelError", "PrepPieces", "PrepSpec",
           "backward_prep", "render_source", "spec_for"]
