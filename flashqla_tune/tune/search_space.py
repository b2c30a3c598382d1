"""The tuner's search space: every TileParams field, and the configs enqueued before sampling.

The space is the cross product of each field's legal values; most register splits do not fit
the SM, and KernelPlan validation (not this module) decides that, so the rules live in one place.
"""
from __future__ import annotations

import dataclasses

from ..plan import MAX_SETMAXNREG, KernelPlan, PlanError, TileParams, default_tiles
from ..spec import GDNSpec

REGISTER_STEPS = tuple(range(24, MAX_SETMAXNREG + 1, 8))   # setmaxnreg's values that plans accept
SPACE: dict[str, tuple[int, ...]] = {
    "block_v": (64, 128),
    "stages": (1, 2, 3),
    "producer_regs": REGISTER_STEPS,
    "consumer_regs": REGISTER_STEPS,
    "ctas_per_sm": (1, 2),
    "output_group": (0, 1),
    "prep_threads": (128, 256),
}
# Hand-picked variants that built and passed the oracle on the H200 (benchmarks/tile_sweep.py);
# known_good puts the spec's default first so every study has its baseline.
_KNOWN_GOOD = (
    TileParams(stages=3),
    TileParams(stages=3, prep_threads=128),
    TileParams(),
    TileParams(block_v=128),
    TileParams(block_v=128, producer_regs=24, consumer_regs=240),
    TileParams(stages=1, producer_regs=24, ctas_per_sm=2),
)

_mismatch = {f.name for f in dataclasses.fields(TileParams)} ^ set(SPACE)
if _mismatch:  # a new TileParams field must join the search space (or this check)
    raise ImportError(f"tune.search_space.SPACE and TileParams disagree on {sorted(_mismatch)}")


def params_of(tiles: TileParams) -> dict[str, int]:
    return dataclasses.asdict(tiles)


def tiles_from_params(params: dict) -> TileParams:
    unknown = sorted(set(params) - set(SPACE))
    if unknown:
        raise ValueError(f"unknown tile parameter(s) {unknown}; the space has {sorted(SPACE)}")
    return TileParams(**{k: int(v) for k, v in params.items()})


def suggest_tiles(trial) -> TileParams:
    """Draw every field; categorical so enqueued values and the sampler share one distribution."""
    return TileParams(**{name: trial.suggest_categorical(name, values) for name, values in SPACE.items()})


def validate(spec: GDNSpec, tiles: TileParams) -> str | None:
    """None when the tiles make a valid plan for spec, else KernelPlan's reason."""
    try:
        KernelPlan(spec, tiles)
    except PlanError as exc:
        return str(exc)
    return None


def known_good(spec: GDNSpec) -> list[TileParams]:
    """The known-good configs that are valid for spec, its default (plan.default_tiles) first."""
    default = default_tiles(spec)
    return [default] + [t for t in _KNOWN_GOOD if t != default and validate(spec, t) is None]
