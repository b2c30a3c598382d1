"""Kimi-Linear (transformers' KimiLinearConfig): KDA layers with a gate per key channel.

Its decoder layer is one class (KimiLinearDecoderLayer) holding either a KDA layer
(KimiLinearDeltaAttention) or MLA softmax attention under `self_attn`, with no rotary embedding
handed in. The KDA layer's forget_gate module computes g [B, T, H, K] from the layer's own
f_a_proj / f_b_proj, A_log and dt_bias; a forward hook on it captures exactly the gate the layer
hands its kernel, per key channel. The statistics reduce it to each token's least-negative
channel gate (calibrate/statistics.py, least_decay_gates; docs/kda.md).

Checkpoints name the gate tensors at the attention level (self_attn.A_log, self_attn.f_a_proj),
keep q, k and v's short convolutions apart, and hold the MLP under block_sparse_moe with experts
as w1 / w2 / w3; to_module_names maps them to the modules' names as transformers' conversion
mapping for kimi_linear does on load. The modeling module is imported when the adapter is made,
so a transformers without Kimi-Linear fails here with a CalibrationError, not at import.
"""
from __future__ import annotations

import math
import re

import torch

from ...calibration_settings import CalibrationError
from .torch_layer_math import pinned_torch_path
from .transformers_qwen import TransformersQwenAdapter

MODELING = "transformers.models.kimi_linear.modeling_kimi_linear"
GATE_TENSORS = ("A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight")
_EXPERT_PART = re.compile(r"^mlp\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class KimiLinearAdapter(TransformersQwenAdapter):
    family = "kimi_linear"
    modeling_import = (MODELING, "Kimi-Linear", "KimiLinearConfig")
    decoder_layer_cls = "KimiLinearDecoderLayer"
    gate_proj = "forget_gate.f_b_proj"

    def make_rotary(self):
        return None                # KimiLinearModel hands no position embeddings to its layers

    def _gate_tensor(self, index: int, part: str) -> str:
        """The checkpoint's name of a KDA layer's gate tensor, under either naming."""
        base = f"{self.prefix}layers.{index}.self_attn."
        for name in (base + part, base + "forget_gate." + part):
            if name in self.weights.shapes:
                return name
        self.weights.require(base + part, f"KDA layer {index} gate tensor {part}")   # raises: it is missing
        return base + part

    def check(self) -> None:
        spec, hidden = self.model.spec, self.model.hidden_size
        heads, K = spec.num_v_heads, spec.head_k_dim
        want = {"A_log": None, "dt_bias": (heads * K,), "f_a_proj.weight": (K, hidden),
                "f_b_proj.weight": (heads * K, K)}
        for i in self.model.gdn_layers:
            for part in GATE_TENSORS:
                name = self._gate_tensor(i, part)
                shape = tuple(self.weights.shapes[name])
                if part == "A_log":
                    if math.prod(shape) != heads or heads not in shape:     # [1, 1, H, 1] as the module holds it
                        raise CalibrationError(f"head count mismatch: {name!r} has shape {shape} but the config says "
                                               f"{heads} heads (linear_num_heads={heads})")
                elif shape != want[part]:
                    raise CalibrationError(f"tensor {name!r} has shape {shape}; linear_num_heads={heads}, "
                                           f"linear_head_dim={K} and hidden_size={hidden} imply {want[part]}")

    def to_module_names(self, sd: dict, layer) -> dict:
        out = {}
        for name, t in sd.items():
            if name.startswith("block_sparse_moe."):
                name = "mlp." + name[len("block_sparse_moe."):]
            for part in ("A_log", "dt_bias", "f_a_proj.", "f_b_proj."):
                if name.startswith("self_attn." + part):
                    name = "self_attn.forget_gate." + name[len("self_attn."):]
            m = _EXPERT_PART.match(name)
            if m:
                name = f"mlp.experts.{m.group(1)}.{_EXPERT_NAMES[m.group(2)]}.weight"
            out[name] = t
        parts = [f"self_attn.{x}_conv1d.weight" for x in "qkv"]
        if all(p in out for p in parts) and "self_attn.conv1d.weight" not in out:
            out["self_attn.conv1d.weight"] = torch.cat([out.pop(p) for p in parts], dim=0)
        return self._fuse_experts(out, layer)

    def load_layer(self, index: int):
        layer = self.build_layer(index)
        is_kda = index in self.model.gdn_layers
        captured: list[torch.Tensor] = []
        if is_kda:
            layer.self_attn.forget_gate.register_forward_hook(lambda _m, _i, out: captured.append(out.float()))

        @torch.no_grad()
        def run(hidden: torch.Tensor):
            captured.clear()
            B, T = hidden.shape[:2]
            pos = torch.arange(T, device=hidden.device)[None].expand(B, T)
            with pinned_torch_path(self.modeling):
                out = layer(hidden, attention_mask=None if is_kda else self._mask(hidden, pos), position_ids=pos)
            out = out[0] if isinstance(out, tuple) else out
            if is_kda and len(captured) != 1:
                raise CalibrationError(f"decoder layer {index}: expected one forget-gate call, saw {len(captured)}")
            return out, (captured[0] if is_kda else None)

        return run
