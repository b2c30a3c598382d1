"""The token-by-token GDN recurrence in float64: the ground truth everything is checked against.

Scalar gate (GDN):   S_t = e^{g_t} (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T
Per-key gate (KDA):  S_t = (I - b_t k_t k_t^T) Diag(e^{g_t}) S_{t-1} + b_t k_t v_t^T
Output:              o_t = scale * S_t^T q_t

Written with out-of-place torch ops only, so torch autograd differentiates it (the backward
oracle).
"""
from __future__ import annotations

import torch

from .common import check_shapes, prepare_inputs, sequence_bounds, state_from_kv, state_to_kv
from .gates import apply_gate_options


def recurrent_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *, use_gate_in_kernel=False, A_log=None,
    dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
):
    """Returns (o float64 [B,T,Hv,V], final_state float64 [N,Hv,K,V] or [N,Hv,V,K], or None).
    FLA's in-kernel gate and beta options (keyword only) transform g and beta first (gates.py)."""
    g, beta = apply_gate_options(g, beta, A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                                 allow_neg_eigval)
    per_key = g.dim() == 4
    n_seq, Hv, K, V = check_shapes(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, per_key)
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    B, T = v.shape[:2]
    o_rows = [[None] * T for _ in range(B)]
    finals = []
    for n, (b, start, end) in enumerate(sequence_bounds(B, T, cu_seqlens)):
        if initial_state is None:
            S = torch.zeros(Hv, K, V, dtype=torch.float64, device=v.device)
        else:
            S = state_to_kv(initial_state[n].to(torch.float64), state_v_first)
        for t in range(start, end):
            decay = torch.exp(g[b, t])  # [Hv] or [Hv, K]
            S = S * (decay[:, :, None] if per_key else decay[:, None, None])
            kt, qt = k[b, t], q[b, t]                                 # [Hv, K]
            err = v[b, t] - torch.einsum("hkv,hk->hv", S, kt)         # v_t - S^T k_t
            S = S + beta[b, t][:, None, None] * kt[:, :, None] * err[:, None, :]
            o_rows[b][t] = scale * torch.einsum("hkv,hk->hv", S, qt)
        finals.append(S)
    zero = torch.zeros(Hv, V, dtype=torch.float64, device=v.device)
    o = torch.stack([torch.stack([r if r is not None else zero for r in row]) for row in o_rows])
    final = state_from_kv(torch.stack(finals), state_v_first) if output_final_state else None
    return o, final
