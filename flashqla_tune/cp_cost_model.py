"""Context-parallel segment lengths: the default cost model (docs/cp-design.md).

A long sequence with few heads leaves most SMs idle: one CTA per (v-tile, v-head) walks all its
chunks. Cutting the sequence into S segments of L chunks runs more CTAs at once:
- a warm-up head's segment first runs its window of n_h chunks from a zero state, then its own
  L chunks (L + n_h chunk-steps, all segments in parallel);
- an exact head (n_h = -1) chains exactly: a state-only pass per segment gives its zero-state end
  state H and its transition M (2 L), a chain walks the boundaries (S_{s+1} = M_s S_s + H_s, one
  128^3 fp32 product each), then the forward runs each segment from its chained state (L).
The model, in chunk-steps (the time one chain needs per chunk; docs/cp-design.md, "The cost model"):

    depth      = the longest dependent path: L + n_max (warm-up); L + S chain steps + L (exact)
    work       = sum over CTAs of (chunk-steps walked + start cost)
    makespan  ~= max(depth, work / resident CTA slots) + fixed CP cost + the prep
                 + a wave tail per wave of a pass beyond the first
The prep (the per-chunk WY solve) runs beside the chains without CP when the chains leave SMs
free; with CP the state pass needs all of it first, so CP pays it in full.

Batch invariance (DESIGN.md) forbids looking at the rest of the batch, yet a split that fills an
idle GPU for a lone sequence multiplies the work (3x for exact heads) when other sequences
already fill it. The choice therefore minimises the lone makespan times work_inflation **
`batch_weight`, a hedge between the two cases fitted to the H200 scoreboard (docs/cp-design.md,
"The cost model"). For each sequence-length bucket (a power of two in chunks; segment_policy.py)
the model keeps the L that minimises it if it beats no segmentation by `min_gain`, else 0 (no
CP). L is always longer than the longest window it warms up over (DESIGN.md, "Calibration
contract"). The tuner refines the table on the GPU; this is the documented default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .segment_policy import SEGMENT_BUCKETS


class CostModelError(ValueError):
    """A warm-up profile, machine description or segment table that the model cannot use."""


def check_segment_table(lengths) -> tuple[int, ...]:
    """A segment table as the kernels read it: SEGMENT_BUCKETS non-negative ints (chunks per
    length bucket, 0 = no split)."""
    try:
        values = tuple(lengths)
    except TypeError:
        raise CostModelError(f"a segment table is a list of {SEGMENT_BUCKETS} ints, got {lengths!r}") from None
    if len(values) != SEGMENT_BUCKETS or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                 for n in values):
        raise CostModelError(f"a segment table has {SEGMENT_BUCKETS} non-negative ints (chunks per length "
                          f"bucket), got {list(values)!r}")
    return values


@dataclass(frozen=True)
class WarmupProfile:
    """What the planner needs from a calibration: pooled over every (layer, v-head) pair."""
    exact_share: float     # fraction of pairs chained exactly (n_h = -1)
    mean_window: float     # mean n_h of the warm-up pairs, in chunks
    max_window: int        # largest n_h: a segment must be longer than this

    def __post_init__(self):
        if not 0.0 <= self.exact_share <= 1.0:
            raise CostModelError(f"exact_share={self.exact_share} must lie in [0, 1]")
        if self.max_window < 0 or not 0.0 <= self.mean_window <= self.max_window:
            raise CostModelError(f"mean_window={self.mean_window} and max_window={self.max_window} must satisfy "
                              f"0 <= mean <= max")

    @classmethod
    def from_tables(cls, tables: list[list[int]]) -> "WarmupProfile":
        """From per-layer warm-up tables (the kernel's values: n_h >= 1, or -1 = exact)."""
        values = [n for table in tables for n in table]
        if not values:
            raise CostModelError("no warm-up values: a profile needs at least one (layer, head) entry")
        bad = [n for n in values if n != -1 and n < 1]
        if bad:
            raise CostModelError(f"warm-up values must be -1 (exact) or >= 1 chunks, got {bad[0]}")
        warm = [n for n in values if n > 0]
        return cls(exact_share=1.0 - len(warm) / len(values),
                   mean_window=sum(warm) / len(warm) if warm else 0.0,
                   max_window=max(warm) if warm else 0)

    @classmethod
    def from_calibration(cls, calibration) -> "WarmupProfile":
        return cls.from_tables([layer.warmup_table for layer in calibration.layers])


@dataclass(frozen=True)
class Machine:
    """The H200's costs in chunk-steps, fitted to tools/cp_profile.py's measurements."""
    sms: int = 132               # H200
    ctas_per_sm: int = 1         # resident sequential-kernel CTAs per SM (the plan's ctas_per_sm)
    cta_start: float = 2.0       # chunk-steps a CTA spends before its first chunk (state load, pipeline fill)
    chain_step: float = 4.0      # chunk-steps per boundary of the exact chain (a 128^3 fp32 product)
    cp_fixed: float = 8.0        # the planning, the chain's first fill, two more launches
    state_step: float = 0.4      # a state-only chunk-step (H, M, windows: no output GEMMs) per forward one:
                                 # the flat optimum of tools/fit_cp_model.py with the chain and prep costs
                                 # at their measured values (docs/cp-design.md, "The cost model")
    prep_item: float = 7.5       # chunk-steps one SM spends on a (chunk, q/k head) prep item
    batch_weight: float = 0.40   # exponent of the work inflation in the objective (see the module doc):
                                 # large enough to drop splits that win alone but lose in batches of two
                                 # (docs/cp-design.md, "The cost model")
    wave_tail: float = 25.0      # chunk-steps each wave of a CP pass beyond the first adds: the passes are
                                 # separate launches, so more CTAs than slots end in a tail that work / slots
                                 # misses (fit: docs/cp-design.md, "The cost model")
    min_segment: int = 32        # chunks: shorter segments lost to one chain in batches of long sequences

    def __post_init__(self):
        costs = (self.cta_start, self.chain_step, self.cp_fixed, self.state_step, self.prep_item, self.batch_weight,
                 self.wave_tail)
        if self.sms < 1 or self.ctas_per_sm < 1 or self.min_segment < 1 or min(costs) < 0:
            raise CostModelError(f"machine sms={self.sms}, ctas_per_sm={self.ctas_per_sm}, min_segment={self.min_segment} "
                              f"must be >= 1 and cta_start={self.cta_start}, chain_step={self.chain_step}, "
                              f"cp_fixed={self.cp_fixed}, state_step={self.state_step}, prep_item={self.prep_item}, "
                              f"batch_weight={self.batch_weight}, wave_tail={self.wave_tail} >= 0")


def _work(chunks: int, segment: int, chains: int, profile: WarmupProfile, machine: Machine) -> float:
    """Chunk-steps summed over every CTA (the prep and fixed costs aside)."""
    start = machine.cta_start
    if segment <= 0 or segment >= chunks:
        return chains * (chunks + start)
    segments = math.ceil(chunks / segment)
    warm_chains = chains * (1.0 - profile.exact_share)
    exact_chains = chains * profile.exact_share
    state = machine.state_step
    return (warm_chains * segments * (segment + start + state * (profile.mean_window + start))
            + exact_chains * segments * ((1 + 2 * state) * (segment + start) + machine.chain_step))


def makespan(chunks: int, segment: int, chains: int, profile: WarmupProfile, machine: Machine,
             qk_heads: int = 1) -> float:
    """Modelled chunk-steps for one sequence of `chunks` chunks over `chains` (v-tile, v-head)
    chains and `qk_heads` q/k heads (the prep's items); segment 0 (or >= chunks) means no CP."""
    slots = machine.sms * machine.ctas_per_sm
    prep = machine.prep_item * chunks * qk_heads / machine.sms
    work = _work(chunks, segment, chains, profile, machine)
    if segment <= 0 or segment >= chunks:
        # csrc/gdn_fwd_host.cuh runs the prep beside the chains when 12 SMs per q/k head are free
        # and the sequence has at least 4096 tokens
        hidden = machine.sms - math.ceil(chains / machine.ctas_per_sm) >= 12 * qk_heads and chunks >= 64
        return max(chunks + machine.cta_start, work / slots) + (0.0 if hidden else prep)
    segments = math.ceil(chunks / segment)
    start, state = machine.cta_start, machine.state_step
    depth = segment + start + state * (profile.max_window + start)
    if profile.exact_share > 0:
        depth = max(depth, (1 + state) * (segment + start) + segments * machine.chain_step)
    waves = math.ceil(chains * segments / slots)  # of each pass (state, forward): one CTA per chain and segment
    return max(depth, work / slots) + machine.cp_fixed + prep + machine.wave_tail * (waves - 1)


def objective(chunks: int, segment: int, chains: int, profile: WarmupProfile, machine: Machine,
              qk_heads: int = 1) -> float:
    """What the segment length minimises: the lone makespan, hedged by the work inflation."""
    single = _work(chunks, 0, chains, profile, machine)
    inflation = _work(chunks, segment, chains, profile, machine) / single if single > 0 else 1.0
    return makespan(chunks, segment, chains, profile, machine, qk_heads) * inflation ** machine.batch_weight


def segment_length(chunks: int, chains: int, profile: WarmupProfile, machine: Machine,
                   min_gain: float = 1.1, qk_heads: int = 1) -> int:
    """The segment length (chunks) for one sequence length, or 0 when CP does not pay."""
    if chains < 1 or chunks < 0 or qk_heads < 1:
        raise CostModelError(f"chains={chains} and qk_heads={qk_heads} must be >= 1 and chunks={chunks} >= 0")
    base = objective(chunks, 0, chains, profile, machine, qk_heads)
    best, best_cost = 0, base
    length = 1
    while length < chunks:
        if length > profile.max_window and length >= machine.min_segment:
            cost = objective(chunks, length, chains, profile, machine, qk_heads)
            if cost < best_cost:
                best, best_cost = length, cost
        length *= 2
    return best if best and base >= min_gain * best_cost else 0


def segment_table(chains: int, profile: WarmupProfile, machine: Machine, max_log2_chunks: int = 14,
                  min_gain: float = 1.1, qk_heads: int = 1) -> dict[int, int]:
    """{bucket: segment length}: a sequence of c chunks uses the entry of the power of two at or
    above c. 2^14 chunks is 1M tokens; longer sequences use the last bucket's length."""
    return {2 ** b: segment_length(2 ** b, chains, profile, machine, min_gain, qk_heads)
            for b in range(max_log2_chunks + 1)}


__all__ = ["CostModelError", "Machine", "WarmupProfile", "check_segment_table", "makespan", "objective",
           "segment_length", "segment_table"]
