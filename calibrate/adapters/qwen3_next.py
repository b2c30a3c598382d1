"""Qwen3-Next: linear_* fields at the top level; `a` packed with `b` in in_proj_ba, grouped
per key head as [b_0..b_{G-1}, a_0..a_{G-1}] (G = Hv / Hqk), as fix_query_key_value_ordering reads it."""
from __future__ import annotations

from transformers.models.qwen3_next import modeling_qwen3_next

from .transformers_qwen import TransformersQwenAdapter


class Qwen3NextAdapter(TransformersQwenAdapter):
    family = "qwen3_next"
    modeling = modeling_qwen3_next
    decoder_layer_cls = "Qwen3NextDecoderLayer"
    rotary_cls = "Qwen3NextRotaryEmbedding"
    gate_proj = "in_proj_ba"

    def gate_proj_rows(self) -> int:
        return 2 * self.model.spec.num_v_heads

    def gate_input(self, attn, proj_out):
        B, T = proj_out.shape[:2]
        group = attn.num_v_heads // attn.num_k_heads
        ba = proj_out.view(B, T, attn.num_k_heads, 2 * group)
        return ba[..., group:].reshape(B, T, attn.num_v_heads)
