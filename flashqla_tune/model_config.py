"""Read a checkpoint's config.json into the GDN facts the toolchain needs.

Model families are data: each is a GDNFamily record in a registry (register_family), naming the
model_type values it covers, the config fields that hold its layer count, head counts, head dims,
layer types, short-convolution width and negative-eigenvalue switch, the defaults its config class
applies to fields a config.json leaves out, its gate, and how its GDN layer calls the kernel (gate
and beta sigmoid before or inside the kernel, the state layout, whose op it calls).
parse_model_config finds the family of a config's model_type and reads the config with that
family's fields. Parsing works on the raw JSON, with no model code, so `flashqla-tune info` needs
neither torch nor transformers. docs/porting.md says how to add a family.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .spec import GATE_KINDS, QKV_DTYPES, STATE_LAYOUTS, GDNSpec, SpecError


class ConfigError(ValueError):
    """The checkpoint's config is missing, unreadable, or not a GDN model."""


# The gate every registered family computes; its parameters are the layer's A_log and dt_bias.
SCALAR_GATE = "g = -exp(A_log) * softplus(a + dt_bias)"
# KDA's gate (Kimi-Linear): one log-decay per key channel, a from a low-rank projection per channel.
PER_KEY_GATE = "g[..., c] = -exp(A_log) * softplus(a[..., c] + dt_bias[c]) per key channel c"
LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True, eq=False)       # compared and hashed as the one registered object
class GDNFamily:
    """One model family's config layout and layer call.

    name is ModelGDNConfig.family and the key of the family's calibration adapter
    (flashqla_tune.calibrate.adapters). Field names are config.json keys of the section that holds
    them (section(cfg, model_type): the whole config, or Qwen3.5's text_config). `defaults` are the
    values a config class gives fields a config.json leaves out; `fill(section, where)` returns the
    section with fields its config class derives from others (a head dim from the hidden size, the
    layer types from an attention-layer list) filled in, and may raise ConfigError."""
    name: str
    label: str                                  # how messages name its config, e.g. "Qwen3-Next"
    model_types: tuple[str, ...]
    num_qk_heads: str
    num_v_heads: str
    head_k_dim: str
    head_v_dim: str
    conv_kernel_size: str
    num_layers: str = "num_hidden_layers"
    hidden_size: str = "hidden_size"
    layer_types: str = "layer_types"            # per decoder layer: "linear_attention" or "full_attention"
    allow_neg_eigval: str | None = None         # the switch that makes beta = 2 sigmoid(b), in (0, 2)
    defaults: dict = field(default_factory=dict)
    fill: Callable[[dict, str], dict] | None = None
    default_layer_types: Callable[[dict, int], list] | None = None
    section: Callable[[dict, str], dict] | None = None
    # The gate and the tensors it reads, by the names the checkpoint's GDN layer gives them.
    gate: str = SCALAR_GATE
    gate_kind: str = "scalar"                   # scalar: g [B,T,Hv]; per_key: KDA's g [B,T,Hv,K] (docs/kda.md)
    gate_params: tuple[str, ...] = ("A_log", "dt_bias")
    gate_projection: str = "a_proj"             # the projection whose output is `a`
    # How the family's GDN layer calls the kernel.
    calls: str = "transformers"                 # "transformers": torch_chunk_gated_delta_rule; "fla": FLA's op
    state_layout: str = "kv"                    # kv: [N,Hv,K,V]; vk: [N,Hv,V,K] (state_v_first=True)
    qk_l2norm_in_kernel: bool = True
    gate_in_kernel: bool = False                # the layer passes raw `a`, A_log and dt_bias (use_gate_in_kernel)
    beta_sigmoid_in_kernel: bool = False        # the layer passes raw b (use_beta_sigmoid_in_kernel)
    # model_type -> (transformers modeling module, its GatedDeltaNet class), for the transformers route.
    transformers_layers: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_types:
            raise ValueError(f"family {self.name!r} names no model_type")
        if self.state_layout not in STATE_LAYOUTS:
            raise ValueError(f"family {self.name!r}: state_layout={self.state_layout!r} is not one of {STATE_LAYOUTS}")
        if self.gate_kind not in GATE_KINDS:
            raise ValueError(f"family {self.name!r}: gate_kind={self.gate_kind!r} is not one of {GATE_KINDS}")
        if self.calls not in ("transformers", "fla"):
            raise ValueError(f"family {self.name!r}: calls={self.calls!r} must be 'transformers' or 'fla'")
        unknown = sorted(set(self.transformers_layers) - set(self.model_types))
        if unknown:
            raise ValueError(f"family {self.name!r}: transformers_layers names model_type(s) {unknown} "
                             f"it does not cover")

    def layer_call(self) -> str:
        """The family's kernel call in a line, for `info`."""
        gate = (f"raw a with {', '.join(self.gate_params)} (use_gate_in_kernel=True)" if self.gate_in_kernel
                else f"g precomputed ({self.gate})")
        beta = "raw b (use_beta_sigmoid_in_kernel=True)" if self.beta_sigmoid_in_kernel else "beta after its sigmoid"
        state = "state [N,Hv,V,K] (state_v_first=True)" if self.state_layout == "vk" else "state [N,Hv,K,V]"
        if self.gate_kind == "per_key":
            op = "FLA's chunk_kda" if self.calls == "fla" else "transformers' chunk_kimi_delta_attention (KDA)"
        else:
            op = "FLA's chunk_gated_delta_rule" if self.calls == "fla" else "transformers' torch_chunk_gated_delta_rule"
        return f"{op}: {gate}; {beta}; {state}"


_FAMILIES: dict[str, GDNFamily] = {}


def register_family(family: GDNFamily, replace: bool = False) -> GDNFamily:
    """Add a family to the registry parse_model_config walks. A name already registered, or a
    model_type another family covers, is refused unless replace=True (then that family is dropped
    first). The transformers route
    (flashqla_tune.integrations.transformers) reads the registry when it is imported; a family
    registered later reaches it through that module's register_family."""
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family and not replace:
        raise ValueError(f"a family named {family.name!r} is registered already (model types "
                         f"{list(_FAMILIES[family.name].model_types)}); pass replace=True to replace it")
    taken = {t: f.name for f in _FAMILIES.values() for t in f.model_types if f.name != family.name}
    clash = sorted(t for t in family.model_types if t in taken)
    if clash and not replace:
        raise ValueError(f"model_type(s) {clash} belong to family {taken[clash[0]]!r} already")
    for name in {taken[t] for t in clash}:
        del _FAMILIES[name]
    _FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    _FAMILIES.pop(name, None)


def families() -> tuple[GDNFamily, ...]:
    """The registered families, in registration order."""
    return tuple(_FAMILIES.values())


def family_named(name: str) -> GDNFamily:
    if name not in _FAMILIES:
        raise ConfigError(f"no GDN family {name!r} is registered (registered: {', '.join(_FAMILIES)})")
    return _FAMILIES[name]


def family_of(model_type) -> GDNFamily | None:
    """The family covering model_type, or None."""
    return next((f for f in _FAMILIES.values() if model_type in f.model_types), None)


def known_model_types() -> tuple[str, ...]:
    return tuple(t for f in _FAMILIES.values() for t in f.model_types)


@dataclass(frozen=True)
class ModelGDNConfig:
    family: str                 # a registered GDNFamily's name, e.g. "qwen3_next"
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


# --- field readers (families' fill functions use them too) ---------------------------------

def require(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise ConfigError(f"{where} config has no {key!r}")
    return cfg[key]


def count(cfg: dict, key: str, where: str, default=None) -> int:
    """A positive integer field (a bool, a float such as 2.7 or 2.0, or a string is refused)."""
    value = require(cfg, key, where) if default is None else cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} config: {key}={value!r} must be a positive integer")
    return value


def _layer_types(family: GDNFamily, cfg: dict, num_layers: int, where: str) -> list[str]:
    types = cfg.get(family.layer_types)
    if types is None and family.default_layer_types is not None:
        types = family.default_layer_types(cfg, num_layers)
    if not isinstance(types, list):
        raise ConfigError(f"{where} config: {family.layer_types}={types!r} must be a list of layer types")
    if len(types) != num_layers:
        raise ConfigError(f"{where}: {family.layer_types} has {len(types)} entries but "
                          f"{family.num_layers}={num_layers}")
    unknown = sorted({str(t) for t in types} - set(LAYER_KINDS))
    if unknown:
        raise ConfigError(f"{where}: unknown layer type(s) {unknown}")
    return types


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


def read_family_config(family: GDNFamily, cfg: dict, model_type: str) -> ModelGDNConfig:
    """cfg (a whole config.json) read with family's fields."""
    where = family.label
    section = family.section(cfg, model_type) if family.section is not None else cfg
    dtype = _dtype_of(section) if "dtype" in section or "torch_dtype" in section else _dtype_of(cfg)
    values = {**family.defaults, **section}
    if family.fill is not None:
        values = family.fill(values, where)
    num_layers = count(values, family.num_layers, where)
    types = _layer_types(family, values, num_layers, where)
    neg_eigval = bool(values.get(family.allow_neg_eigval)) if family.allow_neg_eigval else False
    spec = _spec(where,
        num_qk_heads=count(values, family.num_qk_heads, where),
        num_v_heads=count(values, family.num_v_heads, where),
        head_k_dim=count(values, family.head_k_dim, where),
        head_v_dim=count(values, family.head_v_dim, where),
        qkv_dtype=_kernel_dtype(dtype),
        gate_kind=family.gate_kind,
        state_layout=family.state_layout,
        qk_l2norm_in_kernel=family.qk_l2norm_in_kernel,
        beta_max=2.0 if neg_eigval else 1.0,
    )
    return ModelGDNConfig(
        family=family.name,
        model_type=model_type,
        num_layers=num_layers,
        gdn_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        hidden_size=count(values, family.hidden_size, where),
        conv_kernel_size=count(values, family.conv_kernel_size, where),
        spec=spec,
        checkpoint_dtype=dtype,
    )


def parse_model_config(cfg: dict) -> ModelGDNConfig:
    """Turn a config.json dict into a ModelGDNConfig, or raise ConfigError naming the problem."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"config is a JSON {type(cfg).__name__}, not an object of config fields")
    model_type = cfg.get("model_type")
    family = family_of(model_type)
    if family is None:
        raise ConfigError(f"model_type={model_type!r} is not a GDN model this toolchain knows "
                          f"(known: {', '.join(known_model_types())})")
    return read_family_config(family, cfg, model_type)


def read_model_config(checkpoint: str | Path) -> ModelGDNConfig:
    return parse_model_config(load_config_json(checkpoint))


# --- the registered families -------------------------------------------------------------

def _every_fourth_full(cfg: dict, num_layers: int) -> list[str]:
    """Qwen's default: full attention at every full_attention_interval-th layer (4 unless set)."""
    interval = int(cfg.get("full_attention_interval", 4))
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]


def _qwen35_text(cfg: dict, model_type: str) -> dict:
    if model_type not in ("qwen3_5", "qwen3_5_moe"):
        return cfg                        # the *_text model types are the text config itself
    text = cfg.get("text_config", cfg)
    if not isinstance(text, dict):
        raise ConfigError(f"Qwen3.5 config ({model_type}) has a text_config that is not an object")
    return text


_QWEN_FIELDS = dict(num_qk_heads="linear_num_key_heads", num_v_heads="linear_num_value_heads",
                    head_k_dim="linear_key_head_dim", head_v_dim="linear_value_head_dim",
                    conv_kernel_size="linear_conv_kernel_dim", defaults={"linear_conv_kernel_dim": 4},
                    default_layer_types=_every_fourth_full)

register_family(GDNFamily(
    name="qwen3_next", label="Qwen3-Next", model_types=("qwen3_next",), gate_projection="in_proj_ba",
    transformers_layers={"qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next",
                                        "Qwen3NextGatedDeltaNet")},
    **_QWEN_FIELDS))

register_family(GDNFamily(
    name="qwen3_5", label="Qwen3.5 text_config",
    model_types=("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"),
    section=_qwen35_text, gate_projection="in_proj_a",
    transformers_layers={t: (f"transformers.models.{m}.modeling_{m}", c) for t, m, c in (
        ("qwen3_5", "qwen3_5", "Qwen3_5GatedDeltaNet"), ("qwen3_5_text", "qwen3_5", "Qwen3_5GatedDeltaNet"),
        ("qwen3_5_moe", "qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
        ("qwen3_5_moe_text", "qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"))},
    **_QWEN_FIELDS))


def _fla_fill(cfg: dict, where: str) -> dict:
    """As FLA's GatedDeltaNet layer derives them: num_v_heads null means num_heads, head_v_dim is
    head_dim * expand_v, and the decoder layers listed in `attn` are softmax attention."""
    out = dict(cfg)
    num_layers = count(out, "num_hidden_layers", where)
    heads = count(out, "num_heads", where, default=6)
    if out.get("num_v_heads") is None:
        out["num_v_heads"] = heads
    head_dim = count(out, "head_dim", where, default=256)
    expand_v = out.get("expand_v", 2.0)
    if (isinstance(expand_v, bool) or not isinstance(expand_v, (int, float))
            or not float(head_dim * expand_v).is_integer() or head_dim * expand_v < 1):
        raise ConfigError(f"{where} config: expand_v={expand_v!r} must make head_dim * expand_v "
                          f"(head_dim={head_dim}) a positive integer")
    out["head_v_dim"] = int(head_dim * expand_v)
    attn = out.get("attn") or {}
    attn_layers = set()
    for entry in attn if isinstance(attn, list) else [attn]:
        attn_layers.update(int(i) for i in (entry or {}).get("layers", []))
    out["layer_types"] = ["full_attention" if i in attn_layers else "linear_attention" for i in range(num_layers)]
    return out


register_family(GDNFamily(
    name="fla_gated_deltanet", label="gated_deltanet", model_types=("gated_deltanet",),
    num_qk_heads="num_heads", num_v_heads="num_v_heads", head_k_dim="head_dim", head_v_dim="head_v_dim",
    conv_kernel_size="conv_size", allow_neg_eigval="allow_neg_eigval",
    defaults={"num_heads": 6, "head_dim": 256, "expand_v": 2.0, "hidden_size": 2048, "conv_size": 4},
    fill=_fla_fill,
    # FLA's GatedDeltaNet layer (fla/layers/gated_deltanet.py) calls FLA's op with the gate and beta's
    # sigmoid left to the kernel and the recurrent state v-first.
    calls="fla", state_layout="vk", gate_in_kernel=True, beta_sigmoid_in_kernel=True))


def _olmo_hybrid_fill(cfg: dict, where: str) -> dict:
    """OlmoHybridConfig's derived defaults: linear heads default to num_attention_heads, the key head
    dim to int(0.75 * hidden_size / linear_num_key_heads), the value head dim to twice the key's."""
    out = dict(cfg)
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        if out.get(key) is None:
            out[key] = count(out, "num_attention_heads", where)
    if out.get("linear_key_head_dim") is None:
        hidden, heads = count(out, "hidden_size", where), count(out, "linear_num_key_heads", where)
        out["linear_key_head_dim"] = int(0.75 * hidden / heads)
    if out.get("linear_value_head_dim") is None:
        out["linear_value_head_dim"] = 2 * count(out, "linear_key_head_dim", where)
    return out


def _olmo_hybrid_layer_types(cfg: dict, num_layers: int) -> list[str]:
    """OlmoHybridConfig's default: full attention at every fourth layer, and at the last when that
    leaves none."""
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


register_family(GDNFamily(
    name="olmo_hybrid", label="OLMo-Hybrid", model_types=("olmo_hybrid",),
    num_qk_heads="linear_num_key_heads", num_v_heads="linear_num_value_heads",
    head_k_dim="linear_key_head_dim", head_v_dim="linear_value_head_dim",
    conv_kernel_size="linear_conv_kernel_dim", allow_neg_eigval="linear_allow_neg_eigval",
    defaults={"linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True, "num_attention_heads": 30,
              "hidden_size": 3840, "num_hidden_layers": 32},
    fill=_olmo_hybrid_fill, default_layer_types=_olmo_hybrid_layer_types,
    transformers_layers={"olmo_hybrid": ("transformers.models.olmo_hybrid.modeling_olmo_hybrid",
                                         "OlmoHybridGatedDeltaNet")}))


def _kimi_linear_fill(cfg: dict, where: str) -> dict:
    """KimiLinearConfig's reading: a checkpoint's linear_attn_config (head_dim, num_heads,
    short_conv_kernel_size, and the 1-indexed full_attn_layers / kda_layers) takes precedence over
    the top-level linear_* fields; without layer_types or those lists, every fourth layer from
    layer 4 on (0-indexed 4, 8, ...) is full attention."""
    out = dict(cfg)
    nested = out.get("linear_attn_config") or {}
    if not isinstance(nested, dict):
        raise ConfigError(f"{where} config: linear_attn_config={nested!r} must be an object")
    for key, name in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                      ("short_conv_kernel_size", "linear_conv_kernel_dim")):
        if key in nested:
            out[name] = nested[key]
    if out.get("layer_types") is None:
        num_layers = count(out, "num_hidden_layers", where)
        if "full_attn_layers" in nested and "kda_layers" in nested:
            types: list = [None] * num_layers
            for kind, key in (("full_attention", "full_attn_layers"), ("linear_attention", "kda_layers")):
                for layer in nested[key]:
                    if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= num_layers:
                        raise ConfigError(f"{where} config: linear_attn_config.{key} holds {layer!r}; its "
                                          f"entries are decoder layers 1..{num_layers} (1-indexed)")
                    types[layer - 1] = kind
            out["layer_types"] = types
        else:
            out["layer_types"] = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                                  for i in range(num_layers)]
    return out


register_family(GDNFamily(
    name="kimi_linear", label="Kimi-Linear", model_types=("kimi_linear",),
    num_qk_heads="linear_num_heads", num_v_heads="linear_num_heads",
    head_k_dim="linear_head_dim", head_v_dim="linear_head_dim", conv_kernel_size="linear_conv_kernel_dim",
    defaults={"linear_head_dim": 128, "linear_num_heads": 32, "linear_conv_kernel_dim": 4, "hidden_size": 2304,
              "num_hidden_layers": 27},
    fill=_kimi_linear_fill,
    # KimiLinearDeltaAttention: the gate's input a is forget_gate.f_b_proj(f_a_proj(x)), one per key
    # channel; beta = sigmoid(b_proj(x)); q/k l2-normalised in the kernel. No transformers_layers:
    # the transformers route has no KDA op to hand these layers (docs/kda.md).
    gate=PER_KEY_GATE, gate_kind="per_key", gate_projection="forget_gate.f_b_proj"))
