"""The tuner's measuring process (flashqla_tune/tune/isolation.py) on the CPU, with doubles that
stand in for a kernel fault (a sticky error in its process), a hung kernel and a crashed process
(tune_doubles.FaultingChecker): each costs the trial that caused it; the trials after it run in a
fresh process and complete."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from flashqla_tune.plan import kernel_spec
from flashqla_tune.spec import GDNSpec
from flashqla_tune.tune.isolation import CallTimeouts, isolated
from flashqla_tune.tune.study import open_study
from flashqla_tune.tune.trial import BatchTuner, Measurement, MeasurementUnavailable

sys.path.insert(0, str(Path(__file__).parent))
from tune_doubles import (LosableSyntheticTimer, SyntheticBuilder, faulting_measurement,  # noqa: E402
                          failing_setup)

optuna.logging.set_verbosity(optuna.logging.WARNING)
SPEC = kernel_spec(GDNSpec(8, 8))


def _run(tmp_path, measurement, max_trials=12):
    study = open_study(SPEC, "SyntheticGPU", tmp_path, seed=3)
    try:
        BatchTuner(SPEC, study, measurement, batch_size=2, max_trials=max_trials).run()
    finally:
        if measurement.close is not None:
            measurement.close()
    return [t for t in study.get_trials() if t.user_attrs.get("stage") not in ("invalid", "duplicate", None)]


def _first(trials, predicate):
    return next(t.number for t in trials if predicate(t))


def test_a_fault_costs_only_its_own_trial(tmp_path):
    m = isolated(SyntheticBuilder(), functools.partial(faulting_measurement, fault_stages=(1,)), anchors=False)
    trials = _run(tmp_path, m)
    faulted = [t for t in trials if t.params.get("stages") == 1 and t.params.get("block_v") == 64]
    assert faulted, "the known-good stages=1 config should have been tried"
    for t in faulted:
        assert t.state == TrialState.PRUNED and t.user_attrs["stage"] == "launch"
        assert "synthetic illegal instruction" in t.user_attrs["prune_reason"]
        assert "context was lost" in t.user_attrs["prune_reason"]
    first_fault = min(t.number for t in faulted)
    later = [t for t in trials if t.number > first_fault and t.state == TrialState.COMPLETE]
    assert later, "no trial completed after the fault: the lost process was not replaced"
    assert all("already lost" not in t.user_attrs.get("prune_reason", "") for t in trials)


def test_without_isolation_a_fault_takes_every_later_trial(tmp_path):
    # the failure mode isolation exists for, shown with the same doubles in one process
    parts = faulting_measurement(fault_stages=(1,))
    m = Measurement(SyntheticBuilder(), parts.checker, LosableSyntheticTimer())
    try:
        trials = _run(tmp_path, m)
        first_fault = _first(trials, lambda t: "synthetic illegal instruction" in t.user_attrs.get("prune_reason", ""))
        later = [t for t in trials if t.number > first_fault and t.user_attrs["stage"] != "compile"]
        assert later and all("already lost" in t.user_attrs["prune_reason"] for t in later)
    finally:
        import tune_doubles
        tune_doubles._CONTEXT_LOST = False


def test_a_hung_trial_is_stopped_and_the_next_one_runs(tmp_path):
    m = isolated(SyntheticBuilder(), functools.partial(faulting_measurement, hang_stages=(2,)), anchors=False,
                 timeouts=CallTimeouts(check_s=3.0))
    trials = _run(tmp_path, m, max_trials=8)
    hung = [t for t in trials if t.params.get("stages") == 2 and t.user_attrs["stage"] == "launch"]
    assert hung and all("no answer within 3 s" in t.user_attrs["prune_reason"] for t in hung)
    assert any(t.state == TrialState.COMPLETE and t.number > hung[0].number for t in trials)


def test_a_crashed_process_is_replaced(tmp_path):
    m = isolated(SyntheticBuilder(), functools.partial(faulting_measurement, crash_prep_threads=(128,)),
                 anchors=False)
    trials = _run(tmp_path, m, max_trials=8)
    crashed = [t for t in trials if t.params.get("prep_threads") == 128 and t.user_attrs["stage"] == "launch"]
    assert crashed and all("died (exit code 3)" in t.user_attrs["prune_reason"] for t in crashed)
    assert any(t.state == TrialState.COMPLETE and t.number > crashed[0].number for t in trials)


def test_a_measuring_process_that_cannot_start_stops_the_run(tmp_path):
    m = isolated(SyntheticBuilder(), failing_setup, anchors=False)
    with pytest.raises(MeasurementUnavailable, match="no GPU in the measuring process"):
        _run(tmp_path, m, max_trials=4)
    study = open_study(SPEC, "SyntheticGPU", tmp_path, seed=3)
    assert not [t for t in study.get_trials() if t.state == TrialState.RUNNING]
