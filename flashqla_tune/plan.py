"""KernelPlan: a GDNSpec plus the tile parameters the tuner searches.

Everything here changes generated code; per-head calibration tables never enter a plan (they
are data the kernels read), so one binary serves every layer of the same shape.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .spec import GDNSpec, SpecError

# setmaxnreg takes multiples of 8 in [24, 256]. Two warp groups of 128 threads can never exceed
# the SM's 65536 registers (128 x 512), so only the per-role ranges need checking.
SUPPORTED_HEAD_DIMS = (128,)


class PlanError(ValueError):
    """A tile parameter is out of range or does not fit the spec or the SM."""


@dataclass(frozen=True)
class TileParams:
    block_v: int = 64            # V columns of the state one CTA owns
    stages: int = 2              # shared-memory pipeline depth of the chunk loads
    producer_regs: int = 40      # registers per thread of the TMA producer warp group
    consumer_regs: int = 232     # registers per thread of the math warp group

    def validate(self, spec: GDNSpec) -> None:
        if self.block_v not in (32, 64, 128) or spec.head_v_dim % self.block_v:
            raise PlanError(f"block_v={self.block_v} must be 32, 64 or 128 and divide V={spec.head_v_dim}")
        if self.stages not in (1, 2, 3):
            raise PlanError(f"stages={self.stages} must be 1, 2 or 3")
        for name in ("producer_regs", "consumer_regs"):
            regs = getattr(self, name)
            if regs % 8 or not 24 <= regs <= 256:
                raise PlanError(f"{name}={regs} must be a multiple of 8 in [24, 256] (setmaxnreg)")
        # The S accumulator alone takes K * block_v / 128 fp32 registers per consumer thread.
        state_regs = spec.head_k_dim * self.block_v // 128
        if state_regs + 64 > self.consumer_regs:
            raise PlanError(f"consumer_regs={self.consumer_regs} cannot hold the {state_regs}-register state "
                            f"tile of block_v={self.block_v} plus working registers")


@dataclass(frozen=True)
class KernelPlan:
    spec: GDNSpec
    tiles: TileParams = TileParams()

    def __post_init__(self) -> None:
        s = self.spec
        if s.head_k_dim not in SUPPORTED_HEAD_DIMS or s.head_v_dim not in SUPPORTED_HEAD_DIMS:
            raise PlanError(f"unsupported head dims K={s.head_k_dim}, V={s.head_v_dim}: the Hopper kernel "
                            f"supports K = V = 128 (other dims come with the porting work)")
        if s.chunk_size != 64:
            raise PlanError(f"unsupported chunk_size={s.chunk_size}: the Hopper kernel uses 64")
        if s.gate_kind != "scalar":
            raise PlanError(f"unsupported gate_kind={s.gate_kind!r}: the Hopper kernel has the scalar gate")
        self.tiles.validate(s)

    @property
    def name(self) -> str:
        t = self.tiles
        return f"{self.spec.name}__bv{t.block_v}_st{t.stages}_r{t.producer_regs}x{t.consumer_regs}"

    def to_dict(self) -> dict:
        return {"spec": self.spec.to_dict(), "tiles": dataclasses.asdict(self.tiles)}

    @classmethod
    def from_dict(cls, data: dict) -> "KernelPlan":
        try:
            return cls(GDNSpec.from_dict(data["spec"]), TileParams(**data["tiles"]))
        except (KeyError, TypeError) as exc:
            raise PlanError(f"malformed plan {data!r}: {exc}") from exc


def kernel_spec(spec: GDNSpec) -> GDNSpec:
    """The spec with what the kernels take at run time (in-kernel L2 norm, beta range) reset,
    so models that differ only there share one binary."""
    return dataclasses.replace(spec, qk_l2norm_in_kernel=False, beta_max=2.0)


def default_plan(spec: GDNSpec) -> KernelPlan:
    return KernelPlan(kernel_spec(spec), TileParams())


__all__ = ["KernelPlan", "PlanError", "SpecError", "TileParams", "default_plan", "kernel_spec"]
