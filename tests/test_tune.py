"""The tuner's bookkeeping on the CPU with test doubles (SyntheticBuilder, FakeOracleChecker,
SyntheticTimer): enqueued known-good configs, pruning with reasons, best-config choice, the
budget stop, resume from the journal, and two processes sharing one journal."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from flashqla_tune.plan import TileParams, default_tiles, kernel_spec
from flashqla_tune.spec import GDNSpec
from flashqla_tune.tune import report
from flashqla_tune.tune.search_space import SPACE, known_good, params_of, tiles_from_params
from flashqla_tune.tune.study import open_study, study_name, study_path
from flashqla_tune.tune.trial import BatchTuner, TuneResult, best_trial, slower_mixes

sys.path.insert(0, str(Path(__file__).parent))
from tune_doubles import (FailingAnchorTimer, FakeClock, SyntheticAnchorTimer, SyntheticTimer,  # noqa: E402
                          synthetic_measurement)

optuna.logging.set_verbosity(optuna.logging.WARNING)
SPEC = kernel_spec(GDNSpec(8, 8))
GPU = "SyntheticGPU"


def _tuner(tmp_path, seed=0, **kw):
    study = open_study(SPEC, GPU, tmp_path, seed=seed)
    m = kw.pop("measurement", None) or synthetic_measurement()
    return BatchTuner(SPEC, study, m, **kw), m


def _evaluated(trials):
    """Trials that reached the build (not invalid draws nor duplicates)."""
    return [t for t in trials if t.user_attrs.get("stage") not in ("invalid", "duplicate")
            and t.state in (TrialState.COMPLETE, TrialState.PRUNED)]


def test_space_covers_every_tile_field_and_known_good_are_valid():
    assert set(SPACE) == set(params_of(TileParams()))
    good = known_good(SPEC)
    assert good[0] == default_tiles(SPEC) and len(good) >= 4 and len(set(good)) == len(good)
    assert tiles_from_params(params_of(good[1])) == good[1]
    with pytest.raises(ValueError, match="warp"):
        tiles_from_params({"warp": 1})


def test_study_is_per_spec_and_gpu_and_lives_in_a_journal(tmp_path):
    assert study_name(SPEC, "NVIDIA H200") != study_name(SPEC, "NVIDIA H100 80GB HBM3")
    assert study_name(SPEC, GPU) != study_name(SPEC.with_heads(4, 4), GPU)
    assert study_path(SPEC, "NVIDIA H200", tmp_path).name.startswith(SPEC.name + "@NVIDIA-H200@")
    open_study(SPEC, GPU, tmp_path)
    assert study_path(SPEC, GPU, tmp_path).is_file()


def test_known_good_first_then_prune_reasons_and_best_choice(tmp_path):
    tuner, m = _tuner(tmp_path, max_trials=14)
    res = tuner.run()
    trials = sorted(res.trials, key=lambda t: t.number)
    # The default is trial 0 and every known-good config was tried before any sampled one.
    good = [params_of(t) for t in known_good(SPEC)]
    assert trials[0].params == params_of(default_tiles(SPEC))
    assert [t.params for t in trials[:len(good)]] == good
    assert all(t.user_attrs.get("known_good") for t in trials[:len(good)])
    stages = Counter(t.user_attrs.get("stage") for t in trials)
    # Known-good stage-1 configs are rejected by the fake oracle, with its numbers, and never timed.
    wrong = [t for t in trials if t.user_attrs.get("stage") == "wrong"]
    assert wrong and all(t.state == TrialState.PRUNED for t in wrong)
    assert "o rel err 0.5" in wrong[0].user_attrs["prune_reason"]
    assert wrong[0].user_attrs["check_errors"] == {"o": 0.5, "state": 0.75}
    timed = set(m.timer.timed)
    assert not any(t.user_attrs["plan"] in timed for t in wrong)
    for t in trials:
        if t.user_attrs.get("stage") == "invalid":   # KernelPlan's own message, naming the value
            assert t.state == TrialState.PRUNED and any(
                f"{name}=" in t.user_attrs["prune_reason"] for name in SPACE)
        if t.user_attrs.get("stage") == "compile":
            assert "synthetic compile error for block_v=128" in t.user_attrs["prune_reason"]
    assert stages["complete"] >= 3
    # Batches of two plans went to the builder together.
    assert max(len(b) for b in m.builder.batches) == 2
    # Best = the smallest sum over the mix, and the speedup is over the measured default.
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert res.best.value == min(t.value for t in done)
    assert res.default.params == params_of(default_tiles(SPEC))
    assert res.speedup == pytest.approx(res.default.value / res.best.value)
    assert res.best.user_attrs["times_ms"].keys() == set(SyntheticTimer.MIXES)
    text = report.table(res)
    assert "(default)" in text and "vs default" in text and "pruned:" in text
    assert res.evaluated_here == 14 == len(_evaluated(trials))


def test_budget_stops_between_batches(tmp_path):
    clock = FakeClock()
    tuner, m = _tuner(tmp_path, measurement=synthetic_measurement(clock, seconds_per_trial=10.0),
                      budget_s=35.0, clock=clock)
    res = tuner.run()
    assert "time budget (35 s)" in res.stopped_because
    # Each timing costs 10 fake seconds (configs that fail to build or miss the oracle cost none);
    # the budget is checked between batches of two, so the run stops at the first check past
    # 35 s: the last batch started under budget and added at most two timings.
    assert clock.now == 10.0 * len(m.timer.timed)
    assert 35.0 < clock.now <= 35.0 + 20.0
    with pytest.raises(ValueError, match="budget_s=-1"):
        _tuner(tmp_path, budget_s=-1)


def test_resume_continues_the_same_study_without_repeats(tmp_path):
    first, _ = _tuner(tmp_path, max_trials=5)
    first.run()
    second, m2 = _tuner(tmp_path, seed=1, max_trials=5)
    res = second.run()
    evaluated = _evaluated(res.trials)
    assert len(evaluated) == 10
    keys = [tuple(sorted(t.params.items())) for t in evaluated]
    assert len(set(keys)) == len(keys), "a config was evaluated twice"
    # The known-good configs were enqueued once, in the first call.
    assert sum(bool(t.user_attrs.get("known_good")) for t in res.trials) == len(known_good(SPEC))
    # The second call re-ran nothing of the first (the default above all).
    assert params_of(default_tiles(SPEC)) not in [t.params for t in res.trials if t.number >= 5 and
                                           t.user_attrs.get("stage") not in ("invalid", "duplicate")]


def test_two_processes_share_one_journal_without_duplicating_trials(tmp_path):
    code = ("import sys; sys.path.insert(0, {tests!r}); import optuna; "
            "optuna.logging.set_verbosity(optuna.logging.WARNING); "
            "from tune_doubles import run_worker; run_worker({root!r}, 8, {seed})")
    procs = [subprocess.Popen([sys.executable, "-c", code.format(tests=str(Path(__file__).parent),
                                                                  root=str(tmp_path), seed=seed)])
             for seed in (11, 12)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    trials = open_study(SPEC, GPU, tmp_path).get_trials(deepcopy=False)
    evaluated = _evaluated(trials)
    assert len(evaluated) == 16
    keys = [tuple(sorted(t.params.items())) for t in evaluated]
    assert len(set(keys)) == len(keys), "two workers evaluated the same config"
    workers = {t.user_attrs.get("worker") for t in evaluated}
    assert len(workers) == 2 and None not in workers, f"the trials should name both workers: {workers}"
    lines = report.worker_lines(trials)
    complete = sum(t.state == TrialState.COMPLETE for t in trials)
    assert len(lines) == 2 and sum(int(line.split(", ")[1].split()[0]) for line in lines) == complete
    assert sum(bool(t.user_attrs.get("known_good")) for t in trials) == len(known_good(SPEC))
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING, TrialState.FAIL)]


def test_cli_tune_refuses_without_a_gpu(capsys, monkeypatch, tmp_path):
    from flashqla_tune import environment
    from flashqla_tune.cli import main

    monkeypatch.setattr(environment, "gpu_info", lambda device=None: None)
    assert main(["tune", "--hqk", "8", "--hv", "8", "--study-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--no-tune" in err
    assert main(["tune", "--hqk", "8", "--hv", "8", "--budget", "0"]) == 2
    assert "--budget=0.0 must be positive" in capsys.readouterr().err


def test_an_interrupted_batch_leaves_no_running_trials(tmp_path):
    class InterruptingBuilder:
        def build(self, plans):
            raise KeyboardInterrupt

    m = synthetic_measurement()
    m.builder = InterruptingBuilder()
    tuner, _ = _tuner(tmp_path, measurement=m, max_trials=4)
    with pytest.raises(KeyboardInterrupt):
        tuner.run()
    trials = open_study(SPEC, GPU, tmp_path).get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert [t.user_attrs["stage"] for t in trials if t.state == TrialState.FAIL] == ["interrupted"] * 2


def test_pack_tuning_record_from_a_result(tmp_path):
    from flashqla_tune.pack_build import _tuning_record

    tuner, _ = _tuner(tmp_path, max_trials=8)
    res = tuner.run()
    rec = _tuning_record(res)
    assert rec["best_trial"] == res.best.number and rec["study"] == res.study_name
    assert rec["times_ms"] == res.best.user_attrs["times_ms"]
    assert rec["default_times_ms"] == res.default.user_attrs["times_ms"]
    assert rec["speedup_over_default"] == pytest.approx(res.speedup) and rec["speedup_over_default"] >= 1.0
    assert res.best_plan.tiles == tiles_from_params(res.best.params)


def test_anchors_are_timed_once_after_the_search_and_compared_in_the_table(tmp_path):
    anchors = SyntheticAnchorTimer()
    tuner, m = _tuner(tmp_path, measurement=synthetic_measurement(anchors=anchors), max_trials=6)
    res = tuner.run()
    assert anchors.specs == [SPEC]
    best_sum = sum(res.best.user_attrs["times_ms"].values())
    assert res.speedup_over("fla") == pytest.approx(sum(res.anchors["fla"]["times_ms"].values()) / best_sum)
    assert res.speedup_over("flashqla") is None
    text = report.table(res)
    assert "best vs fla (same run, same mixes): " in text
    assert "flashqla: not compared (ModuleNotFoundError: No module named 'flash_qla')" in text


def test_a_failing_anchor_is_recorded_not_raised(tmp_path):
    tuner, _ = _tuner(tmp_path, measurement=synthetic_measurement(anchors=FailingAnchorTimer()), max_trials=3)
    res = tuner.run()
    assert res.best is not None
    assert res.anchors == {"anchors": {"error": "RuntimeError: synthetic anchor failure"}}
    assert "anchors: not compared (RuntimeError: synthetic anchor failure)" in report.table(res)


def test_a_run_without_anchors_says_where_they_are_compared(tmp_path):
    """`build` leaves FLA and FlashQLA out unless --compare-anchors (their JIT compiles cost minutes
    of the build's H200 time); the table says so instead of staying silent."""
    tuner, _ = _tuner(tmp_path, measurement=synthetic_measurement(anchors=None), max_trials=3)
    res = tuner.run()
    assert res.best is not None and res.anchors == {}
    assert "anchors: not timed in this run" in report.table(res)
    assert "best vs" not in report.table(res)


def test_build_refuses_compare_anchors_without_tuning(tmp_path, capsys):
    from flashqla_tune.cli import main

    assert main(["build", "--out", str(tmp_path / "pack"), "--no-tune", "--compare-anchors"]) == 2
    assert "--compare-anchors has no effect with --no-tune" in capsys.readouterr().err
    assert not (tmp_path / "pack").exists()


def test_the_table_shows_the_gain_on_each_mix(tmp_path):
    tuner, _ = _tuner(tmp_path, max_trials=6)
    res = tuner.run()
    line = next(l for l in report.table(res).splitlines() if l.startswith("  per mix"))
    best, default = res.best.user_attrs["times_ms"], res.default.user_attrs["times_ms"]
    assert len(best) > 1 and all(mix in line for mix in best)
    first = next(iter(best))
    assert f"{first} {default[first] / best[first]:.3f}x" in line


def test_best_is_never_slower_than_the_default_on_a_mix():
    def trial(number, **times):
        tiles = default_tiles(SPEC) if number == 0 else TileParams(stages=number)
        t = optuna.trial.create_trial(value=sum(times.values()), user_attrs={"times_ms": times},
                                      params=params_of(tiles),
                                      distributions={k: optuna.distributions.CategoricalDistribution(v)
                                                     for k, v in SPACE.items()})
        t.number = number
        return t

    default = trial(0, a=1.0, b=1.0)
    lopsided = trial(1, a=0.5, b=1.05)   # 27% faster in sum, 5% slower on mix b
    even = trial(2, a=0.95, b=1.0)
    assert slower_mixes(lopsided, default) == ["b"] and slower_mixes(even, default) == []
    assert best_trial([default, lopsided, even], default) is even
    assert best_trial([default, lopsided], default) is default
    assert best_trial([default, lopsided], None) is lopsided   # no measured default: the sum decides
    res = TuneResult(SPEC, "synthetic", even, default, [default, lopsided, even], 3, "trial cap")
    text = report.table(res)
    assert "(slower on b: not eligible)" in text and "best: trial 2" in text


def test_enqueued_configs_nobody_asked_for_are_not_a_worker(tmp_path):
    tuner, _ = _tuner(tmp_path, max_trials=1)
    res = tuner.run()
    assert any(t.state == TrialState.WAITING for t in res.trials)   # known-good configs still queued
    lines = report.worker_lines(res.trials)
    assert len(lines) == 1 and "worker ?" not in lines[0] and "1 measured" in lines[0]
