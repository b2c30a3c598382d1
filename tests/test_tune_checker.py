"""The tuner's oracle check (flashqla_tune/tune/measure.py OracleChecker) on the CPU: the kernel
launch is replaced by test doubles built on the float64 oracle, so what is tested is the
checker's own logic: both runs (one chain, forced context parallelism) into NaN-poisoned
buffers, each compared with the oracle."""
from __future__ import annotations

import pytest
import torch

from flashqla_tune import warmup_tables
from flashqla_tune.oracle import chunk_gated_delta_rule_chunked
from flashqla_tune.plan import KernelPlan, default_tiles
from flashqla_tune.spec import GDNSpec
from flashqla_tune.tune import measure

PLAN = KernelPlan(GDNSpec(2, 8), default_tiles(GDNSpec(2, 8)))


def oracle_kernel(broken_cp: str | None = None):
    """A stand-in for runtime.forward that writes the oracle's answer into the given buffers;
    broken_cp="wrong" scales o when context parallelism is asked for, "unwritten" leaves the
    buffers as they came (NaN)."""
    calls = []

    def forward(plan, q, k, v, g, beta, cu, h0, scale, output_final_state, use_qk_l2norm, out=None,
                final_out=None, prep_schedule="auto", warmup=None, warmup_eps=None, segment_lengths=None):
        calls.append({"warmup": warmup, "warmup_eps": warmup_eps, "segment_lengths": segment_lengths})
        if warmup is not None and broken_cp == "unwritten":
            return out, final_out
        o, s = chunk_gated_delta_rule_chunked(q, k, v, g, beta, scale=scale, initial_state=h0,
                                              output_final_state=True, cu_seqlens=cu)
        if warmup is not None and broken_cp == "wrong":
            o = o * 1.1
        out.copy_(o)
        final_out.copy_(s)
        return out, final_out
    return forward, calls


@pytest.mark.parametrize("broken, ok", [(None, True), ("wrong", False), ("unwritten", False)])
def test_the_check_runs_one_chain_and_forced_context_parallelism(monkeypatch, broken, ok):
    forward, calls = oracle_kernel(broken)
    monkeypatch.setattr(measure.runtime, "forward", forward)
    result = measure.OracleChecker(device="cpu").check(PLAN, handle=None)
    assert result.ok is ok
    assert set(result.errors) == {"o", "state", "o_cp", "state_cp"}
    assert result.errors["o"] < 5e-3 and result.errors["state"] < 1e-6   # o is stored in bf16
    if broken == "wrong":
        assert result.errors["o_cp"] == pytest.approx(0.1, rel=1e-3)
    # the second run asked for CP with the default table, cutting the 700- and 1100-token sequences
    assert calls[0]["warmup"] is None
    cp = calls[1]
    assert cp["warmup"] == warmup_tables.default_table(8) and cp["warmup_eps"] == warmup_tables.DEFAULT_EPS
    length = cp["segment_lengths"][0]
    assert set(cp["segment_lengths"]) == {length} and warmup_tables.DEFAULT_WINDOW_CHUNKS < length
    assert any(-(-n // 64) > length for n in measure.CHECK_SEQLENS)   # some check sequence is cut

