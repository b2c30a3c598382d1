"""OLMo-Hybrid (transformers' OlmoHybridConfig): linear_* fields at the top level, separate q/k/v/a/b
projections, a_proj giving one `a` per v-head, and beta = 2 sigmoid(b) with linear_allow_neg_eigval.

Its GDN and softmax-attention decoder layers are two classes, and only the attention layers take
rotary position embeddings (none at all when the config has no rope_theta, as released
checkpoints have). The modeling module is imported when the adapter is made, so a transformers
without OLMo-Hybrid fails here with a CalibrationError, not at import.
"""
from __future__ import annotations

import torch

from .transformers_qwen import TransformersQwenAdapter

MODELING = "transformers.models.olmo_hybrid.modeling_olmo_hybrid"
# checkpoint name prefix (relative to a decoder layer) -> the module's
CHECKPOINT_RENAMES = (("attention_layer_norm.", "input_layernorm."),
                      ("feedforward_layer_norm.", "post_attention_layernorm."))


class OlmoHybridAdapter(TransformersQwenAdapter):
    family = "olmo_hybrid"
    modeling_import = (MODELING, "OLMo-Hybrid", "OlmoHybridConfig")
    rotary_cls = "OlmoHybridRotaryEmbedding"
    gate_proj = "a_proj"

    def decoder_layer_name(self, index: int) -> str:
        if index in self.model.gdn_layers:
            return "OlmoHybridLinearAttentionDecoderLayer"
        return "OlmoHybridAttentionDecoderLayer"

    def make_rotary(self):
        rope = getattr(self.config, "rope_parameters", None)
        if not rope or rope.get("rope_theta") is None:
            return None                 # no positional encoding (NoPE), as OlmoHybridModel builds it
        return super().make_rotary()

    def position_embeddings(self, hidden, pos, is_gdn: bool):
        # OlmoHybridModel hands rotary embeddings to the full-attention layers only
        if is_gdn or self.rotary is None:
            return None
        return self.rotary(hidden, self.rotary_positions(pos))

    def gate_input(self, attn, proj_out):
        return proj_out                 # a_proj: hidden -> Hv, one `a` per v-head

    def to_module_names(self, sd: dict, layer) -> dict:
        """OLMo-Hybrid checkpoints name the norms attention_layer_norm / feedforward_layer_norm and
        keep q, k and v's short convolutions apart; the modules hold input_layernorm /
        post_attention_layernorm and one conv1d over [q | k | v], as transformers' conversion
        mapping for olmo_hybrid renames and concatenates them on load. Tensors already under the
        module's names pass as they are."""
        out = {}
        for name, t in sd.items():
            for old, new in CHECKPOINT_RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
            out[name] = t
        parts = [f"linear_attn.{x}_conv1d.weight" for x in "qkv"]
        if all(p in out for p in parts) and "linear_attn.conv1d.weight" not in out:
            out["linear_attn.conv1d.weight"] = torch.cat([out.pop(p) for p in parts], dim=0)
        return super().to_module_names(out, layer)
