"""Float64 gradients of the token recurrence: the ground truth every GDN backward is checked against.

torch autograd differentiates recurrent_gated_delta_rule (written out of place for this) in
float64, so each gradient is exact to rounding whatever the shapes: q/k heads shared by several
v-heads (GVA) get the sum over those v-heads, use_qk_l2norm_in_kernel is differentiated through
the normalisation, and varlen calls with empty or one-token sequences need no special case.
Rows past cu_seqlens[-1] belong to no sequence: their gradients are zero.

form="chunked" differentiates the chunked float64 forward (oracle.chunked, gate-free A0) instead:
the same function to ~1e-12, a different algorithm from the token loop and from any backward
under test, and far fewer autograd nodes, so long GPU cases take seconds instead of minutes.
It covers the scalar gate only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .chunked import chunk_gated_delta_rule_chunked
from .recurrent import recurrent_gated_delta_rule

FORWARDS = {"recurrent": recurrent_gated_delta_rule, "chunked": chunk_gated_delta_rule_chunked}


@dataclass
class OracleGradients:
    """Float64 gradients with the inputs' shapes (dh0 None without an initial state), and the
    forward's o and final state they were taken at."""
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor | None
    o: torch.Tensor
    final_state: torch.Tensor


def recurrent_gated_delta_rule_gradients(
    q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, use_qk_l2norm_in_kernel=False,
    state_v_first=False, cu_seqlens=None, form="recurrent",
) -> OracleGradients:
    """Gradients of  <o, do> + <final_state, dht>  w.r.t. q, k, v, g, beta and initial_state.

    do is [B,T,Hv,V]; dht (optional) is the final state's gradient in the state layout
    (state_v_first as for initial_state). All inputs are taken as exact values and upcast to
    float64; the scalar gate (g [B,T,Hv]) and the per-key gate (g [B,T,Hv,K]) alike (form
    "recurrent"; "chunked" takes the scalar gate only)."""
    if form not in FORWARDS:
        raise ValueError(f"form={form!r}: one of {sorted(FORWARDS)}")
    leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.detach().to(torch.float64).requires_grad_(True)
    with torch.enable_grad():
        o, final = FORWARDS[form](
            *leaves, scale=scale, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first, cu_seqlens=cu_seqlens)
        if tuple(do.shape) != tuple(o.shape):
            raise ValueError(f"do shape {tuple(do.shape)}, expected o's {tuple(o.shape)}")
        loss = (o * do.to(torch.float64)).sum()
        if dht is not None:
            if tuple(dht.shape) != tuple(final.shape):
                raise ValueError(f"dht shape {tuple(dht.shape)}, expected the final state's {tuple(final.shape)}")
            loss = loss + (final * dht.to(torch.float64)).sum()
        wrt = leaves + ([h0] if h0 is not None else [])
        grads = torch.autograd.grad(loss, wrt, allow_unused=True, materialize_grads=True)
    dq, dk, dv, dg, dbeta = grads[:5]
    return OracleGradients(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dh0=grads[5] if h0 is not None else None,
                           o=o.detach(), final_state=final.detach())
