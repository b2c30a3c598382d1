"""KernelPlan: a GDNSpec plus the tile parameters the tuner searches.

Everything here changes generated code; per-head calibration tables never enter a plan (they
are data the kernels read), so one binary serves every layer of the same shape.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .spec import GDNSpec, SpecError
from .supported_shapes import spec_problem

# setmaxnreg takes multiples of 8 in [24, 256] (248 here, see MAX_SETMAXNREG). A CTA is one producer warp group, one consumer warp
# group per 64 state columns (block_v / 64) and optionally an output warp group. Its threads launch
# with the SM's 65536 registers / (threads x ctas_per_sm), rounded down to 8: that count times the
# threads is the pool its roles then split with setmaxnreg. Shared memory on sm_90: 228 KB per SM,
# of which each resident CTA also takes 1 KB for the system; at most 227 KB (232448 B) per CTA.
REGISTERS_PER_SM = 65536
# PTX allows setmaxnreg 256, but ptxas caps a kernel at 255 registers, and the split r256x256
# raises an illegal instruction on the H200.
MAX_SETMAXNREG = 248
SHARED_MEMORY_PER_SM = 233472
SHARED_MEMORY_PER_CTA = 232448
RESERVED_SHARED_MEMORY_PER_CTA = 1024
ROWS_PER_CONSUMER = 64        # wgmma M: state columns per consumer warp group
OUT_PITCH = ROWS_PER_CONSUMER + 8  # padded row of the O staging tile (csrc kOutPitch)
# A consumer holds the fp32 state slice (64), its 16-bit copy (32) and two 64 x 64 accumulators
# (64): below this many registers ptxas can only spill.
MIN_CONSUMER_REGS = 168


class PlanError(ValueError):
    """A tile parameter is out of range or does not fit the spec or the SM."""


@dataclass(frozen=True)
class TileParams:
    block_v: int = 64            # V columns of the state one CTA owns (64 per consumer warp group)
    stages: int = 2              # shared-memory pipeline depth of the chunk loads
    producer_regs: int = 40      # registers per thread of the TMA producer warp group
    consumer_regs: int = 232     # registers per thread of each math (consumer) warp group
    ctas_per_sm: int = 1         # CTAs resident per SM (two let two sequential chains share an SM)
    output_group: int = 0        # 1: a further warp group computes O from the chain's handed-over S and Vn
    prep_threads: int = 256      # the prep kernel's CTA: 256 solves 4 v-heads at once, 128 one at a time
                                 # on the tensor cores (4 CTAs/SM)

    @property
    def consumers(self) -> int:
        return self.block_v // ROWS_PER_CONSUMER

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers + self.output_group)

    def launch_regs(self) -> int:
        """Registers per thread at launch (what the output warp group keeps): the SM's registers
        over the resident threads, rounded down to setmaxnreg's step, at most 256. The CTA's pool is
        this times its threads (168 x 384 = 64512 for three warp groups, not 65536)."""
        return min(256, REGISTERS_PER_SM // self.ctas_per_sm // self.threads // 8 * 8)

    def validate(self, spec: GDNSpec) -> None:
        if self.block_v not in (64, 128) or spec.head_v_dim % self.block_v:
            raise PlanError(f"block_v={self.block_v} must be 64 or 128 (one or two consumer warp groups) "
                            f"and divide V={spec.head_v_dim}")
        if self.stages not in (1, 2, 3):
            raise PlanError(f"stages={self.stages} must be 1, 2 or 3")
        for name in ("producer_regs", "consumer_regs"):
            regs = getattr(self, name)
            if regs % 8 or not 24 <= regs <= MAX_SETMAXNREG:
                raise PlanError(f"{name}={regs} must be a multiple of 8 in [24, {MAX_SETMAXNREG}] (setmaxnreg; "
                                f"256 is above the 255 registers ptxas gives a kernel, and faulted on the H200)")
        if self.producer_regs > self.consumer_regs:
            raise PlanError(f"producer_regs={self.producer_regs} is above consumer_regs={self.consumer_regs}: ptxas "
                            f"sizes the kernel to the largest setmaxnreg count, and a producer's setmaxnreg.dec "
                            f"above it does not assemble (C7406)")
        if self.ctas_per_sm not in (1, 2):
            raise PlanError(f"ctas_per_sm={self.ctas_per_sm} must be 1 or 2")
        if self.output_group not in (0, 1):
            raise PlanError(f"output_group={self.output_group} must be 0 or 1")
        if self.prep_threads not in (128, 256):
            raise PlanError(f"prep_threads={self.prep_threads} must be 128 or 256 (one or two warp groups)")
        if self.output_group and self.block_v != 64:
            raise PlanError(f"output_group=1 pairs the output warp group with one chain: block_v must be 64, "
                            f"not {self.block_v}")
        launch = self.launch_regs()
        pool = launch * self.threads
        used = 128 * (self.producer_regs + self.consumers * self.consumer_regs + self.output_group * launch)
        if self.producer_regs > launch:  # the producer's setmaxnreg only lowers its count
            raise PlanError(f"producer_regs={self.producer_regs} exceeds the {launch} registers per thread at "
                            f"launch ({self.threads} threads, ctas_per_sm={self.ctas_per_sm}); setmaxnreg can only "
                            f"lower it")
        if used > pool:
            extra = f" + the output warp group's {launch}" if self.output_group else ""
            raise PlanError(f"producer_regs={self.producer_regs} + {self.consumers} x consumer_regs="
                            f"{self.consumer_regs}{extra} need {used} registers per CTA; ctas_per_sm={self.ctas_per_sm} "
                            f"leaves {pool}")
        smem = self.shared_memory_bytes(spec)
        allowed = min(SHARED_MEMORY_PER_CTA, SHARED_MEMORY_PER_SM // self.ctas_per_sm - RESERVED_SHARED_MEMORY_PER_CTA)
        if smem > allowed:
            raise PlanError(f"block_v={self.block_v}, stages={self.stages} need {smem} B of shared memory per CTA; "
                            f"{self.ctas_per_sm} CTA(s) per SM allow {allowed} B")
        if self.consumer_regs < MIN_CONSUMER_REGS:
            raise PlanError(f"consumer_regs={self.consumer_regs} is below {MIN_CONSUMER_REGS}, the registers a "
                            f"consumer's state slice, its 16-bit copy and two accumulators take")

    def shared_memory_bytes(self, spec: GDNSpec) -> int:
        """The main kernel's shared storage (csrc/gdn_fwd_mainloop.cuh SharedStorage), 16-bit
        elements: per stage q, k [C x K], v [C x block_v], Aw, P [C x C]; then the double-buffered
        O staging [2 x C x OUT_PITCH] per consumer; the output warp group's handoff, S [C x K] and
        Vn [C x C] twice (a 16-byte token without the group); the gates [C] fp32 per stage; then
        the barriers."""
        C, K, bv = spec.chunk_size, spec.head_k_dim, self.block_v
        stage = 2 * (2 * C * K + C * bv + 2 * C * C)
        out = 2 * self.consumers * 2 * C * OUT_PITCH
        handoff = 2 * 2 * (C * K + C * C) if self.output_group else 16
        gates = 4 * C * self.stages
        return self.stages * stage + _round_up(_round_up(out, 1024) + handoff + gates + 16 * self.stages + 32, 1024)


def _round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


@dataclass(frozen=True)
class KernelPlan:
    spec: GDNSpec
    tiles: TileParams = TileParams()

    def __post_init__(self) -> None:
        problem = spec_problem(self.spec)   # the supported-shape table (supported_shapes.py)
        if problem:
            raise PlanError(problem)
        self.tiles.validate(self.spec)

    @property
    def name(self) -> str:
        t = self.tiles
        occupancy = f"_c{t.ctas_per_sm}" if t.ctas_per_sm != 1 else ""
        output = "_og" if t.output_group else ""
        prep = f"_p{t.prep_threads}" if t.prep_threads != 256 else ""
        return (f"{self.spec.name}__bv{t.block_v}_st{t.stages}_r{t.producer_regs}x{t.consumer_regs}"
                f"{occupancy}{output}{prep}")

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
    so models that differ only there share one binary. The in-kernel gate and beta options stay:
    they change the prep kernel's code (csrc/gdn_gate_options.cuh)."""
    return dataclasses.replace(spec, qk_l2norm_in_kernel=False, beta_max=2.0)


def default_tiles(spec: GDNSpec) -> TileParams:
    """The untuned tiles for spec (docs/kernel-notes.md gives the measurements behind each choice;
    docs/results/tile-sweep.json and prep-variants.log hold them). Three pipeline stages: faster
    than two on all but one row of the H200 sweep. Up to three v-heads per q/k head take the
    128-thread prep CTA (four CTAs per SM): one head would leave a 256-thread CTA's solve to a
    quarter of its threads, and two or three are solved in turn on the tensor cores while the other
    warp group writes P. From four v-heads per q/k head the 256-thread CTA solves up to four heads
    at once on the tensor cores, which is faster than 128 threads on the short rows and within a
    few percent on the long ones."""
    return TileParams(stages=3, prep_threads=128 if spec.num_v_heads <= 3 * spec.num_qk_heads else 256)


def default_plan(spec: GDNSpec) -> KernelPlan:
    return KernelPlan(kernel_spec(spec), default_tiles(spec))


__all__ = ["KernelPlan", "PlanError", "SpecError", "TileParams", "default_plan", "default_tiles", "kernel_spec"]
