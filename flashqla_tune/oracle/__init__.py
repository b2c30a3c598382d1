"""Float64 references: the token recurrence (ground truth), its chunked form, and the
segmented warm-up CP form."""
from .chunked import chunk_gated_delta_rule_chunked, chunk_step, chunk_transition, gate_free_inverse
from .common import l2_normalize
from .recurrent import recurrent_gated_delta_rule
from .segmented import EXACT, SegmentedResult, segmented_gated_delta_rule, uniform_boundaries

__all__ = [
    "EXACT", "SegmentedResult", "chunk_gated_delta_rule_chunked", "chunk_step", "chunk_transition",
    "gate_free_inverse", "l2_normalize", "recurrent_gated_delta_rule", "segmented_gated_delta_rule",
    "uniform_boundaries",
]
