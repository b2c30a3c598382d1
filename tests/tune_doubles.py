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


# ---- doubles that run inside isolation.py's measuring process (the isolation tests) ----

_CONTEXT_LOST = False   # this process's synthetic stand-in for a sticky CUDA error


class FaultingChecker:
    """Checks like a GPU whose kernels can fault, hang or kill the process, synthetically:
    stages in fault_stages 'fault' and, like a sticky CUDA error, every later check or timing in
    the same process fails too; stages in hang_stages never answer; prep_threads in
    crash_prep_threads end the process."""

    def __init__(self, fault_stages=(), hang_stages=(), crash_prep_threads=()):
        self.fault_stages, self.hang_stages = tuple(fault_stages), tuple(hang_stages)
        self.crash_prep_threads = tuple(crash_prep_threads)

    def check(self, plan, handle):
        global _CONTEXT_LOST
        import os
        import time

        if _CONTEXT_LOST:
            raise RuntimeError("synthetic: the context is already lost")
        if plan.tiles.stages in self.fault_stages:
            _CONTEXT_LOST = True
            raise RuntimeError("synthetic illegal instruction")
        if plan.tiles.stages in self.hang_stages:
            time.sleep(3600)
        if plan.tiles.prep_threads in self.crash_prep_threads:
            os._exit(3)
        return CheckResult(True, {"o": 1e-3, "state": 2e-3}, f"pid {os.getpid()}")


class LosableSyntheticTimer(SyntheticTimer):
    """SyntheticTimer that fails once FaultingChecker has 'lost the context' of this process."""

    def time(self, plan, handle):
        if _CONTEXT_LOST:
            raise RuntimeError("synthetic: the context is already lost")
        return super().time(plan, handle)


def faulting_measurement(fault_stages=(), hang_stages=(), crash_prep_threads=()) -> Measurement:
    """The measuring process's side (no builder): FaultingChecker, LosableSyntheticTimer and a
    context probe that reports the synthetic loss."""
    return Measurement(None, FaultingChecker(fault_stages, hang_stages, crash_prep_threads), LosableSyntheticTimer(),
                       context_alive=lambda: not _CONTEXT_LOST)


def failing_setup() -> Measurement:
    raise RuntimeError("synthetic: no GPU in the measuring process")
