"""Accuracy beside speed: each implementation's relative L2 error of o and of the final state
against the chunked algorithm run in float64 on the same device (checked against the float64
token recurrence in the CPU tests), on the protocol's bf16 inputs."""
from __future__ import annotations

import torch

from .impls import Impl, call
from .torch_chunked import chunk_gated_delta_rule_torch


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.to(torch.float64)
    den = ref.norm()
    err = (x.to(torch.float64) - ref).norm()
    return float(err / den) if den > 0 else float(err)


def reference(x) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (o, final state) for a CaseInputs set; the bf16 inputs are taken as exact."""
    o, s = chunk_gated_delta_rule_torch(
        x.q, x.k, x.v.to(torch.float64), x.g, x.beta, scale=x.scale, initial_state=x.initial_state,
        output_final_state=True, cu_seqlens=x.cu_seqlens_long, cu_seqlens_cpu=x.cu_seqlens_cpu,
        compute_dtype=torch.float64)
    return o, s


def measure(impls: list[Impl], x) -> dict[str, dict]:
    """{impl: {"o": err, "state": err} or {"error": why}} on one input set."""
    ref_o, ref_s = reference(x)
    out = {}
    for impl in impls:
        try:
            o, s = call(impl, x)
            out[impl.name] = {"o": rel_l2(o, ref_o), "state": rel_l2(s, ref_s)}
        except Exception as exc:
            out[impl.name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return out
