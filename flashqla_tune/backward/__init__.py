"""The GDN backward: the chunk-parallel algorithm (chunked_torch), batched torch work around two
sequential chains that run as Hopper kernels on CUDA (chain_kernels) and as torch loops on the CPU.
Its kernel libraries (chain_kernels, prep_kernels, chunk_kernels) are named by kind in libraries."""
from .chunked_torch import GDNGradients, chunk_gated_delta_rule_bwd_torch

__all__ = ["GDNGradients", "chunk_gated_delta_rule_bwd_torch"]
