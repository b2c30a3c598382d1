"""The shapes the kernels are built for: one table that the plan, the op's host checks, `info` and
`build` consult, so an unsupported model is refused before any work (calibrating, compiling).

A leaf (it imports only spec.py, and no torch: `info` answers without it). Dtypes are named as
torch names them; the op maps the names to torch dtypes. Widening what is supported is one edit of
SUPPORTED, the kernels' side (templates, csrc/) aside.
"""
from __future__ import annotations

from dataclasses import dataclass

from .spec import GDNSpec


class UnsupportedShapeError(ValueError):
    """A spec, a model or a call has a shape or dtype no kernel here is built for."""


@dataclass(frozen=True)
class ShapeTable:
    head_k_dims: tuple[int, ...]
    head_v_dims: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    gate_kinds: tuple[str, ...]
    qkv_dtypes: tuple[str, ...]       # q, k and v share one of these
    gate_dtypes: tuple[str, ...]      # g and beta as the op takes them (bfloat16 is upcast)
    state_layouts: tuple[str, ...]    # kv: [N,Hv,K,V]; vk: [N,Hv,V,K] (state_v_first)
    max_heads: int                    # bound on Hqk and Hv
    max_window_chunks: int            # bound on a warm-up window n_h, in chunks
    what: str                         # the kernels this table describes, for messages


SUPPORTED = ShapeTable(
    head_k_dims=(128,),
    head_v_dims=(128,),
    chunk_sizes=(64,),
    gate_kinds=("scalar",),
    qkv_dtypes=("bfloat16", "float16"),
    gate_dtypes=("float32", "bfloat16"),
    state_layouts=("kv", "vk"),
    # The v-heads are the launch grid's y dimension (csrc/gdn_fwd_host.cuh), which CUDA caps at 2^16 - 1.
    max_heads=(1 << 16) - 1,
    # The one window cap the kernels' warm-up tables enforce (warmup_tables.normalise).
    max_window_chunks=1024,
    what="the Hopper kernels",
)

# The op's chunk length in tokens (the one chunk size the kernels run).
CHUNK_SIZE = SUPPORTED.chunk_sizes[0]
# The longest warm-up window in chunks: calibration settings, artifacts and warm-up tables are bounded by it.
MAX_WINDOW_CHUNKS = SUPPORTED.max_window_chunks


def _listed(values) -> str:
    return " or ".join(str(v) for v in values)


def head_dims_problem(head_k_dim: int, head_v_dim: int) -> str | None:
    t = SUPPORTED
    if head_k_dim in t.head_k_dims and head_v_dim in t.head_v_dims:
        return None
    return (f"unsupported head dims K={head_k_dim}, V={head_v_dim}: {t.what} support K = {_listed(t.head_k_dims)} "
            f"and V = {_listed(t.head_v_dims)}; kernels for K={head_k_dim}, V={head_v_dim} are not built yet")


def is_count(value) -> bool:
    """A positive int (a bool is not a count, and neither is 2.0)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def heads_problem(num_qk_heads: int, num_v_heads: int) -> str | None:
    """Each v-head reads q/k head h // (Hv / Hqk): Hv must be a positive multiple of Hqk, and
    both are bounded by the table's max_heads."""
    for name, value in (("q/k heads Hqk", num_qk_heads), ("v heads Hv", num_v_heads)):
        if not is_count(value):
            return f"{name}={value!r} must be a positive integer"
        if value > SUPPORTED.max_heads:
            return f"{name}={value} exceeds the {SUPPORTED.max_heads} heads {SUPPORTED.what} launch"
    if num_v_heads % num_qk_heads:
        return (f"v heads Hv={num_v_heads} must be a multiple of q/k heads Hqk={num_qk_heads} "
                f"(v-head h reads q/k head h // (Hv/Hqk))")
    return None


def gate_kind_problem(gate_kind: str) -> str | None:
    """Why no kernel takes gate_kind; a per-key-channel gate (KDA) is named as such: its kernels
    are a family of their own (docs/kda.md)."""
    t = SUPPORTED
    if gate_kind in t.gate_kinds:
        return None
    if gate_kind == "per_key":
        return (f"gate_kind='per_key' is KDA's gate (one log-decay per key channel, g [B,T,H,K]): {t.what} "
                f"have the {_listed(t.gate_kinds)} gate only; the KDA kernels are not built yet (docs/kda.md)")
    return f"unsupported gate_kind={gate_kind!r}: {t.what} have the {_listed(t.gate_kinds)} gate"


def spec_problem(spec: GDNSpec) -> str | None:
    """Why no kernel is built for spec, naming the value; None when the table supports it. A
    per-key gate is named first: no dims or heads make it run."""
    t = SUPPORTED
    if spec.gate_kind == "per_key":
        return gate_kind_problem(spec.gate_kind)
    problem = head_dims_problem(spec.head_k_dim, spec.head_v_dim) or heads_problem(spec.num_qk_heads,
                                                                                   spec.num_v_heads)
    if problem:
        return problem
    if spec.chunk_size not in t.chunk_sizes:
        return f"unsupported chunk_size={spec.chunk_size}: {t.what} use {_listed(t.chunk_sizes)}"
    if spec.gate_kind not in t.gate_kinds:
        return gate_kind_problem(spec.gate_kind)
    if spec.qkv_dtype not in t.qkv_dtypes:
        return f"unsupported qkv_dtype={spec.qkv_dtype!r}: {t.what} take {_listed(t.qkv_dtypes)}"
    if spec.state_layout not in t.state_layouts:
        return f"unsupported state_layout={spec.state_layout!r}: {t.what} take {_listed(t.state_layouts)}"
    return None


def check_spec(spec: GDNSpec, where: str = "") -> None:
    """Raise UnsupportedShapeError (prefixed with `where`) when no kernel is built for spec."""
    problem = spec_problem(spec)
    if problem:
        raise UnsupportedShapeError(f"{where}: {problem}" if where else problem)


def dtype_problem(checkpoint_dtype: str, qkv_dtype: str | None = None) -> str | None:
    """Why a checkpoint of checkpoint_dtype (its config.json's) gets no kernel unless the caller
    names the q/k/v dtype to build (qkv_dtype, e.g. `--dtype`); None when it does."""
    t = SUPPORTED
    if qkv_dtype is not None or checkpoint_dtype in t.qkv_dtypes:
        return None
    return (f"the checkpoint's dtype is {checkpoint_dtype!r}; {t.what} take {_listed(t.qkv_dtypes)}: "
            f"pass --dtype {' or --dtype '.join(t.qkv_dtypes)} to say which to build")


def check_checkpoint_dtype(model, qkv_dtype: str | None = None, where: str = "") -> None:
    """Refuse a checkpoint whose dtype no kernel takes (model_config.ModelGDNConfig.checkpoint_dtype),
    unless qkv_dtype says what to build."""
    problem = dtype_problem(model.checkpoint_dtype, qkv_dtype)
    if problem:
        raise UnsupportedShapeError(f"{where}: {problem}" if where else problem)


def check_model(model, where: str = "") -> None:
    """A checkpoint's GDN facts (model_config.ModelGDNConfig): it has GDN layers and the table
    supports its spec."""
    prefix = f"{where}: " if where else ""
    if not model.gdn_layers:
        raise UnsupportedShapeError(f"{prefix}the model has no GDN (linear_attention) layers")
    if model.spec.gate_kind == "per_key":
        raise UnsupportedShapeError(f"{prefix}family {model.family} (model_type {model.model_type!r}) is a KDA "
                                    f"model, {len(model.gdn_layers)} KDA of {model.num_layers} layers; "
                                    + gate_kind_problem(model.spec.gate_kind))
    check_spec(model.spec, where)


__all__ = ["CHUNK_SIZE", "MAX_WINDOW_CHUNKS", "SUPPORTED", "ShapeTable", "UnsupportedShapeError",
           "check_checkpoint_dtype", "check_model", "check_spec", "dtype_problem", "gate_kind_problem",
           "head_dims_problem", "heads_problem", "is_count", "spec_problem"]
