"""Float64 references: the token recurrence (ground truth), its chunked form, and the
segmented warm-up CP form, for the scalar gate and for KDA's per-key-channel gate."""
from .chunked import chunk_gated_delta_rule_chunked, chunk_step, chunk_transition, gate_free_inverse
from .common import l2_normalize
from .gates import apply_gate_options, fla_beta, fla_gate
from .kda import (
    KIMI_LOWER_BOUND, KDASegmentedResult, chunk_kda_chunked, kda_chunk_step, kda_chunk_transition, kda_gate,
    kda_run_chunks, kda_window_is_safe, kda_window_statistic, least_decay_per_token, recurrent_kda, segmented_kda,
)
from .recurrent import recurrent_gated_delta_rule
from .segmented import EXACT, SegmentedResult, segmented_gated_delta_rule, uniform_boundaries

__all__ = [
    "EXACT", "KDASegmentedResult", "apply_gate_options", "fla_beta", "fla_gate", "KIMI_LOWER_BOUND", "SegmentedResult", "chunk_gated_delta_rule_chunked",
    "chunk_kda_chunked", "chunk_step", "chunk_transition", "gate_free_inverse", "kda_chunk_step",
    "kda_chunk_transition", "kda_gate", "kda_run_chunks", "kda_window_is_safe", "kda_window_statistic",
    "l2_normalize", "least_decay_per_token", "recurrent_gated_delta_rule", "recurrent_kda",
    "segmented_gated_delta_rule", "segmented_kda", "uniform_boundaries",
]
