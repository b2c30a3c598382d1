"""The default context-parallel cost model (flashqla_tune/cp_cost_model.py): which segment length a
sequence gets, from the calibration's warm-up profile and the machine."""
from __future__ import annotations

import pytest

from flashqla_tune.cp_cost_model import (CostModelError, Machine, WarmupProfile, makespan, objective, segment_length,
                                         segment_table)
from flashqla_tune.segment_policy import SEGMENT_BUCKETS

H200 = Machine()


def test_few_chains_on_a_long_sequence_are_segmented_longer_than_their_window():
    profile = WarmupProfile(exact_share=0.0, mean_window=2.0, max_window=3)
    L = segment_length(512, 16, profile, H200)        # 2/8, 32k tokens: 16 chains
    assert L > profile.max_window
    assert makespan(512, L, 16, profile, H200) * 4 < makespan(512, 0, 16, profile, H200)


def test_a_full_gpu_gets_no_segments():
    profile = WarmupProfile(exact_share=0.0, mean_window=2.0, max_window=3)
    assert segment_length(512, 132, profile, H200) == 0    # one chain per SM already
    assert segment_length(512, 1024, profile, H200) == 0


def test_exact_heads_cost_more_but_still_pay_on_few_chains():
    warm = WarmupProfile(exact_share=0.0, mean_window=2.0, max_window=3)
    mixed = WarmupProfile(exact_share=0.25, mean_window=2.0, max_window=3)
    L_warm, L_mixed = segment_length(512, 16, warm, H200), segment_length(512, 16, mixed, H200)
    assert 0 < L_mixed and 0 < L_warm
    assert makespan(512, L_mixed, 16, mixed, H200) > makespan(512, L_warm, 16, warm, H200)


def test_the_model_keeps_to_what_the_h200_measured():
    """docs/cp-design.md's cost model, the H200's CP profile (2/8: 16 chains, 2 q/k heads): splitting 1024- and
    2048-token sequences was 1.2-7x slower than one chain; 32k tokens gained 1.6-1.8x."""
    exact = WarmupProfile(exact_share=1.0, mean_window=0.0, max_window=0)
    warm = WarmupProfile(exact_share=0.25, mean_window=4.7, max_window=5)
    for profile in (exact, warm):
        assert segment_length(16, 16, profile, H200, qk_heads=2) == 0
        assert segment_length(32, 16, profile, H200, qk_heads=2) == 0
        assert 16 <= segment_length(512, 16, profile, H200, qk_heads=2) <= 64


def test_a_split_into_more_ctas_than_slots_pays_a_wave_tail():
    """The H200 scoreboard (docs/cp-design.md, "The cost model"), lone 8192-token rows with the
    protocol's calibration (a quarter of the heads exact, windows of 4-5 chunks): split into 32-chunk
    segments, 16/16 (32 chains, 128 CTAs: one wave) ran 0.76 of one chain, 8/32 (64 chains, 256 CTAs)
    0.96. The wave tail keeps the first split and declines the second; 32k tokens still split."""
    protocol = WarmupProfile(exact_share=0.25, mean_window=4.8, max_window=5)
    assert segment_length(128, 32, protocol, H200, qk_heads=16) == 32        # 16/16
    assert segment_length(128, 64, protocol, H200, qk_heads=8) == 0          # 8/32
    assert segment_length(128, 48, protocol, H200, qk_heads=8) == 0          # 8/24
    assert segment_length(512, 64, protocol, H200, qk_heads=8) > 0           # 8/32, 32k tokens
    no_tail = Machine(wave_tail=0.0)
    assert segment_length(128, 64, protocol, no_tail, qk_heads=8) == 32      # what the model chose before
    assert makespan(128, 32, 64, protocol, H200, 8) == makespan(128, 32, 64, protocol, no_tail, 8) + H200.wave_tail


def test_the_batch_hedge_gives_up_splits_that_multiply_the_work():
    """Exact heads multiply the work of a split (state pass, transition, chain): worth it for a
    lone sequence of 32k tokens (the CP profile, 4/16 1x32768: L128 0.698 ms vs one chain 0.900), not
    for 8k tokens, where other sequences of a batch fill the GPU, so the hedged objective declines
    what the lone makespan alone would take; warm-up heads, which add only their windows, split."""
    exact = WarmupProfile(exact_share=1.0, mean_window=0.0, max_window=0)
    warm = WarmupProfile(exact_share=0.25, mean_window=4.7, max_window=5)
    lone = Machine(batch_weight=0.0)
    assert segment_length(512, 32, exact, H200, qk_heads=4) > 0
    assert segment_length(128, 32, exact, lone, qk_heads=4) > 0
    assert segment_length(128, 32, exact, H200, qk_heads=4) == 0
    assert segment_length(128, 32, warm, H200, qk_heads=4) > 0
    assert objective(512, 64, 32, exact, H200, 4) > makespan(512, 64, 32, exact, H200, 4)


def test_windows_longer_than_every_candidate_mean_no_cp():
    profile = WarmupProfile(exact_share=0.0, mean_window=300.0, max_window=600)
    assert segment_length(512, 16, profile, H200) == 0


def test_short_sequences_and_the_table():
    profile = WarmupProfile(exact_share=0.0, mean_window=1.0, max_window=1)
    table = segment_table(16, profile, H200, max_log2_chunks=10)
    assert sorted(table) == [2 ** b for b in range(11)]
    assert table[1] == 0 and table[2] == 0           # nothing to split
    assert all(L == 0 or (profile.max_window < L < bucket) for bucket, L in table.items())
    assert table[1024] > 0


def test_profile_from_tables_and_calibration_shape():
    profile = WarmupProfile.from_tables([[1, 2, -1, 4], [2, 2, 2, -1]])
    assert profile.exact_share == pytest.approx(0.25)
    assert profile.mean_window == pytest.approx(13 / 6)
    assert profile.max_window == 4
    all_exact = WarmupProfile.from_tables([[-1, -1]])
    assert (all_exact.exact_share, all_exact.mean_window, all_exact.max_window) == (1.0, 0.0, 0)


@pytest.mark.parametrize("make, message", [
    (lambda: WarmupProfile(exact_share=1.5, mean_window=1.0, max_window=2), "exact_share=1.5 must lie in"),
    (lambda: WarmupProfile(exact_share=0.1, mean_window=3.0, max_window=2), "mean_window=3.0 and max_window=2"),
    (lambda: WarmupProfile.from_tables([[2, 0]]), "must be -1 \\(exact\\) or >= 1 chunks, got 0"),
    (lambda: WarmupProfile.from_tables([]), "no warm-up values"),
    (lambda: Machine(sms=0), "sms=0"),
    (lambda: Machine(wave_tail=-1.0), "wave_tail=-1.0"),
    (lambda: segment_length(64, 0, WarmupProfile(0.0, 1.0, 1), H200), "chains=0 and qk_heads=1 must be >= 1"),
])
def test_bad_inputs_name_the_value(make, message):
    with pytest.raises(CostModelError, match=message):
        make()


def test_profile_from_a_calibration_pools_layers_and_heads():
    from pack_doubles import synthetic_calibration

    cal = synthetic_calibration()          # 3 layers x 8 heads, one exact head (layer 1, head 5)
    profile = WarmupProfile.from_calibration(cal)
    tables = [layer.warmup_table for layer in cal.layers]
    assert profile.exact_share == pytest.approx(1 / 24)
    assert profile.max_window == max(n for t in tables for n in t)
    assert segment_length(512, 16, profile, H200) > profile.max_window


def test_bucket_and_segment_count_follow_the_kernels_rule():
    from flashqla_tune.segment_policy import bucket_of_chunks, segments_of

    assert [bucket_of_chunks(c) for c in (0, 1, 2, 3, 4, 5, 128, 129)] == [0, 0, 1, 2, 2, 3, 7, 8]
    assert bucket_of_chunks(2 ** 40) == SEGMENT_BUCKETS - 1
    assert [segments_of(c, L) for c, L in ((128, 32), (129, 32), (32, 32), (31, 0), (5, 1))] == [4, 5, 1, 1, 5]
