"""The float64 KDA oracles (per-key-channel gate): the chunked form against the token recurrence,
and the warm-up CP bound ||prod_t (I - b k k^T) Diag(e^{g_t})|| <= exp(sum_t max_k g_{t,k})
on the segmented form (docs/kda.md)."""
from __future__ import annotations

import math

import pytest
import torch

from flashqla_tune.oracle import (
    KIMI_LOWER_BOUND, chunk_kda_chunked, kda_chunk_step, kda_chunk_transition, kda_gate, kda_window_is_safe,
    kda_window_statistic, least_decay_per_token, recurrent_gated_delta_rule, recurrent_kda, segmented_kda,
)
from flashqla_tune.oracle.common import l2_normalize

C = 16   # a small chunk keeps the float64 oracles fast; the algebra does not depend on it


def inputs(B=1, T=64, Hqk=1, Hv=2, K=8, V=6, seed=0, decay=0.3, beta_max=1.0, h0=False, v_first=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hqk, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, Hqk, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, Hv, V, generator=gen, dtype=torch.float64)
    g = -decay * torch.rand(B, T, Hv, K, generator=gen, dtype=torch.float64)
    beta = beta_max * torch.rand(B, T, Hv, generator=gen, dtype=torch.float64)
    shape = (B, Hv, V, K) if v_first else (B, Hv, K, V)
    state = torch.randn(*shape, generator=gen, dtype=torch.float64) if h0 else None
    return q, k, v, g, beta, state


# ------------------------------------------------------------------- chunked == recurrence

@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("decay", [0.0, 0.3, 20.0])
def test_chunked_kda_equals_the_recurrence(v_first, decay):
    q, k, v, g, beta, h0 = inputs(B=2, T=45, Hqk=1, Hv=2, decay=decay, h0=True, v_first=v_first)
    ref = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, state_v_first=v_first)
    got = chunk_kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                            use_qk_l2norm_in_kernel=True, state_v_first=v_first, chunk_size=C)
    assert (got[0] - ref[0]).abs().max() < 1e-12
    assert (got[1] - ref[1]).abs().max() < 1e-12


def test_chunked_kda_varlen_equals_each_sequence_alone():
    q, k, v, g, beta, _ = inputs(T=70, Hqk=2, Hv=4)
    cu = torch.tensor([0, 17, 50, 70])
    o, final = chunk_kda_chunked(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 cu_seqlens=cu, chunk_size=C)
    for n in range(3):
        a, b = int(cu[n]), int(cu[n + 1])
        part = [x[:, a:b] for x in (q, k, v, g, beta)]
        o_n, f_n = recurrent_kda(*part, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert (o[:, a:b] - o_n).abs().max() < 1e-12
        assert (final[n] - f_n[0]).abs().max() < 1e-12


def test_a_gate_equal_across_channels_is_the_scalar_gate():
    q, k, v, g, beta, h0 = inputs(T=40, h0=True)
    scalar = g[..., 0]
    per_key = scalar[..., None].expand_as(g).contiguous()
    o_s, s_s = recurrent_gated_delta_rule(q, k, v, scalar, beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    o_k, s_k = chunk_kda_chunked(q, k, v, per_key, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, chunk_size=C)
    assert (o_s - o_k).abs().max() < 1e-12 and (s_s - s_k).abs().max() < 1e-12


def test_the_chunk_transition_is_the_chunks_action_on_its_state():
    q, k, v, g, beta, _ = inputs(T=C, Hv=2)
    hm = [x[0].transpose(0, 1) for x in (q.expand(-1, -1, 2, -1), k.expand(-1, -1, 2, -1), v, g, beta)]
    S = torch.randn(2, 8, 6, dtype=torch.float64)
    _, S_next = kda_chunk_step(S, *hm, 1.0)
    _, H = kda_chunk_step(torch.zeros_like(S), *hm, 1.0)
    M = kda_chunk_transition(hm[1], hm[3], hm[4])
    assert (M @ S + H - S_next).abs().max() < 1e-12


def test_the_oracles_refuse_a_scalar_gate():
    q, k, v, g, beta, _ = inputs(T=8)
    with pytest.raises(ValueError, match="per key channel"):
        chunk_kda_chunked(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="per key channel"):
        recurrent_kda(q, k, v, g[..., 0], beta)


# ----------------------------------------------------------------------- the segmented form

def test_segmented_kda_chained_exactly_equals_the_recurrence():
    q, k, v, g, beta, h0 = inputs(T=5 * C + 3, h0=True)
    res = segmented_kda(q, k, v, g, beta, boundaries=[[2 * C, 4 * C]], warmup=[torch.full((3, 2), -1)],
                        initial_state=h0, use_qk_l2norm_in_kernel=True, chunk_size=C)
    o, final = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
    assert (res.o - o).abs().max() < 1e-11 and (res.final_state - final).abs().max() < 1e-11
    assert not res.used_warmup[0].any()


def test_a_window_reaching_the_sequence_start_is_exact():
    q, k, v, g, beta, h0 = inputs(T=4 * C, h0=True)
    res = segmented_kda(q, k, v, g, beta, boundaries=[[2 * C]], warmup=[torch.full((2, 2), 5)],
                        initial_state=h0, use_qk_l2norm_in_kernel=True, chunk_size=C)
    o, _ = recurrent_kda(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True)
    assert (res.o - o).abs().max() < 1e-11


def warmup_errors(res):
    """Per warmed (segment, head): (||error of the segment's initial state||_F, exp(statistic) ||S_w||_F)."""
    out = []
    for s, h in res.used_warmup[0].nonzero().tolist():
        err = (res.segment_initial_states[0][s, h] - res.exact_initial_states[0][s, h]).norm()
        bound = math.exp(float(res.window_statistics[0][s, h])) * res.window_start_states[0][s, h].norm()
        out.append((float(err), float(bound)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_warmup_error_obeys_the_max_channel_bound_on_random_inputs(seed):
    """(a) Any gates, unit keys and beta in [0, 2): the warm-up state's error is Phi S_w with
    ||Phi|| <= exp(sum_t max_k g_{t,k}); checked for windows of 1 to 3 chunks, no guard."""
    decay = (0.02, 0.1, 0.5)[seed % 3]
    q, k, v, g, beta, h0 = inputs(T=6 * C, Hv=3, seed=seed, decay=decay, beta_max=2.0 * (1 - 1e-9), h0=True)
    k = l2_normalize(k, eps=0.0)
    gen = torch.Generator().manual_seed(100 + seed)
    # one channel per head left nearly open at random tokens: the max-channel rule must see it
    open_channel = torch.rand(g.shape[:-1], generator=gen, dtype=torch.float64) < 0.3
    g[..., 0] = torch.where(open_channel, g[..., 0] * 0.01, g[..., 0])
    table = torch.tensor([[1, 1, 1], [1, 2, 2], [3, 2, 1]])
    res = segmented_kda(q, k, v, g, beta, boundaries=[[3 * C, 5 * C]], warmup=[table], initial_state=h0,
                        chunk_size=C)
    pairs = warmup_errors(res)
    assert len(pairs) == 6
    for err, bound in pairs:
        assert err <= bound * (1 + 1e-9) + 1e-13
    # the bound is not vacuous here: windows that decay little keep most of the state
    assert max(err / bound for err, bound in pairs) > 1e-3


def test_the_guard_makes_every_warmed_state_eps_accurate():
    eps = 1e-4
    q, k, v, g, beta, h0 = inputs(T=6 * C, Hv=4, seed=7, decay=1.0, h0=True)
    k = l2_normalize(k, eps=0.0)
    g = g - 1.0                                # every channel decays by at least e^-1 per token
    g[:, :, 1, 0] = 0.0                        # head 1 keeps one channel open: the guard must refuse it
    table = torch.full((3, 4), 1)
    res = segmented_kda(q, k, v, g, beta, boundaries=[[2 * C, 4 * C]], warmup=[table], initial_state=h0,
                        chunk_size=C, guard_eps=eps)
    assert res.used_warmup[0][1:, [0, 2, 3]].all() and not res.used_warmup[0][:, 1].any()
    for err, _ in warmup_errors(res):
        assert err <= eps * 10  # |S_w| is O(1..10) here; the exact check is the next line's
    for s, h in res.used_warmup[0].nonzero().tolist():
        err = (res.segment_initial_states[0][s, h] - res.exact_initial_states[0][s, h]).norm()
        assert err <= eps * res.window_start_states[0][s, h].norm()


def test_the_guard_refuses_a_key_whose_reflection_could_grow_the_state():
    k_w = torch.ones(C, 4, dtype=torch.float64)        # ||k||^2 = 4
    g_w = torch.full((C, 4), -3.0, dtype=torch.float64)
    assert kda_window_is_safe(k_w, g_w, torch.full((C,), 0.5, dtype=torch.float64), 1e-6)   # b ||k||^2 = 2
    assert not kda_window_is_safe(k_w, g_w, torch.full((C,), 0.6, dtype=torch.float64), 1e-6)


# ------------------------------------------- (b) state moved between channels: sums are no bound

def channel_moving_case(mode: str):
    """K = 4, V = 3, one head, chunks of C. Chunk 0 writes a state along channel 1. The window
    (chunks 1..3): channel 0 decays hard while channel 1 holds the state; the keys then move the
    state from channel 1 into channel 0 ('rotate': 16 projections with b = 1 onto a line turning
    from e1 to e0; 'reflect': one Householder reflection, b = 2, swapping the two); then channel
    1 decays hard while channel 0 holds it. Channels 2 and 3 decay hard throughout. Chunk 4 reads
    channel 0."""
    T, K, V = 5 * C, 4, 3
    q = torch.zeros(1, T, 1, K, dtype=torch.float64)
    k = torch.zeros(1, T, 1, K, dtype=torch.float64)
    v = torch.zeros(1, T, 1, V, dtype=torch.float64)
    g = torch.full((1, T, 1, K), -4.0, dtype=torch.float64)
    beta = torch.zeros(1, T, 1, dtype=torch.float64)
    k[0, 0, 0, 1], v[0, 0, 0], beta[0, 0, 0] = 1.0, torch.tensor([1.0, -2.0, 0.5]), 1.0
    g[0, :C, 0, :2] = 0.0
    g[0, C:2 * C, 0, 1] = 0.0                          # phase 1: channel 0 decays, channel 1 holds
    g[0, 2 * C:3 * C, 0, :2] = 0.0                     # the move: no decay on either
    if mode == "rotate":
        for j in range(C):
            theta = (j + 1) * (math.pi / 2) / C        # the kept line turns from e1 to e0
            k[0, 2 * C + j, 0, 0], k[0, 2 * C + j, 0, 1] = math.cos(theta), -math.sin(theta)
            beta[0, 2 * C + j, 0] = 1.0
    else:
        k[0, 2 * C, 0, 0], k[0, 2 * C, 0, 1] = 2 ** -0.5, -(2 ** -0.5)
        beta[0, 2 * C, 0] = 2.0
    g[0, 3 * C:4 * C, 0, 0] = 0.0                      # phase 2: channel 1 decays, channel 0 holds
    g[0, 4 * C:, 0, 0] = 0.0
    q[0, 4 * C:, 0, 0] = 1.0
    return q, k, v, g, beta


@pytest.mark.parametrize("mode", ["rotate", "reflect"])
def test_state_moved_between_channels_defeats_per_channel_sums_but_not_the_max_channel_rule(mode):
    eps = 1e-6
    q, k, v, g, beta = channel_moving_case(mode)
    window = slice(C, 4 * C)
    per_channel_sums = g[0, window, 0].sum(0)
    assert (per_channel_sums <= math.log(eps)).all()   # a per-channel rule would call this window safe
    statistic = kda_window_statistic(g[0, window, 0])
    assert statistic == 0.0                             # every token keeps one channel open
    assert not kda_window_is_safe(k[0, window, 0], g[0, window, 0], beta[0, window, 0], eps)

    unguarded = segmented_kda(q, k, v, g, beta, boundaries=[[4 * C]], warmup=[torch.tensor([[1], [3]])],
                              chunk_size=C, scale=1.0)
    (err, bound), = warmup_errors(unguarded)
    s_w = unguarded.window_start_states[0][1, 0].norm()
    assert err / s_w > (0.9 if mode == "rotate" else 0.999)    # most of the state survived the window
    assert err <= bound * (1 + 1e-12)                           # and the max-channel bound still holds
    o_exact, _ = recurrent_kda(q, k, v, g, beta, scale=1.0)
    assert (unguarded.o - o_exact)[0, 4 * C:].abs().max() > 0.9  # the output after the boundary is wrong

    guarded = segmented_kda(q, k, v, g, beta, boundaries=[[4 * C]], warmup=[torch.tensor([[1], [3]])],
                            chunk_size=C, scale=1.0, guard_eps=eps)
    assert not guarded.used_warmup[0].any()
    assert (guarded.o - o_exact).abs().max() < 1e-12


# --------------------------------------------------------------- (c) Kimi's gate lower bound

def bounded_gates(T, Hv, K, seed, spread=4.0):
    gen = torch.Generator().manual_seed(seed)
    a = spread * torch.randn(1, T, Hv, K, generator=gen, dtype=torch.float64)
    A_log = torch.randn(Hv, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(Hv * K, generator=gen, dtype=torch.float64)
    return a, A_log, dt_bias


def test_the_lower_bounded_gate_stays_inside_its_bound_and_so_does_the_statistic():
    a, A_log, dt_bias = bounded_gates(T=4 * C, Hv=2, K=8, seed=0)
    g = kda_gate(a, A_log, dt_bias, lower_bound=KIMI_LOWER_BOUND)
    assert (g > KIMI_LOWER_BOUND).all() and (g < 0).all()
    unbounded = kda_gate(a, A_log, dt_bias)
    assert unbounded.min() < KIMI_LOWER_BOUND < 0 and (unbounded <= 0).all()
    stat = least_decay_per_token(g[0])                           # [T, Hv]
    assert (stat > KIMI_LOWER_BOUND).all()
    # a window of n tokens can reach log(eps) only if n >= log(eps) / lower_bound
    eps = 1e-6
    need = math.ceil(math.log(eps) / KIMI_LOWER_BOUND)
    for h in range(2):
        assert kda_window_statistic(g[0, :need - 1, h]) > math.log(eps)


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_holds_with_lower_bounded_gates(seed):
    Hv, K = 3, 8
    a, A_log, dt_bias = bounded_gates(T=6 * C, Hv=Hv, K=K, seed=seed)
    g = kda_gate(a, A_log, dt_bias, lower_bound=KIMI_LOWER_BOUND)
    q, k, v, _, beta, h0 = inputs(T=6 * C, Hv=Hv, K=K, seed=seed, beta_max=2.0 * (1 - 1e-9), h0=True)
    k = l2_normalize(k, eps=0.0)
    res = segmented_kda(q, k, v, g, beta, boundaries=[[2 * C, 4 * C]], warmup=[torch.ones(3, Hv, dtype=torch.int64)],
                        initial_state=h0, chunk_size=C)
    for err, bound in warmup_errors(res):
        assert err <= bound * (1 + 1e-9) + 1e-13


def test_saturated_channels_pass_the_guard_but_one_open_channel_does_not():
    """With every channel near the bound a one-chunk window decays by about e^{-5 C}: the guard
    takes it. Drive one channel's input to -inf and its gate goes to 0: the window is refused,
    whatever the other channels do."""
    K, eps = 8, 1e-6
    q, k, v, _, beta, h0 = inputs(T=3 * C, Hv=2, K=K, seed=3, h0=True)
    k = l2_normalize(k, eps=0.0)
    a = torch.full((1, 3 * C, 2, K), 30.0, dtype=torch.float64)
    a[:, :, 1, 5] = -60.0
    g = kda_gate(a, torch.zeros(2, dtype=torch.float64), None, lower_bound=KIMI_LOWER_BOUND)
    res = segmented_kda(q, k, v, g, beta, boundaries=[[2 * C]], warmup=[torch.ones(2, 2, dtype=torch.int64)],
                        initial_state=h0, chunk_size=C, guard_eps=eps)
    assert res.used_warmup[0][1].tolist() == [True, False]
    assert res.window_statistics[0][1, 0] == pytest.approx(KIMI_LOWER_BOUND * C, rel=1e-9)
    assert res.window_statistics[0][1, 1] > -1e-20
    (err, bound), = warmup_errors(res)
    assert err <= bound * (1 + 1e-9) and bound < 1e-30
    o, _ = recurrent_kda(q, k, v, g, beta, initial_state=h0)
    assert (res.o - o).abs().max() < 1e-12
