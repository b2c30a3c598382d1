"""Shared runner for the GDN families transformers implements (Qwen3-Next, Qwen3.5, OLMo-Hybrid)
through transformers' own decoder-layer code.

Each decoder layer is built on the meta device and filled with just its own tensors from the
safetensors files, so only one layer's weights are ever resident. The gate is read from the
layer's own gate projection with a forward hook and turned into g with the layer's own A_log
and dt_bias, using the formula in transformers' modeling code (checked against the value the
layer hands its kernel in tests). Layers are built and run with the family's kernel dispatch
pinned to transformers' PyTorch code (torch_layer_math), so an installed FLA or causal-conv1d
never runs here.
"""
from __future__ import annotations

import importlib
import inspect
import re

import torch
from transformers import AutoConfig

from ...calibration_settings import CalibrationError
from .base import GDNAdapter
from .torch_layer_math import check_torch_only, pinned_torch_path

# Parameters the model code keeps in fp32 whatever the compute dtype: exp() of a rounded A_log
# is a proportional error on the decay rate.
FP32_PARAMS = ("A_log", "dt_bias")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def import_modeling(module: str, label: str, config_class: str):
    """A transformers modeling module that only some versions have, or a CalibrationError naming it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        import transformers

        raise CalibrationError(f"transformers {transformers.__version__} has no {label} ({module}): "
                               f"install one that has {config_class}") from exc


class TransformersQwenAdapter(GDNAdapter):
    modeling = None            # the transformers modeling module of the family
    # A family whose modeling module only newer transformers have names it here instead, imported
    # when the adapter is made: (module path, family label, its config class)
    modeling_import: tuple[str, str, str] | None = None
    decoder_layer_cls = ""     # its decoder-layer class name
    rotary_cls = ""            # its rotary-embedding class name
    gate_proj = ""             # the projection whose output holds `a`
    expected_gate_params = ("A_log", "dt_bias")

    def __init__(self, *args, **kwargs):
        if self.modeling_import is not None:
            self.modeling = import_modeling(*self.modeling_import)
        super().__init__(*args, **kwargs)
        try:
            config = AutoConfig.from_pretrained(str(self.checkpoint))
        except Exception as exc:  # transformers raises several types for unreadable configs
            raise CalibrationError(f"transformers cannot read {self.checkpoint}/config.json: {exc}") from exc
        self.config = self.text_config(config)
        self.config._attn_implementation = "sdpa"
        embed = self.weights.find_suffix("embed_tokens.weight")
        if embed is None:
            raise CalibrationError(f"checkpoint {self.checkpoint} has no '*embed_tokens.weight' tensor")
        self.embed_name = embed
        self.prefix = embed[: -len("embed_tokens.weight")]   # e.g. 'model.' or 'model.language_model.'
        self.rotary = self.make_rotary()
        self._embed_weight = None

    # --- what a family module fills in -------------------------------------------------
    def text_config(self, config):
        return config

    def gate_input(self, attn, proj_out: torch.Tensor) -> torch.Tensor:
        """`a` [B, T, Hv] from the gate projection's output."""
        raise NotImplementedError

    def gate_proj_rows(self) -> int:
        return self.model.spec.num_v_heads

    def rotary_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """Position ids in the shape the family's rotary embedding takes."""
        return pos

    def make_rotary(self):
        """The family's rotary embedding module, on self.device."""
        return getattr(self.modeling, self.rotary_cls)(config=self.config).to(self.device)

    def position_embeddings(self, hidden: torch.Tensor, pos: torch.Tensor, is_gdn: bool):
        """What decoder layer's forward takes as position_embeddings."""
        return self.rotary(hidden, self.rotary_positions(pos))

    def decoder_layer_name(self, index: int) -> str:
        """The class of decoder layer `index` in self.modeling."""
        return self.decoder_layer_cls

    # --- checks -------------------------------------------------------------------------
    def check(self) -> None:
        hv, hidden = self.model.spec.num_v_heads, self.model.hidden_size
        for i in self.model.gdn_layers:
            base = f"{self.prefix}layers.{i}.linear_attn."
            for p in self.expected_gate_params:
                name = base + p
                self.weights.require(name, f"GDN layer {i} gate parameter {p}")
                if self.weights.shapes[name] != (hv,):
                    raise CalibrationError(
                        f"head count mismatch: {name!r} has shape {self.weights.shapes[name]} but the config "
                        f"says {hv} v-heads (linear_num_value_heads={hv})")
            self.weights.require(base + f"{self.gate_proj}.weight", f"GDN layer {i} gate projection",
                                 (self.gate_proj_rows(), hidden))

    # --- running ------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._embed_weight is None:
            self._embed_weight = self.weights.load([self.embed_name], self.device, self.dtype)[self.embed_name]
        return torch.nn.functional.embedding(input_ids.to(self.device), self._embed_weight)

    def _layer_state(self, index: int, layer: torch.nn.Module) -> dict:
        sd = self.weights.load_prefix(f"{self.prefix}layers.{index}.", self.device, self.dtype)
        for name in list(sd):
            if name.split(".")[-1] in FP32_PARAMS:
                sd[name] = sd[name].float()
        sd = self.to_module_names(sd, layer)
        want = layer.state_dict()
        missing = sorted(set(want) - set(sd))
        if missing:
            names = ", ".join(f"{self.prefix}layers.{index}.{m}" for m in missing[:4])
            raise CalibrationError(f"checkpoint {self.checkpoint} is missing tensor(s) for decoder layer "
                                   f"{index}: {names}{' ...' if len(missing) > 4 else ''}")
        for name, t in want.items():
            if tuple(sd[name].shape) != tuple(t.shape):
                raise CalibrationError(f"tensor {self.prefix}layers.{index}.{name} has shape "
                                       f"{tuple(sd[name].shape)}, the config implies {tuple(t.shape)}")
        return {k: sd[k] for k in want}

    def to_module_names(self, sd: dict, layer) -> dict:
        """One decoder layer's checkpoint tensors (names relative to the layer) -> the tensors its
        module's state_dict holds, as transformers converts them when it loads the checkpoint."""
        return self._fuse_experts(sd, layer)

    @staticmethod
    def _fuse_experts(sd: dict, layer) -> dict:
        """Per-expert checkpoint tensors -> transformers' stacked [E, ...] expert parameters."""
        experts = {}
        for name in list(sd):
            m = _EXPERT.match(name)
            if m:
                experts.setdefault(int(m.group(1)), {})[m.group(2)] = sd.pop(name)
        if experts and "mlp.experts.gate_up_proj" in layer.state_dict():
            order = sorted(experts)
            sd["mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order])
            sd["mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
        return sd

    def _mask(self, hidden: torch.Tensor, pos: torch.Tensor):
        """The causal mask as the model builds it (None under sdpa when no padding)."""
        fn = getattr(self.modeling, "create_causal_mask", None)
        if fn is None:
            return None
        params = inspect.signature(fn).parameters
        kwargs = {"config": self.config, "inputs_embeds": hidden, "attention_mask": None, "position_ids": pos}
        for cache_name in ("cache", "past_key_values"):
            if cache_name in params:
                kwargs[cache_name] = None
        return fn(**{k: v for k, v in kwargs.items() if k in params})

    def build_layer(self, index: int):
        """Decoder layer `index` on its PyTorch code, with the checkpoint's weights, in eval mode."""
        with pinned_torch_path(self.modeling):
            with torch.device("meta"):
                layer = getattr(self.modeling, self.decoder_layer_name(index))(self.config, index)
            check_torch_only(layer, self.modeling, f"decoder layer {index}")
        layer.load_state_dict(self._layer_state(index, layer), strict=True, assign=True)
        return layer.eval()

    def load_layer(self, index: int):
        layer = self.build_layer(index)
        is_gdn = index in self.model.gdn_layers
        captured: list[torch.Tensor] = []
        if is_gdn:
            attn = layer.linear_attn

            def hook(_module, _inputs, out):
                captured.append(self.gate(attn.A_log, self.gate_input(attn, out), attn.dt_bias))

            getattr(attn, self.gate_proj).register_forward_hook(hook)

        @torch.no_grad()
        def run(hidden: torch.Tensor):
            captured.clear()
            B, T = hidden.shape[:2]
            pos = torch.arange(T, device=hidden.device)[None].expand(B, T)
            with pinned_torch_path(self.modeling):
                out = layer(hidden, position_embeddings=self.position_embeddings(hidden, pos, is_gdn),
                            attention_mask=None if is_gdn else self._mask(hidden, pos), position_ids=pos)
            out = out[0] if isinstance(out, tuple) else out
            if is_gdn and len(captured) != 1:
                raise CalibrationError(f"decoder layer {index}: expected one gate projection call, saw {len(captured)}")
            return out, (captured[0] if is_gdn else None)

        return run
