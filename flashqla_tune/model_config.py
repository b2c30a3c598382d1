"""Read a checkpoint's config.json into the GDN facts the toolchain needs.

Three layouts are understood: Qwen3-Next (linear_* fields at the top level), Qwen3.5 (the
same fields nested under text_config) and FLA's gated_deltanet. Parsing works on the raw JSON
so that `flashqla-tune info` needs no model code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .spec import QKV_DTYPES, GDNSpec, SpecError


class ConfigError(ValueError):
    """The checkpoint's config is missing, unreadable, or not a GDN model."""


QWEN_NEXT_TYPES = ("qwen3_next",)
QWEN35_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
FLA_GDN_TYPES = ("gated_deltanet",)


@dataclass(frozen=True)
class ModelGDNConfig:
    family: str                 # "qwen3_next" | "qwen3_5" | "fla_gated_deltanet"
    model_type: str
    num_layers: int
    gdn_layers: tuple[int, ...]  # decoder-layer indices that are GDN layers, in order
    hidden_size: int
    conv_kernel_size: int
    spec: GDNSpec
    # config.json's torch_dtype as written ("bfloat16" when absent). spec.qkv_dtype is it when the
    # kernels take it, else bfloat16: supported_shapes.check_checkpoint_dtype refuses such a
    # checkpoint unless the caller names the dtype to build.
    checkpoint_dtype: str = "bfloat16"

    @property
    def num_gdn_layers(self) -> int:
        return len(self.gdn_layers)


def load_config_json(checkpoint: str | Path) -> dict:
    path = Path(checkpoint)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} holds a JSON {type(cfg).__name__}, not an object of config fields")
    return cfg


def _require(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise ConfigError(f"{where} config has no {key!r}")
    return cfg[key]


def _count(cfg: dict, key: str, where: str, default=None) -> int:
    """A positive integer field (a bool, a float such as 2.7 or 2.0, or a string is refused)."""
    value = _require(cfg, key, where) if default is None else cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} config: {key}={value!r} must be a positive integer")
    return value


def _layer_types(cfg: dict, num_layers: int, where: str) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries but num_hidden_layers={num_layers}")
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"{where}: unknown layer type(s) {unknown}")
    return types


def _qwen_linear(cfg: dict, family: str, model_type: str, where: str, dtype: str) -> ModelGDNConfig:
    num_layers = _count(cfg, "num_hidden_layers", where)
    types = _layer_types(cfg, num_layers, where)
    spec = _spec(where,
        num_qk_heads=_count(cfg, "linear_num_key_heads", where),
        num_v_heads=_count(cfg, "linear_num_value_heads", where),
        head_k_dim=_count(cfg, "linear_key_head_dim", where),
        head_v_dim=_count(cfg, "linear_value_head_dim", where),
        qkv_dtype=_kernel_dtype(dtype),
        # transformers' Qwen3-Next/Qwen3.5 layers call the kernel with in-kernel q/k L2 norm
        # and beta = sigmoid(b) in (0, 1).
        qk_l2norm_in_kernel=True,
        beta_max=1.0,
    )
    return ModelGDNConfig(
        family=family,
        model_type=model_type,
        num_layers=num_layers,
        gdn_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        hidden_size=_count(cfg, "hidden_size", where),
        conv_kernel_size=_count(cfg, "linear_conv_kernel_dim", where, default=4),
        spec=spec,
        checkpoint_dtype=dtype,
    )


def _fla_gdn(cfg: dict, dtype: str) -> ModelGDNConfig:
    where = "gated_deltanet"
    num_layers = _count(cfg, "num_hidden_layers", where)
    num_heads = _count(cfg, "num_heads", where, default=6)
    num_v_heads = num_heads if cfg.get("num_v_heads") is None else _count(cfg, "num_v_heads", where)
    head_dim = _count(cfg, "head_dim", where, default=256)
    expand_v = cfg.get("expand_v", 2.0)
    if (isinstance(expand_v, bool) or not isinstance(expand_v, (int, float))
            or not float(head_dim * expand_v).is_integer() or head_dim * expand_v < 1):
        raise ConfigError(f"{where} config: expand_v={expand_v!r} must make head_dim * expand_v "
                          f"(head_dim={head_dim}) a positive integer")
    head_v_dim = int(head_dim * expand_v)
    attn = cfg.get("attn") or {}
    attn_layers = set()
    for entry in attn if isinstance(attn, list) else [attn]:
        attn_layers.update(int(i) for i in (entry or {}).get("layers", []))
    spec = _spec(where,
        num_qk_heads=num_heads,
        num_v_heads=num_v_heads,
        head_k_dim=head_dim,
        head_v_dim=head_v_dim,
        qkv_dtype=_kernel_dtype(dtype),
        qk_l2norm_in_kernel=True,  # FLA's GatedDeltaNet layer normalises q/k in the kernel
        beta_max=2.0 if cfg.get("allow_neg_eigval") else 1.0,
    )
    return ModelGDNConfig(
        family="fla_gated_deltanet",
        model_type="gated_deltanet",
        num_layers=num_layers,
        gdn_layers=tuple(i for i in range(num_layers) if i not in attn_layers),
        hidden_size=_count(cfg, "hidden_size", where, default=2048),
        conv_kernel_size=_count(cfg, "conv_size", where, default=4),
        spec=spec,
        checkpoint_dtype=dtype,
    )


def _spec(where: str, **fields) -> GDNSpec:
    try:
        return GDNSpec(**fields)
    except SpecError as exc:
        raise ConfigError(f"{where} config: {exc}") from exc


def _dtype_of(cfg: dict) -> str:
    """The checkpoint's dtype as config.json names it ("bfloat16" when it names none)."""
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return dtype if isinstance(dtype, str) else repr(dtype)


def _kernel_dtype(dtype: str) -> str:
    return dtype if dtype in QKV_DTYPES else "bfloat16"


def parse_model_config(cfg: dict) -> ModelGDNConfig:
    """Turn a config.json dict into a ModelGDNConfig, or raise ConfigError naming the problem."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"config is a JSON {type(cfg).__name__}, not an object of config fields")
    model_type = cfg.get("model_type")
    if model_type in QWEN_NEXT_TYPES:
        return _qwen_linear(cfg, "qwen3_next", model_type, "Qwen3-Next", _dtype_of(cfg))
    if model_type in QWEN35_TYPES:
        text = cfg.get("text_config", cfg) if model_type in ("qwen3_5", "qwen3_5_moe") else cfg
        if not isinstance(text, dict):
            raise ConfigError(f"Qwen3.5 config ({model_type}) has a text_config that is not an object")
        return _qwen_linear(text, "qwen3_5", model_type, "Qwen3.5 text_config", _dtype_of(text) if "dtype" in text or "torch_dtype" in text else _dtype_of(cfg))
    if model_type in FLA_GDN_TYPES:
        return _fla_gdn(cfg, _dtype_of(cfg))
    known = QWEN_NEXT_TYPES + QWEN35_TYPES + FLA_GDN_TYPES
    raise ConfigError(f"model_type={model_type!r} is not a GDN model this toolchain knows (known: {', '.join(known)})")


def read_model_config(checkpoint: str | Path) -> ModelGDNConfig:
    return parse_model_config(load_config_json(checkpoint))
