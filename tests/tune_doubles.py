"""Test doubles for the tuner (never used outside tests): a synthetic builder, a fake oracle
checker and a synthetic timer whose costs are a fixed function of the tiles, plus a fake clock
the timer advances so budget stops are deterministic."""
from __future__ import annotations

from flashqla_tune.plan import TileParams
from flashqla_tune.tune.trial import BuildOutcome, CheckResult, Measurement


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SyntheticBuilder:
    """'Builds' instantly; plans whose block_v is in fail_block_v fail to compile."""

    def __init__(self, fail_block_v=(128,)):
        self.fail_block_v = tuple(fail_block_v)
        self.batches: list[list[str]] = []

    def build(self, plans):
        self.batches.append([p.name for p in plans])
        return {p.name: (BuildOutcome(error=f"synthetic compile error for block_v={p.tiles.block_v}")
                         if p.tiles.block_v in self.fail_block_v else BuildOutcome(handle=p.name))
                for p in plans}


class FakeOracleChecker:
    """Rejects configs with stages == 1 as if their output missed the oracle."""

    def __init__(self, wrong_stages=(1,)):
        self.wrong_stages = tuple(wrong_stages)
        self.checked: list[str] = []

    def check(self, plan, handle):
        self.checked.append(plan.name)
        if plan.tiles.stages in self.wrong_stages:
            return CheckResult(False, {"o": 0.5, "state": 0.75}, "fake oracle")
        return CheckResult(True, {"o": 1e-3, "state": 2e-3})


class SyntheticTimer:
    """Cost = a smooth function of the tiles, fastest at block_v=64, stages=2, consumer_regs=
    232, ctas_per_sm=1; each timing advances the fake clock by seconds_per_trial."""

    MIXES = ("1x2048", "1024+7168")

    def __init__(self, clock: FakeClock | None = None, seconds_per_trial: float = 0.0):
        self.clock, self.seconds_per_trial = clock, seconds_per_trial
        self.timed: list[str] = []

    @staticmethod
    def cost(t) -> float:
        return (1.0 + {64: 0.0, 128: 0.3}[t.block_v] + 0.1 * abs(t.stages - 2)
                + 0.002 * abs(t.consumer_regs - 232) / 8 + 0.001 * abs(t.producer_regs - 40) / 8
                + 0.05 * (t.ctas_per_sm - 1))

    def time(self, plan, handle):
        self.timed.append(plan.name)
        if self.clock is not None:
            self.clock.now += self.seconds_per_trial
        c = self.cost(plan.tiles)
        return {mix: c * (i + 1) for i, mix in enumerate(self.MIXES)}


class SyntheticAnchorTimer:
    """Stands in for FLA and FlashQLA: 'fla' takes twice the synthetic default's time per mix,
    'flashqla' is reported missing, as on a machine without it."""

    def __init__(self):
        self.specs: list = []

    def time(self, spec):
        self.specs.append(spec)
        base = SyntheticTimer.cost(TileParams())
        return {"fla": {"times_ms": {mix: 2 * base * (i + 1) for i, mix in enumerate(SyntheticTimer.MIXES)},
                        "version": "synthetic"},
                "flashqla": {"error": "ModuleNotFoundError: No module named 'flash_qla'"}}


class FailingAnchorTimer:
    def time(self, spec):
        raise RuntimeError("synthetic anchor failure")


def synthetic_measurement(clock=None, seconds_per_trial=0.0, anchors=None) -> Measurement:
    return Measurement(SyntheticBuilder(), FakeOracleChecker(), SyntheticTimer(clock, seconds_per_trial), anchors)


def run_worker(journal_root: str, max_trials: int, seed: int) -> None:
    """Entry point of a second tuner process sharing one journal (test_tune's two-process test)."""
    from pathlib import Path

    from flashqla_tune.spec import GDNSpec
    from flashqla_tune.tune.study import open_study, study_path
    from flashqla_tune.tune.trial import BatchTuner

    spec = GDNSpec(8, 8)
    study = open_study(spec, "SyntheticGPU", Path(journal_root), seed=seed)
    lock = study_path(spec, "SyntheticGPU", Path(journal_root)).with_suffix(".enqueue.lock")
    BatchTuner(spec, study, synthetic_measurement(), batch_size=2, max_trials=max_trials, lock_path=lock).run()
