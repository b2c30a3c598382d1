"""The segment-length stage of tuning (flashqla_tune/tune/segments.py) with a synthetic timer: a
test double standing in for the GPU's graph replay, whose times follow a made-up law, so the
bookkeeping (candidates, the alone/batch hedge, ties, untouched buckets, the pack's record) can
be checked exactly."""
from __future__ import annotations

import math

import pytest

from flashqla_tune.segment_policy import SEGMENT_BUCKETS
from flashqla_tune.tune.segments import BATCH, bucket_of, candidates, tune_segment_table


def synthetic_timer(best_alone: dict[int, int], batch_penalty: float):
    """ms for (seqlens, table): a lone sequence is fastest at best_alone[tokens] chunks per
    segment; every split costs `batch_penalty` x its segment count when the batch is full."""
    calls = []

    def time_fn(seqlens, table):
        calls.append((seqlens, table))
        tokens = seqlens[0]
        chunks = -(-tokens // 64)
        L = table[bucket_of(tokens)]
        segments = -(-chunks // L) if 0 < L < chunks else 1
        if len(seqlens) == 1:
            target = best_alone[tokens]
            target_segments = -(-chunks // target) if target else 1
            return 1.0 + abs(math.log2(segments / target_segments))
        return float(len(seqlens)) * (1.0 + batch_penalty * (segments - 1))
    return time_fn, calls


def test_each_scoreboard_bucket_keeps_its_best_hedged_length_and_others_keep_the_model():
    model = tuple([0] * 7 + [32] * 3 + [64] * (SEGMENT_BUCKETS - 10))
    time_fn, calls = synthetic_timer({2048: 0, 8192: 32, 32768: 64}, batch_penalty=0.01)
    result = tune_segment_table(model, max_window=5, time_fn=time_fn)
    assert result.lengths[bucket_of(2048)] == 0      # no candidate beats one chain
    assert result.lengths[bucket_of(8192)] == 32     # 4 segments alone, the batch barely minds
    assert result.lengths[bucket_of(32768)] == 64    # 8 segments
    untouched = set(range(SEGMENT_BUCKETS)) - {bucket_of(t) for t in (2048, 8192, 32768)}
    assert all(result.lengths[b] == model[b] for b in untouched)
    assert result.model_lengths == model
    # every candidate was timed alone and as a batch, with only its own bucket changed
    for seqlens, table in calls:
        assert len(seqlens) in (1, BATCH)
        assert [i for i in range(SEGMENT_BUCKETS) if table[i] != result.lengths[i] and table[i] != model[i]] \
            in ([], [bucket_of(seqlens[0])])
    timing = result.timings[32768][64]
    assert timing["score"] == pytest.approx(math.sqrt(timing["alone"] * timing["batch"]))
    record = result.record()
    assert record["lengths"] == list(result.lengths) and record["batch"] == BATCH
    # the gain over the cost model's entry: 1.0 where it was kept, its score ratio where it moved
    gains = result.gains()
    assert gains[2048] == 1.0   # the model already had no split there
    for tokens, chosen in ((8192, 32), (32768, 64)):
        by_length = result.timings[tokens]
        assert gains[tokens] == pytest.approx(by_length[model[bucket_of(tokens)]]["score"] / by_length[chosen]["score"])
    assert gains[32768] > 1.0   # the model's 32 lost to the timed 64
    assert record["gain_over_model"] == {str(t): g for t, g in gains.items()}
    assert set(record["timings_ms"]["32768"]) == {str(L) for L in candidates(32768, model[9], 5)}


def test_a_full_batch_that_punishes_splits_pulls_the_choice_back():
    model = tuple([0] * 7 + [16] * (SEGMENT_BUCKETS - 7))
    time_fn, _ = synthetic_timer({2048: 0, 8192: 16, 32768: 16}, batch_penalty=1.0)
    result = tune_segment_table(model, max_window=5, time_fn=time_fn, tokens=(8192, 32768))
    # alone 8 segments are best, but each costs a whole batch time when the GPU is full
    assert result.lengths[bucket_of(8192)] == 0
    assert result.lengths[bucket_of(32768)] in (0, 256, 512)


def test_ties_prefer_no_split_then_longer_segments():
    model = tuple([0] * SEGMENT_BUCKETS)
    result = tune_segment_table(model, max_window=0, time_fn=lambda seqlens, table: 1.0, tokens=(32768,))
    assert result.lengths[bucket_of(32768)] == 0


def test_candidates_are_longer_than_the_window_and_split_the_sequence():
    assert candidates(2048, 0, 5) == [0, 16]
    assert candidates(8192, 32, 20) == [0, 32, 64]
    assert candidates(8192, 8, 20) == [0, 8, 32, 64]    # the model's own choice is always timed
    assert candidates(64, 0, 0) == [0]


@pytest.mark.parametrize("bad, message", [
    (lambda s, t: float("nan"), "times must be positive"),
    (lambda s, t: 0.0, "times must be positive"),
])
def test_a_timer_that_returns_nonsense_is_an_error(bad, message):
    with pytest.raises(ValueError, match=message):
        tune_segment_table((0,) * SEGMENT_BUCKETS, 0, bad, tokens=(8192,))


def test_bad_tables_and_windows_name_the_value():
    with pytest.raises(ValueError, match="a segment table has 32 non-negative ints"):
        tune_segment_table((1, 2), 0, lambda s, t: 1.0)
    with pytest.raises(ValueError, match="max_window=-1"):
        tune_segment_table((0,) * SEGMENT_BUCKETS, -1, lambda s, t: 1.0)


def test_the_pack_stage_times_with_the_calibrations_model_table():
    """pack_build.tune_segments: rank 0's slice of the model-wide table and the calibration's eps
    reach the timer; candidates stay longer than the longest window of any layer and head (20
    here, on a head outside rank 0's slice); the record lands in the log line and the manifest."""
    from types import SimpleNamespace

    from flashqla_tune.pack_build import tune_segments
    from flashqla_tune.plan import default_plan
    from flashqla_tune.spec import GDNSpec

    layers = [SimpleNamespace(warmup_table=[3, -1, 5, 2, 9, 9, 20, 9]),
              SimpleNamespace(warmup_table=[2, -1, 4, 1, 1, 1, 1, 1])]
    cal = SimpleNamespace(layers=layers, model_table=lambda: [3, -1, 5, 2, 9, 9, 20, 9],
                          settings=SimpleNamespace(eps=1e-5))
    plan = default_plan(GDNSpec(1, 4))
    lines = []

    def time_fn(seqlens, table):
        return 1.0 + 0.001 * table[bucket_of(seqlens[0])]
    lengths, record = tune_segments(cal, plan, (0,) * 7 + (32,) * 25, lines.append, time_fn=time_fn)
    assert lengths[bucket_of(8192)] == 0 and record["model_lengths"][bucket_of(8192)] == 32
    assert set(record["timings_ms"]["2048"]) == {"0"}            # 16 chunks do not outlast a 20-chunk window
    assert set(record["timings_ms"]["8192"]) == {"0", "32", "64"}
    assert lines and lines[0].startswith(f"segments {plan.name}: ")


def test_two_lengths_in_one_bucket_are_refused():
    with pytest.raises(ValueError, match=r"tokens=\[8000, 8192\] put two lengths in one segment-table bucket"):
        tune_segment_table((0,) * SEGMENT_BUCKETS, 0, lambda s, t: 1.0, tokens=(8192, 8000))
