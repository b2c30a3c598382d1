"""Gate statistics on synthetic gates whose answers can be worked out by hand."""
import math

import numpy as np
import pytest
import torch

from flashqla_tune.calibrate.statistics import GateAccumulator, calibrate_gates, chunk_log_decay, window_above_fraction
from flashqla_tune.calibration_artifact import EXACT, WARMUP
from flashqla_tune.calibration_settings import CalibrationError, CalibrationSettings

LOG_EPS = math.log(1e-5)
C = 64


def constant_gate(per_token, T=64 * 64):
    return torch.full((T,), float(per_token), dtype=torch.float64)


def test_known_decays_give_hand_computed_windows():
    # Per-chunk sums: head0 0 (never decays), head1 -64 (n=1), head2 just inside 3 chunks,
    # head3 just outside 3 chunks (needs 4), head4 too slow for N=16.
    just_in = (LOG_EPS - 1e-6) / (3 * C)
    just_out = (LOG_EPS + 1e-6) / (3 * C)
    slow = LOG_EPS / (20 * C)
    g = torch.stack([constant_gate(0.0), constant_gate(-1.0), constant_gate(just_in),
                     constant_gate(just_out), constant_gate(slow)], dim=1)
    stats = calibrate_gates(g)
    assert [h.n_h for h in stats.heads] == [None, 1, 3, 4, None]
    assert [h.cls for h in stats.heads] == [EXACT, WARMUP, WARMUP, WARMUP, EXACT]
    assert stats.warmup_table == [-1, 1, 3, 4, -1]
    assert stats.heads[0].zero_decay_fraction == 1.0 and stats.heads[1].zero_decay_fraction == 0.0
    assert stats.num_chunks == 64 and stats.num_tokens == 64 * 64
    # the above-eps fraction is 1 before the window is long enough, 0 from n_h on
    assert stats.heads[2].above_fraction[:3] == (1.0, 1.0, 0.0)
    assert stats.heads[1].chunk_log_decay_quantiles[5] == pytest.approx(-64.0)


def test_window_exactly_at_log_eps_counts_as_reached():
    # sum over 2 chunks == log(eps) exactly: the dropped term is eps * ||S||, allowed.
    sums = [np.array([[LOG_EPS / 2]] * 40)]
    fractions, counts = window_above_fraction(sums, 3, LOG_EPS)
    assert fractions[0, 0] == 1.0 and fractions[1, 0] == 0.0
    assert list(counts) == [40, 39, 38]


def test_quantile_decides_how_many_bad_windows_are_tolerated():
    # 1000 chunks of strong decay; one (Q=0.999: tolerated) or two (not) chunks with none.
    def head(bad_positions):
        c = np.full(1000, -20.0)
        c[list(bad_positions)] = 0.0
        return torch.tensor(np.repeat(c / C, C))[:, None]

    one_bad = calibrate_gates(head([500]))
    two_bad = calibrate_gates(head([100, 700]))
    assert one_bad.heads[0].n_h == 1
    assert two_bad.heads[0].n_h == 2          # every 2-chunk window holds a decaying chunk
    loose = calibrate_gates(head([100, 700]), CalibrationSettings(quantile=0.99))
    assert loose.heads[0].n_h == 1


def test_windows_do_not_cross_sequence_boundaries():
    g = torch.full((C, 1), LOG_EPS / 2 / C, dtype=torch.float64)
    joined = calibrate_gates(torch.cat([g, g]), CalibrationSettings(max_window=2))
    split = calibrate_gates([g, g], CalibrationSettings(max_window=2))
    assert joined.heads[0].n_h == 2
    assert split.heads[0].n_h is None           # no 2-chunk window exists inside one sequence


def test_partial_chunk_is_left_out_but_counted_as_tokens():
    g = torch.cat([torch.full((C, 1), -1.0), torch.zeros(30, 1)])
    sums = chunk_log_decay(g, C)
    assert sums.shape == (1, 1) and float(sums[0, 0]) == -64.0
    stats = calibrate_gates(g)
    assert stats.num_tokens == C + 30 and stats.num_chunks == 1
    assert stats.heads[0].zero_decay_fraction == pytest.approx(30 / 94)


def test_benchmark_style_gates_mark_zero_heads_exact():
    gen = torch.Generator().manual_seed(0)
    g = torch.nn.functional.logsigmoid(torch.randn(4, 4096, 8, generator=gen)) / 16
    g[..., ::4] = 0.0
    stats = calibrate_gates(g)
    for h in stats.heads:
        assert (h.cls == EXACT) == (h.head % 4 == 0)
        if h.cls == WARMUP:
            assert 1 <= h.n_h <= 16
    line = stats.summary_line(16)
    assert line.startswith("layer 0: 6 of 8 heads reach eps within") and "2 heads never decay enough" in line


def test_accumulator_batches_equal_one_call():
    gen = torch.Generator().manual_seed(1)
    g = -torch.rand(6, 512, 3, generator=gen) * 0.05
    acc = GateAccumulator(3, CalibrationSettings())
    for part in g.split(2):
        acc.add(part)
    assert acc.finish().heads == calibrate_gates(g).heads


@pytest.mark.parametrize("kwargs, word", [
    (dict(eps=0.0), "eps"), (dict(eps=1.0), "eps"), (dict(quantile=1.0), "quantile"),
    (dict(quantile=0.0), "quantile"), (dict(max_window=0), "max window"),
])
def test_bad_settings_are_named(kwargs, word):
    with pytest.raises(CalibrationError, match=word):
        CalibrationSettings(**kwargs)


def test_bad_gates_are_named():
    with pytest.raises(CalibrationError, match="<= 0"):
        calibrate_gates(torch.full((128, 2), 0.5))
    with pytest.raises(CalibrationError, match="NaN"):
        calibrate_gates(torch.full((128, 2), float("nan")))
    with pytest.raises(CalibrationError, match="no full chunk"):
        calibrate_gates(torch.zeros(10, 2))
    with pytest.raises(CalibrationError, match="shape"):
        calibrate_gates(torch.zeros(10))
