"""Shared plumbing for the float64 oracles: sequence slicing, GVA head mapping, state layouts."""
from __future__ import annotations

import torch


def sequence_bounds(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch_index, start, end) for every sequence; varlen requires batch == 1."""
    if cu_seqlens is None:
        return [(b, 0, seq_len) for b in range(batch)]
    if batch != 1:
        raise ValueError(f"varlen (cu_seqlens given) needs batch size 1, got {batch}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def expand_qk_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[..., Hqk, D] -> [..., Hv, D]: v-head h reads q/k head h // (Hv / Hqk)."""
    num_qk_heads = x.shape[-2]
    if num_v_heads % num_qk_heads:
        raise ValueError(f"Hv={num_v_heads} is not a multiple of Hqk={num_qk_heads}")
    return x.repeat_interleave(num_v_heads // num_qk_heads, dim=-2)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's in-kernel normalisation: x / sqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def state_to_kv(state: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    return state.transpose(-1, -2) if state_v_first else state


def state_from_kv(state: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    return state.transpose(-1, -2) if state_v_first else state


def prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """Upcast to float64, normalise q/k if asked, and expand q/k to the v-heads."""
    num_v_heads = v.shape[2]
    q, k, v, g, beta = (t.to(torch.float64) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    q, k = expand_qk_heads(q, num_v_heads), expand_qk_heads(k, num_v_heads)
    if scale is None:
        scale = k.shape[-1] ** -0.5
    return q, k, v, g, beta, scale


def check_shapes(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, per_key_gate=False):
    B, T, Hqk, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != q shape {tuple(q.shape)}")
    if v.shape[:2] != (B, T) or v.shape[2] % Hqk:
        raise ValueError(f"v shape {tuple(v.shape)} does not fit q shape {tuple(q.shape)}")
    Hv, V = v.shape[2], v.shape[3]
    want_g = (B, T, Hv, K) if per_key_gate else (B, T, Hv)
    if tuple(g.shape) != want_g:
        raise ValueError(f"g shape {tuple(g.shape)}, expected {want_g}")
    if tuple(beta.shape) != (B, T, Hv):
        raise ValueError(f"beta shape {tuple(beta.shape)}, expected {(B, T, Hv)}")
    n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None:
        want = (n_seq, Hv, V, K) if state_v_first else (n_seq, Hv, K, V)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state shape {tuple(initial_state.shape)}, expected {want}")
    return n_seq, Hv, K, V
