"""FlashInfer's GDN prefill and cuDNN frontend's GDN, wrapped to the op's signature for the
scoreboard. Both take packed THD tensors ([T, H, D], one varlen batch) and keep the state V-major
([N, H, V, K], float32); FlashInfer reads the decay itself (alpha = exp(g)), cuDNN (by default)
its logarithm g, as the op does.

What each set of protocol inputs needs, made once per input set by `prepare` (outside the timed
call, see impls.call), or in every call when the wrapper is called with the op's arguments:
  - g -> exp(g) (FlashInfer only; float32 [T, Hv])
  - initial_state [N, Hv, K, V] -> [N, Hv, V, K] (a contiguous copy; none with state_v_first)
Free views: q, k, v, g, beta lose the batch dimension of 1 ([1, T, ...] -> [T, ...]); the output
gains it back; the final state comes back as a transposed view of the library's [N, Hv, V, K]
(the op's [N, Hv, K, V] layout in meaning, no copy; untouched with state_v_first).
FlashInfer is called as vLLM calls it: backend="auto", use_cp="auto", no max_seqlen hint."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Prepared:
    """One input set in a peer's conventions: [T, H, D] tensors, its gate, its state layout."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor  # exp(g) for FlashInfer, g for cuDNN
    beta: torch.Tensor
    initial_state: torch.Tensor | None  # [N, Hv, V, K]
    cu_seqlens: torch.Tensor
    scale: float | None
    state_v_first: bool  # the caller's layout: the returned state is transposed back unless set


def _packed(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() < 2 or t.shape[0] != 1:
        raise ValueError(f"{name}: the peers take one varlen batch (batch size 1 with cu_seqlens), "
                         f"got shape {tuple(t.shape)}")
    return t[0]


def prepare(q, k, v, g, beta, scale=None, initial_state=None, state_v_first=False, cu_seqlens=None,
            linear_gate: bool = True) -> Prepared:
    """The op's arguments in a peer's conventions (linear_gate: FlashInfer's alpha = exp(g))."""
    if cu_seqlens is None:
        raise ValueError("the peers are varlen-only: give cu_seqlens")
    g = _packed(g, "g")
    state = initial_state
    if state is not None and not state_v_first:
        state = state.transpose(-1, -2).contiguous()
    return Prepared(q=_packed(q, "q"), k=_packed(k, "k"), v=_packed(v, "v"),
                    gate=g.float().exp() if linear_gate else g, beta=_packed(beta, "beta"),
                    initial_state=state, cu_seqlens=cu_seqlens, scale=scale, state_v_first=state_v_first)


def _finish(p: Prepared, o: torch.Tensor, state: torch.Tensor | None):
    o = o.unsqueeze(0)
    if state is None:
        return o, None
    return o, (state if p.state_v_first else state.transpose(-1, -2))


def flashinfer_native(flashinfer_fn: Callable) -> Callable:
    """run(p, output_final_state, use_qk_l2norm_in_kernel) -> (o, state) on a Prepared set."""
    def run(p: Prepared, output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False):
        out = flashinfer_fn(q=p.q, k=p.k, v=p.v, g=p.gate, beta=p.beta, scale=p.scale,
                            initial_state=p.initial_state, output_final_state=output_final_state,
                            cu_seqlens=p.cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            backend="auto", use_cp="auto")
        o, state = out if output_final_state else (out, None)
        return _finish(p, o, state)
    return run


def cudnn_native(gated_delta_net: Callable) -> Callable:
    """The same for cuDNN frontend's cudnn.linear_attention.gated_delta_net (log-domain gate)."""
    def run(p: Prepared, output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False):
        o, state = gated_delta_net(p.q, p.k, p.v, p.gate, p.beta, p.cu_seqlens, scale=p.scale,
                                   initial_state=p.initial_state, output_final_state=output_final_state,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return _finish(p, o, state if output_final_state else None)
    return run


def op_signature(native: Callable, linear_gate: bool) -> Callable:
    """native wrapped to the op's signature: every conversion happens inside the call."""
    def fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None):
        p = prepare(q, k, v, g, beta, scale, initial_state, state_v_first, cu_seqlens, linear_gate)
        return native(p, output_final_state, use_qk_l2norm_in_kernel)
    return fn


def load_flashinfer():
    """(op-signature fn, native, version). An SM90 kernel module that fails to import is a
    load failure with its own error (FlashInfer's package init swallows it and would fail later,
    in the first call, with "kernel is unavailable")."""
    import flashinfer
    from flashinfer import gdn_kernels
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        if gdn_kernels.chunk_gated_delta_rule_sm90 is None or gdn_kernels.cp_delta_rule_dsl_sm90 is None:
            from flashinfer.gdn_kernels.delta_rule_dsl import delta_rule_cp_sm90, delta_rule_sm90  # noqa: F401
    native = flashinfer_native(chunk_gated_delta_rule)
    return op_signature(native, linear_gate=True), native, getattr(flashinfer, "__version__", None)


def _probe_case(device) -> Prepared:
    """A small input for the probe: one sequence of 64 tokens (one chunk), one head, K = V = 128."""
    gen = torch.Generator(device=device).manual_seed(0)
    kw = dict(device=device, generator=gen)
    qk = torch.nn.functional.normalize(torch.randn(2, 64, 1, 128, **kw), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, 64, 1, 128, **kw).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 64, 1, **kw)) / 16
    beta = torch.sigmoid(torch.randn(1, 64, 1, **kw))
    cu = torch.tensor([0, 64], dtype=torch.int32, device=device)
    return prepare(qk[:1], qk[1:], v, g, beta, 128 ** -0.5, torch.zeros(1, 1, 128, 128, device=device),
                   cu_seqlens=cu, linear_gate=False)


def load_cudnn(device: str = "cuda"):
    """(op-signature fn, native, version) for cuDNN frontend's GDN, after one probe call on the
    device: cuDNN picks its engine when it plans the graph, and every engine may decline a GPU
    (cuDNN frontend 1.32: the FROST engine serves SM100/SM103/SM107 only; the cuTile engine needs
    CUDA runtime 13.3 or later and a tileiras that targets the GPU). A decline is a load failure
    carrying cuDNN's own reason, so the scoreboard lists the column with it."""
    import cudnn
    from cudnn.linear_attention import gated_delta_net

    version = getattr(cudnn, "__version__", None)
    native = cudnn_native(gated_delta_net)
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise RuntimeError("cuDNN's GDN needs a CUDA GPU")
    where = "sm_{}{}".format(*torch.cuda.get_device_capability()) if on_gpu else device
    try:
        native(_probe_case(device), output_final_state=True)
        if on_gpu:
            torch.cuda.synchronize()
    except Exception as exc:
        raise RuntimeError(f"cuDNN frontend {version} GDN does not run on {where} with CUDA runtime "
                           f"{torch.version.cuda}: {type(exc).__name__}: {str(exc)[:400]}") from exc
    return op_signature(native, linear_gate=False), native, version
