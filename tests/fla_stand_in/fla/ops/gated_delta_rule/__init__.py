"""Stand-in for fla.ops.gated_delta_rule, FLA's signatures, ops that fail as Triton does on a CPU."""
from _no_gpu_driver import no_driver

_chunk = no_driver("chunk_gated_delta_rule")
_recurrent = no_driver("fused_recurrent_gated_delta_rule")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    return _chunk(q, k, v, g, beta)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    return _recurrent(q, k, v, g, beta)
