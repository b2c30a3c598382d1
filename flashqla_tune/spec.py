"""GDNSpec: everything about a GDN layer that changes the generated kernel code.

Per-head data (calibration tables, head order) is deliberately absent: it travels to the
kernels as data, so one binary serves every layer of a model with the same shape.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GATE_KINDS = ("scalar", "per_key")  # scalar: one g per (token, v-head); per_key: KDA's g per key channel
QKV_DTYPES = ("bfloat16", "float16")
STATE_LAYOUTS = ("kv", "vk")  # [N,Hv,K,V] (FLA default) or [N,Hv,V,K] (state_v_first)
# FLA's in-kernel gate and beta options, as GDNSpec fields, and the name suffix each adds when on
GATE_OPTIONS = ("gate_in_kernel", "beta_sigmoid_in_kernel", "allow_neg_eigval")
_GATE_OPTION_SUFFIXES = ("gik", "bsig", "neg")


class SpecError(ValueError):
    """A GDNSpec field has a value no kernel can be built for."""


@dataclass(frozen=True)
class GDNSpec:
    num_qk_heads: int
    num_v_heads: int
    head_k_dim: int = 128
    head_v_dim: int = 128
    chunk_size: int = 64
    gate_kind: str = "scalar"
    qkv_dtype: str = "bfloat16"
    gate_dtype: str = "float32"
    state_dtype: str = "float32"
    state_layout: str = "kv"
    # beta is allowed in [0, beta_max]; warm-up CP is sound only when beta * ||k||^2 <= 2.
    beta_max: float = 2.0
    qk_l2norm_in_kernel: bool = False
    # FLA's in-kernel options (csrc/gdn_gate_options.cuh), typed options of the prep kernel and the
    # CP guard: g = -exp(A_log) * softplus(g + dt_bias) from the raw g, beta = sigmoid(b) from the
    # raw b, and with allow_neg_eigval beta = 2 sigmoid(b) (FLA takes it only with the sigmoid).
    gate_in_kernel: bool = False
    beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(f"GDNSpec.{name} must be a positive int, got {value!r}")

        for name in ("num_qk_heads", "num_v_heads", "head_k_dim", "head_v_dim", "chunk_size"):
            positive_int(name)
        if self.num_v_heads % self.num_qk_heads:
            raise SpecError(
                f"GDNSpec.num_v_heads={self.num_v_heads} is not a multiple of "
                f"num_qk_heads={self.num_qk_heads} (v-head h reads q/k head h // (Hv/Hqk))"
            )
        if self.chunk_size not in (16, 32, 64):
            raise SpecError(f"GDNSpec.chunk_size must be 16, 32 or 64, got {self.chunk_size}")
        if self.gate_kind not in GATE_KINDS:
            raise SpecError(f"GDNSpec.gate_kind must be one of {GATE_KINDS}, got {self.gate_kind!r}")
        if self.qkv_dtype not in QKV_DTYPES:
            raise SpecError(f"GDNSpec.qkv_dtype must be one of {QKV_DTYPES}, got {self.qkv_dtype!r}")
        if self.gate_dtype != "float32":
            raise SpecError(f"GDNSpec.gate_dtype must be 'float32' (bf16 gates are upcast), got {self.gate_dtype!r}")
        if self.state_dtype != "float32":
            raise SpecError(f"GDNSpec.state_dtype must be 'float32', got {self.state_dtype!r}")
        if self.state_layout not in STATE_LAYOUTS:
            raise SpecError(f"GDNSpec.state_layout must be one of {STATE_LAYOUTS}, got {self.state_layout!r}")
        if not (0.0 < float(self.beta_max) <= 2.0):
            raise SpecError(f"GDNSpec.beta_max must be in (0, 2], got {self.beta_max!r}")
        for name in ("qk_l2norm_in_kernel",) + GATE_OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"GDNSpec.{name} must be a bool, got {getattr(self, name)!r}")
        if self.allow_neg_eigval and not self.beta_sigmoid_in_kernel:
            raise SpecError("GDNSpec.allow_neg_eigval=True needs beta_sigmoid_in_kernel=True: it scales the in-kernel "
                            "sigmoid to 2 sigmoid(b), as FLA's allow_neg_eigval does")
        if (self.gate_in_kernel or self.beta_sigmoid_in_kernel) and self.gate_kind != "scalar":
            raise SpecError(f"GDNSpec.gate_in_kernel / beta_sigmoid_in_kernel are options of the scalar gate's "
                            f"kernels, not of gate_kind={self.gate_kind!r}")

    @property
    def group_size(self) -> int:
        """v-heads per q/k head (GVA group)."""
        return self.num_v_heads // self.num_qk_heads

    @property
    def name(self) -> str:
        """A stable, readable identifier, e.g. gdn_qk16_v32_k128_v128_c64_scalar_bf16_kv."""
        dt = {"bfloat16": "bf16", "float16": "fp16"}[self.qkv_dtype]
        parts = [
            f"gdn_qk{self.num_qk_heads}_v{self.num_v_heads}",
            f"k{self.head_k_dim}_v{self.head_v_dim}_c{self.chunk_size}",
            self.gate_kind,
            dt,
            self.state_layout,
        ]
        if self.qk_l2norm_in_kernel:
            parts.append("l2n")
        parts += [suffix for name, suffix in zip(GATE_OPTIONS, _GATE_OPTION_SUFFIXES) if getattr(self, name)]
        return "_".join(parts)

    @property
    def gate_options(self) -> tuple[bool, bool, bool]:
        """(gate_in_kernel, beta_sigmoid_in_kernel, allow_neg_eigval)."""
        return self.gate_in_kernel, self.beta_sigmoid_in_kernel, self.allow_neg_eigval

    def to_dict(self) -> dict:
        """The fields, less the in-kernel gate options where they are off: a spec without them has the
        dict (and so the plan JSON its library embeds) it had before the options existed, so packs and
        cache entries of such specs stay valid."""
        data = dataclasses.asdict(self)
        for name in GATE_OPTIONS:
            if not data[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "GDNSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"unknown GDNSpec field(s) {unknown}")
        return cls(**data)

    def with_heads(self, num_qk_heads: int, num_v_heads: int) -> "GDNSpec":
        return dataclasses.replace(self, num_qk_heads=num_qk_heads, num_v_heads=num_v_heads)
