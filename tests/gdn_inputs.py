"""Random GDN inputs for the CPU tests (float64, normalised k so b ||k||^2 stays in [0, 2])."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashqla_tune.measure.accuracy import rel_l2  # re-exported: one relative L2 for every test

__all__ = ["gate_values", "make_inputs", "off_16_byte_boundary", "rel_l2"]


def off_16_byte_boundary(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t, on t's device, that starts one element past a 16-byte boundary: an
    address TMA refuses (runtime.tma_ready, the C++ host path's fallback)."""
    view = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


def make_inputs(B=1, T=100, Hqk=2, Hv=4, K=16, V=8, *, gate="mixed", beta_max=1.0, seed=0,
                cu_seqlens=None, initial_state=False, state_v_first=False, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    if cu_seqlens is not None:
        B, T = 1, cu_seqlens[-1]
    q = F.normalize(torch.randn(B, T, Hqk, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, Hqk, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, Hv, V, generator=gen, dtype=dtype)
    g = gate_values(gate, (B, T, Hv), gen, dtype)
    beta = torch.rand(B, T, Hv, generator=gen, dtype=dtype) * beta_max
    n_seq = B if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = None
    if initial_state:
        shape = (n_seq, Hv, V, K) if state_v_first else (n_seq, Hv, K, V)
        h0 = torch.randn(shape, generator=gen, dtype=dtype)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int64)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu, state_v_first=state_v_first)


def gate_values(kind, shape, gen, dtype=torch.float64):
    """strong: ~-0.7/token; weak: ~-0.003/token; zero: 0; mixed: FlashQLA's logsigmoid(randn)/16
    with every fourth head at zero. Drawn on the generator's device."""
    dev = gen.device
    if kind == "strong":
        return F.logsigmoid(torch.randn(shape, generator=gen, dtype=dtype, device=dev))
    if kind == "weak":
        return -0.003 * torch.rand(shape, generator=gen, dtype=dtype, device=dev)
    if kind == "zero":
        return torch.zeros(shape, dtype=dtype, device=dev)
    if kind == "mixed":
        g = F.logsigmoid(torch.randn(shape, generator=gen, dtype=dtype, device=dev)) / 16
        g[..., ::4] = 0.0
        return g
    raise ValueError(kind)


def float64_tokens(gen, T, hqk, hv, K, V, decay, device):
    """Token-row float64 inputs of one varlen call, drawn from `gen` in this order: q and k
    [T, hqk, K] unit rows, v [T, hv, V] standard normal, g [T, hv] of the `decay` kind (gate_values),
    beta [T, hv] uniform in [0, 1)."""
    f64 = torch.float64
    q = F.normalize(torch.randn(T, hqk, K, generator=gen, device=device, dtype=f64), dim=-1)
    k = F.normalize(torch.randn(T, hqk, K, generator=gen, device=device, dtype=f64), dim=-1)
    v = torch.randn(T, hv, V, generator=gen, device=device, dtype=f64)
    g = gate_values(decay, (T, hv), gen, f64)
    beta = torch.rand(T, hv, generator=gen, device=device, dtype=f64)
    return q, k, v, g, beta
