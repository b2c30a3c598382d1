"""Autograd of the GDN custom op: flashqla_tune.ops registers setup_context and backward on its
flashqla_tune::gdn_fwd; the backward calls the custom op flashqla_tune::gdn_bwd defined here.

The forward saves its inputs only (q, k, v, g, beta, the offsets, the initial state); the
backward recomputes the chunk states from them (chunked_torch's algorithm). gdn_bwd is a custom
op with a fake implementation, so torch.compile traces forward and backward as two opaque calls
without a graph break. Its implementation is the chunked backward (chunked_torch, fp32 math): on
CUDA its two sequential chains run as the Hopper chain kernels (chain_kernels), the rest as batched
torch work. Its own autograd raises: double backward is not supported.
"""
from __future__ import annotations

import torch

from .chunked_torch import chunk_gated_delta_rule_bwd_torch

DOUBLE_BACKWARD_ERROR = (
    "double backward through flashqla_tune's GDN op (flashqla_tune::gdn_fwd) is not supported: its backward "
    "(flashqla_tune::gdn_bwd) is not differentiable; take first-order gradients only (create_graph=False)")

# The positions of gdn_fwd's arguments (ops.gdn_fwd_impl's order) that get a gradient
_FWD_ARGS = 16
_DQ, _DK, _DV, _DG, _DBETA, _DH0 = 0, 1, 2, 3, 4, 6


def gdn_bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None, do: torch.Tensor,
                 dht: torch.Tensor | None, scale: float, use_qk_l2norm: bool, state_v_first: bool,
                 plan_name: str, warmup: list[int] | None, warmup_eps: float,
                 sequence_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor, torch.Tensor]:
    """Packed inputs ([1, T, H, D], int64 offsets) and the gradients of o and of the final state ->
    (dq, dk, dv, dg, dbeta, dh0), each in its input's dtype; dh0 is an empty tensor without an
    initial state (a custom op returns tensors only). plan_name, warmup and warmup_eps are the
    forward call's (gdn_fwd's): the chains split long sequences as its CP does. sequence_tokens:
    the forward call's too, the length every sequence has where its host knew it to be one multiple
    of 64 (ops.uniform_sequence_tokens), else 0."""
    grads = chunk_gated_delta_rule_bwd_torch(
        q, k, v, g, beta, do, dht=dht, scale=scale, initial_state=initial_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cp=forward_tables(q, v, state_v_first, plan_name, warmup, warmup_eps), sequence_tokens=sequence_tokens)
    dh0 = grads.dh0 if grads.dh0 is not None else q.new_empty((0,), dtype=torch.float32)
    return grads.dq, grads.dk, grads.dv, grads.dg.to(g.dtype), grads.dbeta, dh0


def forward_tables(q, v, state_v_first: bool, plan_name: str, warmup: list[int] | None, warmup_eps: float):
    """The warm-up tables (warmup_tables.WarmupTables) the forward call used, which the forward's call
    cached already; None where it chained every sequence exactly, or off CUDA (the torch loops)."""
    if warmup is None or q.device.type != "cuda":
        return None
    from .. import ops, warmup_tables  # ops imports this module

    bound = ops.BoundCall(ops.call_spec(q, v, state_v_first), plan_name, tuple(warmup), float(warmup_eps))
    return warmup_tables.tables_for(bound.warmup, bound.plan, q.device, bound.warmup_eps, bound.segment_lengths)


_gdn_bwd_op = torch.library.custom_op("flashqla_tune::gdn_bwd", mutates_args=())(gdn_bwd_impl)


@_gdn_bwd_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, do, dht, scale, use_qk_l2norm, state_v_first, plan_name, warmup,
      warmup_eps, sequence_tokens):
    # contiguous, as the implementation returns them, whatever the inputs' strides
    dh0 = (initial_state.new_empty(initial_state.shape) if initial_state is not None
           else q.new_empty((0,), dtype=torch.float32))
    return tuple(t.new_empty(t.shape) for t in (q, k, v, g, beta)) + (dh0,)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(DOUBLE_BACKWARD_ERROR)


_gdn_bwd_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def setup_context(ctx, inputs, output) -> None:
    """gdn_fwd's inputs (ops.gdn_fwd_impl's order) -> what the backward needs: the tensors, the scale,
    the flags, the call's plan and warm-up table (its CP split) and what its host knew of the
    sequences' lengths; nothing of the forward's outputs."""
    (q, k, v, g, beta, cu_seqlens, initial_state, scale, _output_final_state, use_qk_l2norm, state_v_first,
     plan_name, warmup, warmup_eps, _longest_tokens, sequence_tokens) = inputs
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state)
    ctx.scale, ctx.use_qk_l2norm, ctx.state_v_first = float(scale), bool(use_qk_l2norm), bool(state_v_first)
    ctx.plan_name, ctx.warmup, ctx.warmup_eps = plan_name, None if warmup is None else list(warmup), float(warmup_eps)
    ctx.sequence_tokens = int(sequence_tokens)


def backward(ctx, do, dfinal):
    """Gradients of gdn_fwd's 16 inputs from those of (o, final_state); a final state that was not
    asked for is an empty tensor, and so is its gradient."""
    q, k, v, g, beta, cu_seqlens, initial_state = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dht = dfinal if dfinal is not None and dfinal.numel() else None
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.flashqla_tune.gdn_bwd(
        q, k, v, g, beta, cu_seqlens, initial_state, do, dht, ctx.scale, ctx.use_qk_l2norm, ctx.state_v_first,
        ctx.plan_name, ctx.warmup, ctx.warmup_eps, ctx.sequence_tokens)
    grads = [None] * _FWD_ARGS
    grads[_DQ], grads[_DK], grads[_DV], grads[_DG], grads[_DBETA] = dq, dk, dv, dg, dbeta
    if initial_state is not None:
        grads[_DH0] = dh0
    return tuple(grads)
