"""The plain-PyTorch baseline: the chunked GDN forward (DESIGN.md, "The math") in fp32 (or
float64) torch on any device. Everything that does not depend on the state (gamma, the gate-free
A0, the decay masks, the intra-chunk products) runs batched over every chunk of every sequence
and head at once; only the state recurrence loops, one step per chunk position, with all
sequences that still have a chunk at that position in lockstep.

No host syncs when cu_seqlens_cpu is given (the chunk layout, backward.chunked_torch's grid,
comes from the host copy and is cached per (lengths, device)), so the whole call can be captured in a CUDA graph."""
from __future__ import annotations

import torch

from ..backward.chunked_torch import chunk_grid, to_chunks
from ..oracle.chunked import CHUNK, decay_mask, gate_free_inverse
from ..oracle.common import l2_normalize


def chunk_gated_delta_rule_torch(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
    compute_dtype=torch.float32,
):
    """The op's signature; o in v's dtype, final state in fp32 (compute_dtype if wider)."""
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (B, T) or Hv % Hqk:
        raise ValueError(f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} do not fit")
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be {(B, T, Hv)}")
    if cu_seqlens is None:
        bounds = tuple(range(0, B * T + 1, T)) if T else (0,) * (B + 1)
    else:
        if B != 1:
            raise ValueError(f"varlen (cu_seqlens given) needs batch size 1, got {B}")
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()  # the only sync
        bounds = tuple(int(x) for x in host.tolist())
        if bounds[0] != 0 or bounds[-1] != T:
            raise ValueError(f"cu_seqlens must run from 0 to T={T}, got {list(bounds)}")
    layout = chunk_grid(bounds, v.device)
    N = layout.num_seqs
    scale = K ** -0.5 if scale is None else scale
    dt = compute_dtype
    group = Hv // Hqk

    def flat(x):  # [B, T, ...] -> [B*T, ...] in the compute dtype
        return x.reshape(B * T, *x.shape[2:]).to(dt)

    qf, kf = flat(q), flat(k)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2_normalize(qf), l2_normalize(kf)
    # v-head h reads q/k head h // group
    qc = to_chunks(qf, layout).repeat_interleave(group, dim=1)  # [NC, Hv, C, K]
    kc = to_chunks(kf, layout).repeat_interleave(group, dim=1)
    vc = to_chunks(flat(v), layout)  # [NC, Hv, C, V]
    gc = to_chunks(flat(g), layout)  # [NC, Hv, C]
    bc = to_chunks(flat(beta), layout)

    gamma = gc.cumsum(-1)
    gamma_last = gamma[..., -1]
    Gamma = decay_mask(gamma)
    A0 = gate_free_inverse(kc, bc)  # one triangular solve per chunk and head
    Tmat = (Gamma * A0) * bc[..., None, :]  # (Gamma . A0) diag(b)
    d = gamma.exp()[..., None]
    U = Tmat @ vc  # V_new = U - Wk S
    Wk = Tmat @ (d * kc)
    Qd = d * qc  # O = scale (Qd S + QKm V_new)
    QKm = Gamma * (qc @ kc.transpose(-1, -2))
    Kt = (kc * (gamma_last[..., None] - gamma).exp()[..., None]).transpose(-1, -2)  # [NC, Hv, K, C]
    decay = gamma_last.exp()[..., None, None]
    del gamma, Gamma, A0, Tmat, d, qc, kc, vc, gc, bc

    if initial_state is None:
        S = torch.zeros(N, Hv, K, V, dtype=dt, device=v.device)
    else:
        want = (N, Hv, V, K) if state_v_first else (N, Hv, K, V)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state shape {tuple(initial_state.shape)}, expected {want}")
        S = initial_state.to(dt)
        S = (S.transpose(-1, -2) if state_v_first else S).contiguous().clone()
    O = torch.empty(layout.num_chunks, Hv, CHUNK, V, dtype=dt, device=v.device)
    for seqs, chunks in layout.steps:
        S_in = S if seqs is None else S.index_select(0, seqs)
        V_new = U.index_select(0, chunks) - Wk.index_select(0, chunks) @ S_in
        O_j = Qd.index_select(0, chunks) @ S_in + QKm.index_select(0, chunks) @ V_new
        O.index_copy_(0, chunks, O_j)
        S_out = decay.index_select(0, chunks) * S_in + Kt.index_select(0, chunks) @ V_new
        if seqs is None:
            S = S_out
        else:
            S.index_copy_(0, seqs, S_out)
    o = (scale * O).transpose(1, 2).reshape(layout.num_chunks * CHUNK, Hv, V)[layout.token_slot]
    o = o.view(B, T, Hv, V).to(v.dtype)
    if not output_final_state:
        return o, None
    final = S.transpose(-1, -2) if state_v_first else S
    return o, final.contiguous().to(torch.promote_types(dt, torch.float32))
