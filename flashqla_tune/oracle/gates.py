"""FLA's in-kernel gate and beta options in float64: what the oracles apply before the recurrence
when a test runs the op with use_gate_in_kernel, use_beta_sigmoid_in_kernel or allow_neg_eigval.

    use_gate_in_kernel:         g    = -exp(A_log) * softplus(g_raw + dt_bias)   (dt_bias optional)
    use_beta_sigmoid_in_kernel: beta = sigmoid(b_raw)
    allow_neg_eigval:           beta = 2 sigmoid(b_raw), in (0, 2); only with the sigmoid, as in FLA

softplus is FLA's (and torch's default): x above 20 is returned as is, else log(1 + e^x).
"""
from __future__ import annotations

import torch

SOFTPLUS_THRESHOLD = 20.0


def softplus(x: torch.Tensor) -> torch.Tensor:
    """FLA's softplus: x where x > 20, else log(1 + e^x) (log1p: exact in float64 for very negative x)."""
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(torch.clamp(x, max=SOFTPLUS_THRESHOLD))))


def fla_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """g [..., Hv] = -exp(A_log) * softplus(g_raw + dt_bias), in float64."""
    x = g_raw.to(torch.float64)
    if dt_bias is not None:
        x = x + dt_bias.to(torch.float64)
    return -torch.exp(A_log.to(torch.float64)) * softplus(x)


def fla_beta(b_raw: torch.Tensor, allow_neg_eigval: bool = False) -> torch.Tensor:
    """beta = sigmoid(b_raw), times 2 with allow_neg_eigval, in float64."""
    beta = torch.sigmoid(b_raw.to(torch.float64))
    return 2.0 * beta if allow_neg_eigval else beta


def apply_gate_options(g, beta, A_log=None, dt_bias=None, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                       allow_neg_eigval=False):
    """(g, beta) as the recurrence uses them, given a call's raw inputs and FLA's options."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in FLA)")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log")
        g = fla_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = fla_beta(beta, allow_neg_eigval)
    return g, beta
