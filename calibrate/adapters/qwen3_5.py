"""Qwen3.5 (dense and MoE): text config nested under text_config; separate in_proj_a."""
from __future__ import annotations

from transformers.models.qwen3_5 import modeling_qwen3_5

from .transformers_qwen import TransformersQwenAdapter


class Qwen35Adapter(TransformersQwenAdapter):
    family = "qwen3_5"
    modeling = modeling_qwen3_5
    decoder_layer_cls = "Qwen3_5DecoderLayer"
    rotary_cls = "Qwen3_5TextRotaryEmbedding"
    gate_proj = "in_proj_a"

    def text_config(self, config):
        return getattr(config, "text_config", None) or config

    def rotary_positions(self, pos):
        # multimodal RoPE: one row per (text, height, width) axis, all equal for text;
        # some transformers versions take only this 3-row form
        return pos[None].expand(3, *pos.shape)

    def gate_input(self, attn, proj_out):
        return proj_out          # in_proj_a: hidden -> Hv, one `a` per v-head
