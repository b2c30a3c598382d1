"""Test doubles for the peers' packages (flashinfer, cudnn), for machines without them or without a
GPU. Each computes the recurrence with the repository's float32 chunked PyTorch algorithm in the
library's own conventions (packed [T, H, D] tensors, V-major [N, H, V, K] state; FlashInfer's gate
the decay alpha = exp(g), cuDNN's the log-decay g), checks the arguments the way the library
documents them, and records every call, so a test sees what the adapter hands over."""
from __future__ import annotations

import sys
import types

import torch

from flashqla_tune.measure.torch_chunked import chunk_gated_delta_rule_torch


def _reference(q, k, v, log_g, beta, scale, initial_state_vk, output_final_state, cu_seqlens):
    """[T, H, D] inputs, V-major state in and out -> (o [T, Hv, V], state [N, Hv, V, K] or None)."""
    h0 = None if initial_state_vk is None else initial_state_vk.transpose(-1, -2)
    cu = cu_seqlens.to(torch.int64)
    o, s = chunk_gated_delta_rule_torch(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), log_g.unsqueeze(0), beta.unsqueeze(0), scale=scale,
        initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    return o[0], (s.transpose(-1, -2).contiguous() if output_final_state else None)


def _check_packed(q, k, v, g, beta, cu_seqlens):
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.dim() == 3 and t.is_contiguous(), f"{name} must be a contiguous [T, H, D] tensor"
    for name, t in (("g", g), ("beta", beta)):
        assert t.dtype == torch.float32 and t.shape == (q.shape[0], v.shape[1]) and t.is_contiguous(), name
    assert cu_seqlens.dtype in (torch.int32, torch.int64) and cu_seqlens.dim() == 1


class FlashInferDouble:
    """flashinfer.gdn_prefill.chunk_gated_delta_rule's contract (its 0.7.2 docstring and SM90
    wrapper): g is the decay alpha in (0, 1], state V-major float32, output [T, max(Hq, Hv), V]."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                 cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend="auto", use_cp="auto", **rest):
        assert not rest, f"unexpected arguments {sorted(rest)}"
        _check_packed(q, k, v, g, beta, cu_seqlens)
        assert bool((g > 0).all() and (g <= 1).all()), "FlashInfer reads the decay itself, not its logarithm"
        if initial_state is not None:
            assert initial_state.is_contiguous() and initial_state.dtype == torch.float32
        self.calls.append(dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                               cu_seqlens=cu_seqlens, backend=backend, use_cp=use_cp,
                               output_final_state=output_final_state))
        o, s = _reference(q, k, v, g.log(), beta, scale, initial_state, output_final_state, cu_seqlens)
        return (o, s) if output_final_state else o


class CudnnDouble:
    """cudnn.linear_attention.gated_delta_net's contract (cuDNN frontend 1.32): log-domain g,
    cu_seqlens int32 for the cuTile engine, (o, final_state) with an empty state when not asked.
    decline: a message to raise instead, as an engine that declines the graph does."""

    def __init__(self, decline: str | None = None):
        self.decline, self.calls = decline, []

    def __call__(self, q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False):
        if self.decline:
            raise NotImplementedError(self.decline)
        _check_packed(q, k, v, g, beta, cu_seqlens)
        assert cu_seqlens.dtype == torch.int32
        self.calls.append(dict(g=g, initial_state=initial_state, cu_seqlens=cu_seqlens))
        o, s = _reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
        return o, (s if output_final_state else q.new_empty(0))


def install_flashinfer(monkeypatch, sm90_kernels: bool = True) -> FlashInferDouble:
    """Registers the double as flashinfer (flashinfer.gdn_prefill, flashinfer.gdn_kernels) in
    sys.modules. sm90_kernels=False leaves the SM90 kernel entries None, as FlashInfer's package
    init does when their modules fail to import; flashinfer.gdn_kernels.delta_rule_dsl then fails
    to import with the error a missing CuTe DSL gives."""
    double = FlashInferDouble()
    root = types.ModuleType("flashinfer")
    root.__version__ = "0.0-test-double"
    root.__path__ = []
    prefill = types.ModuleType("flashinfer.gdn_prefill")
    prefill.chunk_gated_delta_rule = double
    kernels = types.ModuleType("flashinfer.gdn_kernels")
    kernels.__path__ = []
    kernels.chunk_gated_delta_rule_sm90 = kernels.cp_delta_rule_dsl_sm90 = (object() if sm90_kernels else None)
    root.gdn_prefill, root.gdn_kernels = prefill, kernels
    for name, module in (("flashinfer", root), ("flashinfer.gdn_prefill", prefill),
                         ("flashinfer.gdn_kernels", kernels)):
        monkeypatch.setitem(sys.modules, name, module)
    if not sm90_kernels:
        monkeypatch.setitem(sys.modules, "flashinfer.gdn_kernels.delta_rule_dsl", None)
    return double


def install_cudnn(monkeypatch, decline: str | None = None) -> CudnnDouble:
    """Registers the double as cudnn (cudnn.linear_attention) in sys.modules."""
    double = CudnnDouble(decline)
    root = types.ModuleType("cudnn")
    root.__version__ = "0.0-test-double"
    root.__path__ = []
    la = types.ModuleType("cudnn.linear_attention")
    la.gated_delta_net = double
    root.linear_attention = la
    monkeypatch.setitem(sys.modules, "cudnn", root)
    monkeypatch.setitem(sys.modules, "cudnn.linear_attention", la)
    return double
