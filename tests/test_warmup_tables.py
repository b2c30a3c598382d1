"""The op's `warmup` table on the host: checks, the segment table the kernels read, and the bound
on a call's segments that sizes the workspace (flashqla_tune/warmup_tables.py)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from flashqla_tune import warmup_tables as W
from flashqla_tune.cp_cost_model import Machine, WarmupProfile, segment_table
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec

PLAN_2_8 = default_plan(GDNSpec(2, 8))


def test_normalise_accepts_lists_and_cpu_int_tensors():
    assert W.normalise([3, -1, 1, 16, 2, 2, 2, 2], 8) == (3, -1, 1, 16, 2, 2, 2, 2)
    assert W.normalise(torch.tensor([1, -1], dtype=torch.int32), 2) == (1, -1)


@pytest.mark.parametrize("table, hv, message", [
    ([1, 2, 3], 8, "warmup has 3 entries; the call has Hv=8"),
    ([1, 0], 2, r"warmup\[1\]=0: each entry is -1"),
    ([-2, 1], 2, r"warmup\[0\]=-2"),
    ([1, 5000], 2, r"warmup\[1\]=5000"),
    ([1.0, 2.0], 2, "warmup must hold ints"),
    ([True, 1], 2, "warmup must hold ints"),
    (torch.tensor([1.0, 2.0]), 2, "1-D integer tensor"),
    (torch.ones(2, 2, dtype=torch.int32), 2, "1-D integer tensor"),
    (torch.ones(2, dtype=torch.int32, device="meta"), 2, "pass it as a CPU tensor or a list"),
    (7, 2, "warmup must be a list or 1-D tensor of ints, got int"),
])
def test_bad_tables_are_refused_naming_the_value(table, hv, message):
    with pytest.raises(W.WarmupError, match=message):
        W.normalise(table, hv)


def test_segment_table_is_the_cost_model_per_power_of_two_bucket():
    values = (3, 3, 3, 3, 3, 3, -1, -1)
    lengths = W.segment_lengths(values, PLAN_2_8, 132)
    model = segment_table(16, WarmupProfile.from_tables([list(values)]), Machine(sms=132))
    assert len(lengths) == W.SEGMENT_BUCKETS
    for b in range(W.SEGMENT_BUCKETS):
        assert lengths[b] == model[2 ** min(b, 14)]
    # a 32k-token sequence (512 chunks) is split, with segments longer than the longest window
    assert 3 < lengths[9] < 512
    # 16/64 has 128 chains: the GPU is full without CP
    assert not any(W.segment_lengths((3,) * 64, default_plan(GDNSpec(16, 64)), 132))


def kernel_segments(lengths, chunks):
    """csrc/gdn_segment_policy.h's rule: bucket ceil(log2 c), one segment unless 0 < L < c."""
    bucket = min(max(chunks - 1, 0).bit_length(), len(lengths) - 1)
    length = lengths[bucket]
    return -(-chunks // length) if 0 < length < chunks else 1


def test_segment_bound_holds_for_random_calls_and_is_exact_for_one_full_bucket():
    rng = random.Random(0)
    lengths = W.segment_lengths((3, 3, 3, 3, 3, 3, -1, -1), PLAN_2_8, 132)
    tables = [lengths] + [[rng.choice([0, 0, 1, 2, 3, 4, 8, 16, 32, 100]) for _ in range(W.SEGMENT_BUCKETS)]
                          for _ in range(20)]
    for table in tables:
        bound = W.SegmentBound.of(tuple(table))
        for _ in range(300):
            n = rng.randint(1, 12)
            seqlens = [rng.choice([0, 1, 63, 64, 65, 4096, rng.randint(0, 40000), rng.randint(0, 400000)])
                       for _ in range(n)]
            T = sum(seqlens) + rng.randint(0, 100)   # rows past the last sequence are allowed
            used = sum(kernel_segments(table, -(-s // 64)) for s in seqlens)
            assert used <= bound(T, n), (table, seqlens, T)
    for T in (8192, 32768):  # one sequence filling its bucket: tight up to the sequence's slack chunk
        assert 1 < kernel_segments(lengths, T // 64) <= W.max_segments(tuple(lengths), T, 1) <= kernel_segments(lengths, T // 64) + 1
    assert W.max_segments((0,) * W.SEGMENT_BUCKETS, 10**6, 3) == 3


def test_tables_are_cached_per_values_plan_and_device(monkeypatch):
    monkeypatch.setattr(W, "sm_count", lambda device: 132)
    W._TABLES.clear()
    a = W.tables_for((3,) * 8, PLAN_2_8, torch.device("cpu"), 1e-5)
    b = W.tables_for((3,) * 8, PLAN_2_8, torch.device("cpu"), 1e-5)
    assert a is b and a.warmup.dtype == torch.int32 and a.warmup.tolist() == [3] * 8
    assert a.segment_chunks.tolist() == list(a.lengths) and a.splits
    assert a.log_eps == pytest.approx(math.log(1e-5))
    with pytest.raises(W.WarmupError, match="warmup_eps=0"):
        W.tables_for((3,) * 8, PLAN_2_8, torch.device("cpu"), 0.0)


def test_calls_too_large_for_cp_scratch_run_without_it(monkeypatch):
    monkeypatch.setattr(W, "sm_count", lambda device: 132)
    tables = W.tables_for((3, 3, 3, 3, 3, 3, -1, -1), PLAN_2_8, torch.device("cpu"), 1e-5)
    per_segment = 3 * 8 * 128 * 128 * 4
    assert W.call_segments(tables, 32768, 1, per_segment) == W.max_segments(tables.lengths, 32768, 1) > 1
    # 8192 short sequences over 2M tokens: the bound cannot tell they are short, and its states would
    # need tens of GiB, so the call runs as exact chains (with a warning) instead of failing
    with pytest.warns(RuntimeWarning, match="context parallelism is off for a call of 8192 sequences"):
        assert W.call_segments(tables, 2 << 20, 8192, per_segment) == 0
    never = W.tables_for((3,) * 64, default_plan(GDNSpec(16, 64)), torch.device("cpu"), 1e-5)
    assert not never.splits and W.call_segments(never, 32768, 1, per_segment) == 0


def test_describe_splits_names_segments_per_length():
    lengths = tuple(W.segment_lengths((1,) * 8, PLAN_2_8, 132))
    text = W.describe_splits(lengths, token_lengths=(64, 32768))
    assert text == f"64 tokens: one chain; 32768 tokens: {512 // lengths[9]} x {lengths[9]} chunks"


def test_the_default_window_is_planned_for_heads_that_fail_its_guard():
    """A call without a table gets DEFAULT_WINDOW_CHUNKS on every head, planned as if a quarter of
    them chain exactly: few-head long rows split, 16/32 (64 chains already) only from 16k tokens,
    16/48 (96 chains) never."""
    assert W.default_table(8) == (W.DEFAULT_WINDOW_CHUNKS,) * 8
    few = W.segment_lengths(W.default_table(8), PLAN_2_8, 132)
    assert "32768 tokens: one chain" not in W.describe_splits(tuple(few))
    assert "2048 tokens: one chain" in W.describe_splits(tuple(few))
    assert all(L == 0 or L > W.DEFAULT_WINDOW_CHUNKS for L in few)
    some = W.segment_lengths(W.default_table(32), default_plan(GDNSpec(16, 32)), 132)
    assert W.describe_splits(tuple(some), (2048, 8192, 32768)).count("one chain") == 2
    many = W.segment_lengths(W.default_table(48), default_plan(GDNSpec(16, 48)), 132)
    assert W.describe_splits(tuple(many), (2048, 8192, 32768)).count("one chain") == 3
    # an explicit calibrated table of the same heads is planned from its own values
    assert W.segment_lengths((8,) * 7 + (9,), PLAN_2_8, 132) != few


def test_a_new_table_under_graph_capture(monkeypatch):
    """Copying a new table to the GPU cannot be captured: the default table's call then runs
    without CP (warned once), any other table is an error that says what to do."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(W, "_DEFAULT_SKIPPED_WARNED", False)
    cuda = torch.device("cuda", 0)
    with pytest.warns(RuntimeWarning, match="make one eager call before capturing"):
        assert W.tables_for(W.default_table(8), PLAN_2_8, cuda, 1e-5) is None
    with pytest.raises(W.WarmupError, match=r"warm-up table \[3, 3, 3, 3, 3, 3, 3, -1\] is new on cuda:0 while a "
                                            r"CUDA graph is being captured"):
        W.tables_for((3,) * 7 + (-1,), PLAN_2_8, cuda, 1e-5)


def test_the_host_knowing_the_longest_sequence_skips_cp_kernels_only_when_nothing_splits(monkeypatch):
    """ops.longest_sequence_tokens: batch rows give T, cu_seqlens_cpu its largest step, else 0."""
    from flashqla_tune import ops

    monkeypatch.setattr(W, "sm_count", lambda device: 132)
    tables = W.tables_for(W.default_table(8), PLAN_2_8, torch.device("cpu"), W.DEFAULT_EPS)
    per_segment = 3 * 8 * 128 * 128 * 4
    T = 8192
    assert W.call_segments(tables, T, 8, per_segment) > 8                      # 128 chunks could split
    assert W.call_segments(tables, T, 8, per_segment, longest_tokens=1024) == 0
    assert W.call_segments(tables, T, 8, per_segment, longest_tokens=T) == W.call_segments(tables, T, 8, per_segment)
    # a hint past T is not believed
    assert W.call_segments(tables, T, 8, per_segment, longest_tokens=T + 1) == W.call_segments(tables, T, 8, per_segment)
    assert ops.longest_sequence_tokens(4096, None, None) == 4096
    assert ops.longest_sequence_tokens(T, torch.tensor([0, 8]), None) == 0
    assert ops.longest_sequence_tokens(T, torch.tensor([0, 8]), torch.tensor([0, 1000, 1000, 5000])) == 4000
    assert ops.longest_sequence_tokens(T, torch.tensor([0, 8]), [0, 7]) == 7
