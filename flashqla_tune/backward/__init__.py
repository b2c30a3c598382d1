"""The GDN backward: the chunk-parallel algorithm in PyTorch (chunked_torch), which the op's
backward runs until the Hopper backward kernels implement it."""
from .chunked_torch import GDNGradients, chunk_gated_delta_rule_bwd_torch

__all__ = ["GDNGradients", "chunk_gated_delta_rule_bwd_torch"]
