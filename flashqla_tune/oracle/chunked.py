"""The chunked float64 form of the scalar-gate GDN forward (DESIGN.md, "The math").

Per chunk of C tokens and v-head: gamma = in-chunk cumsum of g, D = diag(e^gamma),
Gamma_ij = e^{gamma_i - gamma_j} (i >= j), A0 = (I + strictly_lower(diag(b) K K^T))^{-1}
(gate-free), then
    W     = V - D K S
    V_new = (Gamma * A0) diag(b) W
    O     = scale (D Q S + (Gamma * Q K^T) V_new)
    S'    = e^{gamma_C} S + K^T diag(e^{gamma_C - gamma}) V_new
and the chunk transition M_c = e^{gamma_C} (I - K^T A0 diag(b) K), so S' = M_c S + S'(S=0).
All tensors here are head-major: q_c, k_c [Hv, L, K], v_c [Hv, L, V], g_c, b_c [Hv, L].
"""
from __future__ import annotations

import torch

from .common import check_shapes, prepare_inputs, sequence_bounds, state_from_kv, state_to_kv

CHUNK = 64


def gate_free_inverse(k_c: torch.Tensor, b_c: torch.Tensor) -> torch.Tensor:
    """A0 = (I + strictly_lower(diag(b) K K^T))^{-1}: k_c [..., L, K], b_c [..., L] -> [..., L, L];
    no exponentials. Any leading dims (heads, chunks), so the PyTorch baseline batches it."""
    L = k_c.shape[-2]
    lower = torch.tril(b_c[..., :, None] * (k_c @ k_c.transpose(-1, -2)), diagonal=-1)
    eye = torch.eye(L, dtype=k_c.dtype, device=k_c.device).expand_as(lower)
    return torch.linalg.solve_triangular(eye + lower, eye, upper=False, unitriangular=True)


def decay_mask(gamma: torch.Tensor) -> torch.Tensor:
    """Gamma_ij = e^{gamma_i - gamma_j} for i >= j, else 0: gamma [..., L] -> [..., L, L]."""
    diff = gamma[..., :, None] - gamma[..., None, :]
    causal = torch.ones(diff.shape[-2:], dtype=torch.bool, device=gamma.device).tril()
    return torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()


def chunk_step(S, q_c, k_c, v_c, g_c, b_c, scale):
    """One chunk: returns (O [Hv, L, V], S' [Hv, K, V])."""
    gamma = torch.cumsum(g_c, dim=1)
    gamma_last = gamma[:, -1]
    A0 = gate_free_inverse(k_c, b_c)
    Gamma = decay_mask(gamma)
    d = gamma.exp()
    W = v_c - d[:, :, None] * (k_c @ S)
    V_new = (Gamma * A0) @ (b_c[:, :, None] * W)
    O = scale * (d[:, :, None] * (q_c @ S) + (Gamma * (q_c @ k_c.transpose(1, 2))) @ V_new)
    tail = (gamma_last[:, None] - gamma).exp()
    S_next = gamma_last.exp()[:, None, None] * S + k_c.transpose(1, 2) @ (tail[:, :, None] * V_new)
    return O, S_next


def chunk_transition(k_c, g_c, b_c):
    """M_c = e^{gamma_C} (I - K^T A0 diag(b) K), [Hv, K, K]."""
    gamma_last = g_c.sum(dim=1)
    A0 = gate_free_inverse(k_c, b_c)
    K = k_c.shape[-1]
    eye = torch.eye(K, dtype=k_c.dtype, device=k_c.device)
    return gamma_last.exp()[:, None, None] * (eye - k_c.transpose(1, 2) @ A0 @ (b_c[:, :, None] * k_c))


def head_major(q, k, v, g, beta, b, start, end):
    """Slice one sequence out of [B,T,H,...] inputs and put heads first."""
    return (q[b, start:end].transpose(0, 1), k[b, start:end].transpose(0, 1), v[b, start:end].transpose(0, 1),
            g[b, start:end].transpose(0, 1), beta[b, start:end].transpose(0, 1))


def run_chunks(S, q_s, k_s, v_s, g_s, b_s, scale, chunk_size=CHUNK):
    """Run a head-major token range chunk by chunk from state S; returns (O [Hv, L, V], S_end)."""
    outs = []
    for c0 in range(0, v_s.shape[1], chunk_size):
        sl = slice(c0, c0 + chunk_size)
        O, S = chunk_step(S, q_s[:, sl], k_s[:, sl], v_s[:, sl], g_s[:, sl], b_s[:, sl], scale)
        outs.append(O)
    O = torch.cat(outs, dim=1) if outs else v_s.new_zeros(v_s.shape)
    return O, S


def chunk_gated_delta_rule_chunked(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, chunk_size=CHUNK,
):
    """Chunked float64 forward with the op's signature; equals the recurrence to ~1e-12."""
    if g.dim() != 3:
        raise ValueError("the chunked oracle covers the scalar gate only (g [B,T,Hv])")
    n_seq, Hv, K, V = check_shapes(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    o = torch.zeros_like(v)
    finals = []
    for n, (b, start, end) in enumerate(sequence_bounds(v.shape[0], v.shape[1], cu_seqlens)):
        S = (torch.zeros(Hv, K, V, dtype=torch.float64, device=v.device) if initial_state is None
             else state_to_kv(initial_state[n].to(torch.float64), state_v_first))
        O, S = run_chunks(S, *head_major(q, k, v, g, beta, b, start, end), scale, chunk_size)
        o[b, start:end] = O.transpose(0, 1)
        finals.append(S)
    final = state_from_kv(torch.stack(finals), state_v_first) if output_final_state else None
    return o, final
