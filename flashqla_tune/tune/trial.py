"""The tuning loop: ask a batch of trials, prune the invalid and the duplicates, build the rest
in one parallel ninja run, then check and time them one at a time.

What happens to a trial, in order (the reason is kept as the user attr "prune_reason", the
stage as "stage"):
  invalid     the tiles fail KernelPlan validation (never built)
  duplicate   another trial already took these tiles (never built)
  compile     nvcc/ninja failed for this plan
  launch      loading or launching the library raised, faulted or hung (checks and timings run in
              a child process, tune/isolation.py, replaced after a fault, so the next trial is clean)
  wrong       the result misses the oracle, as one chain or with context parallelism forced
              (never timed; the error numbers are kept)
  complete    value = sum over the length mix of the median graph-replay time (ms)

The builder, checker and timer are injected (see measure.py for the GPU ones), so the same
loop runs on the CPU with test doubles.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import optuna
from filelock import FileLock
from optuna.trial import TrialState

from ..plan import KernelPlan, TileParams, default_tiles
from ..spec import GDNSpec
from .search_space import known_good, params_of, suggest_tiles, tiles_from_params, validate

MAX_DRAWS_PER_BATCH = 64    # invalid or duplicate draws tolerated while filling one batch


@dataclass
class BuildOutcome:
    handle: object | None = None     # what checker and timer receive (a cache entry on the GPU path)
    error: str | None = None


@dataclass
class CheckResult:
    ok: bool
    errors: dict = field(default_factory=dict)   # e.g. {"o": rel L2, "state": rel L2}
    detail: str = ""


class Builder(Protocol):
    def build(self, plans: list[KernelPlan]) -> dict[str, BuildOutcome]: ...   # keyed by plan.name


class Checker(Protocol):
    def check(self, plan: KernelPlan, handle) -> CheckResult: ...


class Timer(Protocol):
    def time(self, plan: KernelPlan, handle) -> dict[str, float]: ...   # length mix label -> median ms


class AnchorTimer(Protocol):
    # FLA, FlashQLA on the same mixes and inputs: {name: {"times_ms": {mix: ms}} or {"error": why}}
    def time(self, spec: GDNSpec) -> dict[str, dict]: ...


class MeasurementUnavailable(RuntimeError):
    """Nothing can be measured (the measuring process cannot start): stops the run instead of
    pruning every trial with the same reason."""


@dataclass
class Measurement:
    builder: Builder
    checker: Checker
    timer: Timer
    anchors: AnchorTimer | None = None   # timed once per run, after the search
    # False once this process's GPU context is lost (isolation.py restarts the measuring process)
    context_alive: Callable[[], bool] | None = None
    close: Callable[[], None] | None = None   # ends what the measurement holds (isolation's child)


@dataclass
class TuneResult:
    spec: GDNSpec
    study_name: str
    best: optuna.trial.FrozenTrial | None
    default: optuna.trial.FrozenTrial | None
    trials: list                       # every FrozenTrial of the study (all workers)
    evaluated_here: int                # trials this call built (or found broken)
    stopped_because: str
    anchors: dict = field(default_factory=dict)   # AnchorTimer.time's answer for this run

    @property
    def best_tiles(self) -> TileParams | None:
        return None if self.best is None else tiles_from_params(self.best.params)

    @property
    def best_plan(self) -> KernelPlan | None:
        return None if self.best is None else KernelPlan(self.spec, self.best_tiles)

    @property
    def speedup(self) -> float | None:
        if self.best is None or self.default is None or not self.best.value:
            return None
        return self.default.value / self.best.value

    def speedup_over(self, anchor: str) -> float | None:
        """The anchor's sum of medians over the best config's, on the same mixes of this run."""
        times = self.anchors.get(anchor, {}).get("times_ms")
        best = None if self.best is None else self.best.user_attrs.get("times_ms")
        if not times or not best or set(times) != set(best) or not self.best.value:
            return None
        return sum(times.values()) / sum(best.values())


# A tuned config may lose to the default on no length mix by more than this: well above the
# spread of repeated medians of one config across H200 machines.
MIX_TOLERANCE = 0.01


def per_mix_speedups(trial, default) -> dict[str, float]:
    """trial's gain over default on each length mix both timed (default ms / trial ms)."""
    mine, base = trial.user_attrs.get("times_ms") or {}, default.user_attrs.get("times_ms") or {}
    return {mix: base[mix] / ms for mix, ms in mine.items() if mix in base and ms > 0}


def slower_mixes(trial, default, tolerance: float = MIX_TOLERANCE) -> list[str]:
    """The length mixes on which trial is slower than default by more than tolerance."""
    return [mix for mix, gain in per_mix_speedups(trial, default).items() if gain * (1 + tolerance) < 1]


def best_trial(done: list, default=None):
    """The fastest completed trial by the sum over the mixes, among those no slower than the
    default on any mix (a sum can hide a length that got worse); the default when none is."""
    if default is not None and default.user_attrs.get("times_ms"):
        done = [t for t in done if not slower_mixes(t, default)] or [default]
    return min(done, key=lambda t: t.value) if done else None


# Which process asked for a trial: shows how workers sharing a journal split the study.
WORKER = f"{socket.gethostname()}:{os.getpid()}"


def _prune(study: optuna.Study, trial: optuna.Trial, stage: str, reason: str, **attrs) -> None:
    trial.set_user_attr("stage", stage)
    trial.set_user_attr("prune_reason", reason[:2000])
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    study.tell(trial, state=TrialState.PRUNED)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def enqueue_known_good(study: optuna.Study, spec: GDNSpec, lock_path: Path | None = None) -> int:
    """Enqueue the valid known-good configs (default first) once per study; returns how many
    are new. A file lock makes concurrent workers enqueue each config once."""
    configs = known_good(spec)

    def enqueue() -> int:
        seen = [t.params for t in study.get_trials(deepcopy=False)] + \
               [t.system_attrs.get("fixed_params") for t in study.get_trials(deepcopy=False)]
        added = 0
        for tiles in configs:
            params = params_of(tiles)
            if params not in seen:
                study.enqueue_trial(params, user_attrs={"known_good": True})
                added += 1
        return added

    if lock_path is None:
        return enqueue()
    with FileLock(str(lock_path)):
        return enqueue()


def duplicate_of(study: optuna.Study, trial: optuna.Trial, params: dict) -> int | None:
    """The number of an earlier trial with the same tiles that was (or is being) evaluated."""
    for other in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                          TrialState.RUNNING, TrialState.WAITING)):
        if other.number >= trial.number:
            continue
        other_params = other.params or other.system_attrs.get("fixed_params") or {}
        if other_params == params and other.user_attrs.get("stage") not in ("invalid", "duplicate"):
            return other.number
    return None


class BatchTuner:
    """Runs trials of one study until the budget, the trial cap or the space runs out.

    batch_size trials are built together (ninja spreads them over the cores); each is then
    checked and timed alone. clock is injectable so tests can stop on a synthetic budget.
    """

    def __init__(self, spec: GDNSpec, study: optuna.Study, measurement: Measurement, *, batch_size: int = 2,
                 budget_s: float | None = None, max_trials: int | None = None, progress: bool = False,
                 clock: Callable[[], float] = time.monotonic, lock_path: Path | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        if budget_s is not None and budget_s <= 0:
            raise ValueError(f"budget_s={budget_s} must be positive")
        if max_trials is not None and max_trials < 1:
            raise ValueError(f"max_trials={max_trials} must be at least 1")
        self.spec, self.study, self.m = spec, study, measurement
        self.batch_size, self.budget_s, self.max_trials = batch_size, budget_s, max_trials
        self.progress, self.clock, self.lock_path = progress, clock, lock_path
        self.evaluated = 0

    def _out_of_budget(self, start: float) -> bool:
        return self.budget_s is not None and self.clock() - start >= self.budget_s

    def _draw_batch(self) -> tuple[list[tuple[optuna.Trial, KernelPlan]], bool]:
        """Up to batch_size valid, new trials; the flag says the draws ran dry."""
        batch: list[tuple[optuna.Trial, KernelPlan]] = []
        want = self.batch_size if self.max_trials is None else min(self.batch_size, self.max_trials - self.evaluated)
        draws = 0
        while len(batch) < want and draws < MAX_DRAWS_PER_BATCH:
            draws += 1
            trial = self.study.ask()
            trial.set_user_attr("worker", WORKER)
            tiles = suggest_tiles(trial)
            reason = validate(self.spec, tiles)
            if reason is not None:
                _prune(self.study, trial, "invalid", reason)
                continue
            earlier = duplicate_of(self.study, trial, params_of(tiles))
            if earlier is not None:
                _prune(self.study, trial, "duplicate", f"same tiles as trial {earlier}", duplicate_of=earlier)
                continue
            batch.append((trial, KernelPlan(self.spec, tiles)))
        return batch, len(batch) < want

    def _evaluate(self, trial: optuna.Trial, plan: KernelPlan, outcome: BuildOutcome | None) -> None:
        trial.set_user_attr("plan", plan.name)
        if outcome is None or outcome.error is not None or outcome.handle is None:
            why = "no build result" if outcome is None else (outcome.error or "builder returned no library")
            _prune(self.study, trial, "compile", why)
            return
        try:
            check = self.m.checker.check(plan, outcome.handle)
        except MeasurementUnavailable:
            raise
        except Exception as exc:   # a launch or load failure is a property of this config
            _prune(self.study, trial, "launch", f"correctness run failed: {_short(exc)}")
            return
        if not check.ok:
            numbers = ", ".join(f"{k} rel err {v:.3g}" for k, v in check.errors.items())
            _prune(self.study, trial, "wrong", f"wrong result ({numbers}) {check.detail}".strip(),
                   check_errors=check.errors)
            return
        trial.set_user_attr("check_errors", check.errors)
        try:
            times = self.m.timer.time(plan, outcome.handle)
        except MeasurementUnavailable:
            raise
        except Exception as exc:
            _prune(self.study, trial, "launch", f"timing run failed: {_short(exc)}")
            return
        if not times:
            _prune(self.study, trial, "launch", "timer returned no measurement")
            return
        trial.set_user_attr("stage", "complete")
        trial.set_user_attr("times_ms", times)
        self.study.tell(trial, sum(times.values()))

    def run(self) -> TuneResult:
        start = self.clock()
        enqueue_known_good(self.study, self.spec, self.lock_path)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=self.max_trials, desc=f"tune {self.spec.name}", unit="trial")
        stopped = "trial cap"
        try:
            while True:
                if self.max_trials is not None and self.evaluated >= self.max_trials:
                    stopped = f"trial cap ({self.max_trials})"
                    break
                if self._out_of_budget(start):
                    stopped = f"time budget ({self.budget_s:g} s)"
                    break
                batch, dry = self._draw_batch()
                pending = [trial for trial, _ in batch]
                try:
                    outcomes = self.m.builder.build([plan for _, plan in batch]) if batch else {}
                    for trial, plan in batch:
                        self._evaluate(trial, plan, outcomes.get(plan.name))
                        pending.remove(trial)
                        self.evaluated += 1
                        if bar is not None:
                            bar.update(1)
                            best = self._best()
                            if best is not None:
                                bar.set_postfix(best_ms=f"{best.value:.3f}")
                except BaseException:
                    # Interrupted (Ctrl-C, a crashed builder): close the batch's open trials as
                    # FAIL so they do not stay RUNNING in the shared journal; a rerun samples anew.
                    for trial in pending:
                        trial.set_user_attr("stage", "interrupted")
                        self.study.tell(trial, state=TrialState.FAIL)
                    raise
                if dry and not batch:
                    stopped = f"search space exhausted ({MAX_DRAWS_PER_BATCH} draws gave no new valid config)"
                    break
        finally:
            if bar is not None:
                bar.close()
        return self.result(stopped)

    def _default_trial(self, done):
        default = params_of(default_tiles(self.spec))
        return next((t for t in done if t.params == default), None)

    def _best(self):
        done = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
        return best_trial(done, self._default_trial(done))

    def result(self, stopped: str = "") -> TuneResult:
        trials = self.study.get_trials(deepcopy=False)
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        default = self._default_trial(done)
        best = best_trial(done, default)
        return TuneResult(self.spec, self.study.study_name, best, default,
                          trials, self.evaluated, stopped, self._time_anchors() if best is not None else {})

    def _time_anchors(self) -> dict:
        """The anchors on this run's GPU and mixes; a failure is recorded, never the run's failure."""
        if self.m.anchors is None:
            return {}
        try:
            return self.m.anchors.time(self.spec)
        except Exception as exc:
            return {"anchors": {"error": _short(exc)}}
