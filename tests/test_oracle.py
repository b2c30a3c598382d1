"""The float64 oracles: chunked == token recurrence, autograd backward, the KDA gate, and the
warm-up context-parallel bound (and how it breaks when b ||k||^2 > 2)."""
from __future__ import annotations

import math

import pytest
import torch

from gdn_inputs import make_inputs, rel_l2
from flashqla_tune.oracle import (
    EXACT,
    chunk_gated_delta_rule_chunked,
    recurrent_gated_delta_rule,
    segmented_gated_delta_rule,
    uniform_boundaries,
)

CASES = {
    "gva_mixed": dict(T=150, Hqk=2, Hv=4),
    "gva_group3": dict(T=100, Hqk=2, Hv=6, gate="strong"),
    "varlen_tails_and_empty": dict(cu_seqlens=[0, 1, 64, 64, 130, 257], Hqk=1, Hv=2),
    "initial_state_kv": dict(T=129, initial_state=True),
    "initial_state_vk": dict(T=129, initial_state=True, state_v_first=True),
    "varlen_state_vk": dict(cu_seqlens=[0, 70, 200], initial_state=True, state_v_first=True),
    "k_ne_v_dims": dict(T=90, K=8, V=24),
    "wide_k": dict(T=70, K=32, V=4),
    "beta_up_to_2": dict(T=130, beta_max=1.99),
    "weak_decay": dict(T=200, gate="weak"),
    "zero_decay": dict(T=200, gate="zero"),
    "batch2": dict(B=2, T=77, initial_state=True),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("l2norm", [False, True])
def test_chunked_equals_recurrence(name, l2norm):
    inp = make_inputs(seed=hash(name) % 1000, **CASES[name])
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=l2norm, scale=0.37)
    o_ref, s_ref = recurrent_gated_delta_rule(**inp, **kw)
    o, s = chunk_gated_delta_rule_chunked(**inp, **kw)
    assert rel_l2(o, o_ref) < 1e-12
    assert rel_l2(s, s_ref) < 1e-12


def test_recurrence_matches_an_explicit_matrix_form():
    """Independent check of the recurrence itself: S_t = e^g (I - b k k^T) S + b k v^T, o = scale S^T q."""
    inp = make_inputs(T=20, Hqk=1, Hv=2, K=5, V=3, initial_state=True, seed=3)
    o, s = recurrent_gated_delta_rule(**inp, output_final_state=True, scale=0.5)
    q, k, v, g, b = (inp[x][0] for x in ("q", "k", "v", "g", "beta"))
    for h in range(2):
        S = inp["initial_state"][0, h].clone()
        for t in range(20):
            kt = k[t, 0][:, None]
            S = math.exp(g[t, h]) * (torch.eye(5, dtype=S.dtype) - b[t, h] * kt @ kt.T) @ S + b[t, h] * kt @ v[t, h][None, :]
            assert torch.allclose(o[0, t, h], 0.5 * S.T @ q[t, 0], atol=1e-12)
        assert torch.allclose(s[0, h], S, atol=1e-12)


def test_per_key_gate_follows_kda_order():
    """KDA: S_t = (I - b k k^T) Diag(e^{g_t}) S_{t-1} + b k v^T, with g [B,T,Hv,K]."""
    inp = make_inputs(T=15, Hqk=1, Hv=1, K=4, V=3, initial_state=True, seed=5)
    g = -torch.rand(1, 15, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    o, s = recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], g, inp["beta"], scale=1.0,
                                      initial_state=inp["initial_state"], output_final_state=True)
    S = inp["initial_state"][0, 0].clone()
    for t in range(15):
        kt = inp["k"][0, t, 0][:, None]
        S = (torch.eye(4, dtype=S.dtype) - inp["beta"][0, t, 0] * kt @ kt.T) @ torch.diag(g[0, t, 0].exp()) @ S \
            + inp["beta"][0, t, 0] * kt @ inp["v"][0, t, 0][None, :]
        assert torch.allclose(o[0, t, 0], S.T @ inp["q"][0, t, 0], atol=1e-12)
    assert torch.allclose(s[0, 0], S, atol=1e-12)
    # A per-key gate with equal channels is the scalar gate.
    g_scalar = -torch.rand(1, 15, 1, dtype=torch.float64)
    o1, _ = recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], g_scalar, inp["beta"])
    o2, _ = recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], g_scalar[..., None].expand(1, 15, 1, 4), inp["beta"])
    assert torch.allclose(o1, o2, atol=1e-13)


def test_backward_through_autograd_is_correct():
    inp = make_inputs(T=6, Hqk=1, Hv=2, K=3, V=2, initial_state=True, seed=9)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = [inp[n].clone().requires_grad_(True) for n in names]

    def f(q, k, v, g, beta, h0):
        o, s = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return o, s

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7)


def test_chunked_rejects_per_key_gate_and_bad_shapes():
    inp = make_inputs(T=10)
    with pytest.raises(ValueError, match="scalar gate"):
        chunk_gated_delta_rule_chunked(inp["q"], inp["k"], inp["v"], inp["g"][..., None].expand(-1, -1, -1, 16), inp["beta"])
    with pytest.raises(ValueError, match="beta shape"):
        recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"][:, :5])


# ---------------------------------------------------------------- warm-up context parallelism

EPS = 1e-5
C = 64


def true_state(inp, t):
    """The exact state after the first t tokens of a single-sequence input ([Hv, K, V])."""
    if t == 0:
        h0 = inp["initial_state"]
        return torch.zeros_like(inp["v"][0, 0, :, :1]) if h0 is None else h0[0]
    cut = {k: (v[:, :t] if k in ("q", "k", "v", "g", "beta") else v) for k, v in inp.items() if k != "cu_seqlens"}
    return chunk_gated_delta_rule_chunked(**cut, output_final_state=True)[1][0]


def window_needed(g, boundary, max_n):
    """Per head, the smallest n whose n chunks before `boundary` sum to <= log(eps), else EXACT."""
    out = []
    for h in range(g.shape[-1]):
        n_h = EXACT
        for n in range(1, max_n + 1):
            start = boundary - n * C
            if start < 0:
                break
            if float(g[0, start:boundary, h].sum()) <= math.log(EPS):
                n_h = n
                break
        out.append(n_h)
    return out


def check_warmup_bound(inp, segment_chunks, max_n=16):
    T = inp["v"].shape[1]
    cuts = uniform_boundaries(T, segment_chunks)
    Hv = inp["v"].shape[2]
    table = torch.full((len(cuts) + 1, Hv), EXACT, dtype=torch.int64)
    for s, b in enumerate(cuts, start=1):
        table[s] = torch.tensor(window_needed(inp["g"], b, max_n))
    res = segmented_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], [cuts], [table],
                                     initial_state=inp["initial_state"])
    warmed = 0
    for s, b in enumerate(cuts, start=1):
        S_true = true_state(inp, b)
        for h in range(Hv):
            n = int(table[s, h])
            err = float((res.segment_initial_states[0][s, h] - S_true[h]).norm())
            if n == EXACT:
                # exact chaining (after possibly approximate earlier boundaries) stays close
                continue
            warmed += 1
            S_w = true_state(inp, b - n * C)[h]
            assert err <= EPS * float(S_w.norm()) * (1 + 1e-9) + 1e-12 * float(S_true[h].norm()), (s, h, n, err)
    return res, table, warmed


@pytest.mark.parametrize("seed", range(4))
def test_warmup_state_error_is_below_eps_times_window_state(seed):
    """Property test over random gates: every warmed boundary is within eps * ||S_w||."""
    gen = torch.Generator().manual_seed(100 + seed)
    inp = make_inputs(T=64 * 12 + 1, Hqk=1, Hv=4, K=8, V=4, gate="zero", initial_state=True, seed=seed)
    # per-head decay rates from strong to none: windows of 1..several chunks, and an exact head
    rates = torch.tensor([0.5, 0.1, 0.05, 0.0], dtype=torch.float64)
    inp["g"] = -rates * (0.5 + torch.rand(1, inp["g"].shape[1], 4, generator=gen, dtype=torch.float64))
    res, table, warmed = check_warmup_bound(inp, segment_chunks=3, max_n=6)
    assert warmed > 0
    assert (table[1:, 3] == EXACT).all(), "a zero-decay head never reaches log(eps): chained exactly"
    # the final segment here is a single token (T = 64 * 12 + 1)
    o_ref, s_ref = recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                              initial_state=inp["initial_state"], output_final_state=True)
    assert rel_l2(res.o, o_ref) < 1e-3


def test_window_reaching_log_eps_just_inside():
    """The window sum crosses log(eps) only in its last token: n is exactly the window, and the bound holds."""
    inp = make_inputs(T=64 * 8, Hqk=1, Hv=1, K=8, V=4, gate="zero", initial_state=True, seed=11)
    n = 3
    per_token = math.log(EPS) / (n * C) * (1 + 1e-6)  # n chunks sum just below log(eps)
    inp["g"][:] = per_token
    cut = 64 * 4
    assert window_needed(inp["g"], cut, 16) == [n]
    assert window_needed(inp["g"] * 0.999, cut, 16) == [n + 1]
    check_warmup_bound(inp, segment_chunks=4, max_n=16)


def test_exact_chaining_and_windows_past_the_start_are_exact():
    inp = make_inputs(cu_seqlens=[0, 1, 300, 700], Hqk=1, Hv=2, K=8, V=4, initial_state=True, seed=4)
    o_ref, s_ref = recurrent_gated_delta_rule(**inp, output_final_state=True)
    lens = [1, 299, 400]
    cuts = [uniform_boundaries(n, 2) for n in lens]
    exact = [torch.full((len(c) + 1, 2), EXACT) for c in cuts]
    reach_start = [torch.full((len(c) + 1, 2), 50) for c in cuts]  # windows longer than the prefix
    for table in (exact, reach_start):
        res = segmented_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], cuts, table,
                                         initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
        assert rel_l2(res.o, o_ref) < 1e-11 and rel_l2(res.final_state, s_ref) < 1e-11


def test_segment_transition_chaining_is_exact():
    """docs/cp-design.md's exact chaining: over a segment, S_end = M S_start + H, where M is the end
    state of a pass with v = 0 from S_start = I (so K = V), and H the end state from S_start = 0
    with the real v. Chaining M and H over segments reproduces the sequential state, and each
    segment's output from its chained start state reproduces the sequential output."""
    K = V = 8
    inp = make_inputs(T=300, Hqk=1, Hv=2, K=K, V=V, initial_state=True, seed=11)
    o_ref, s_ref = recurrent_gated_delta_rule(**inp, output_final_state=True)
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    eye = torch.eye(K, dtype=torch.float64).expand(1, 2, K, K).contiguous()
    state = inp["initial_state"]
    for lo, hi in ((0, 64), (64, 65), (65, 200), (200, 300)):  # one-token and tail segments included
        seg = [t[:, lo:hi] for t in (q, k, v, g, beta)]
        _, M = chunk_gated_delta_rule_chunked(seg[0], seg[1], torch.zeros_like(seg[2]), *seg[3:],
                                              initial_state=eye, output_final_state=True)
        _, H = chunk_gated_delta_rule_chunked(*seg, initial_state=torch.zeros_like(state), output_final_state=True)
        o_seg, s_seg = chunk_gated_delta_rule_chunked(*seg, initial_state=state, output_final_state=True)
        assert rel_l2(o_seg, o_ref[:, lo:hi]) < 1e-11
        state = M @ state + H  # [K x K] [K x V] + [K x V] per head
        assert rel_l2(state, s_seg) < 1e-11
    assert rel_l2(state, s_ref) < 1e-11


def test_segmented_validates_boundaries_and_tables():
    inp = make_inputs(T=200, Hqk=1, Hv=2, K=8, V=4)
    with pytest.raises(ValueError, match="multiples of 64"):
        segmented_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], [[100]], [torch.full((2, 2), EXACT)])
    with pytest.raises(ValueError, match="warmup shape"):
        segmented_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], [[64]], [torch.full((3, 2), EXACT)])
    with pytest.raises(ValueError, match=">= 1 or -1"):
        segmented_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], [[64]], [torch.zeros((2, 2))])


def test_bound_fails_when_beta_k_norm_exceeds_two():
    """b ||k||^2 = 3.5: (I - b k k^T) has eigenvalue -2.5 along k, so dropping Phi S_w is no longer
    bounded by e^{sum g}: the kernels must not warm up for such inputs."""
    T, n = 64 * 6, 2
    inp = make_inputs(T=T, Hqk=1, Hv=1, K=4, V=2, gate="zero", initial_state=True, seed=2)
    inp["k"][:] = 0
    inp["k"][..., 0] = 1.0  # every k is e1 (unit norm)
    inp["beta"][:] = 3.5
    inp["g"][:] = math.log(EPS) / (n * C) * 1.01
    cut = 64 * 4  # the window [128, 256) starts after the sequence start, so it really approximates
    assert window_needed(inp["g"], cut, 16) == [n]
    res = segmented_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], [[cut]],
                                     [torch.tensor([[EXACT], [n]])], initial_state=inp["initial_state"])
    S_true = true_state(inp, cut)[0]
    S_w = true_state(inp, cut - n * C)[0]
    err = float((res.segment_initial_states[0][1, 0] - S_true).norm())
    assert err > 1e3 * EPS * float(S_w.norm()), err


def test_guard_chains_exactly_when_the_input_does_not_decay():
    """Heads calibrated as decaying but fed zero decay: the guard refuses every window and the
    result is the exact recurrence; without the guard the same table is far off."""
    inp = make_inputs(T=64 * 9, Hqk=1, Hv=2, K=8, V=4, gate="zero", initial_state=True, seed=21)
    cuts = uniform_boundaries(64 * 9, 3)
    table = torch.full((len(cuts) + 1, 2), 2)  # "calibration said 2 chunks suffice"
    o_ref, s_ref = recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                              initial_state=inp["initial_state"], output_final_state=True)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], [cuts], [table])
    guarded = segmented_gated_delta_rule(*args, initial_state=inp["initial_state"], guard_eps=EPS)
    assert not guarded.used_warmup[0].any()
    assert rel_l2(guarded.o, o_ref) < 1e-11 and rel_l2(guarded.final_state, s_ref) < 1e-11
    unguarded = segmented_gated_delta_rule(*args, initial_state=inp["initial_state"])
    assert unguarded.used_warmup[0][1:].all() and rel_l2(unguarded.o, o_ref) > 1e-3


def test_guard_refuses_unnormalised_keys_and_keeps_safe_windows():
    T = 64 * 8
    inp = make_inputs(T=T, Hqk=1, Hv=2, K=8, V=4, gate="zero", initial_state=True, seed=22)
    inp["g"][:] = math.log(EPS) / 64 * 1.2   # every chunk reaches log(eps) on its own
    cuts = uniform_boundaries(T, 4)
    table = torch.tensor([[EXACT, EXACT], [1, 1]])
    safe = segmented_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], [cuts], [table],
                                      initial_state=inp["initial_state"], guard_eps=EPS)
    assert safe.used_warmup[0][1].all()
    k2 = inp["k"].clone()
    k2[0, cuts[0] - 10, 0] *= 2.0            # one token in the window with b ||k||^2 up to 4
    inp["beta"][0, cuts[0] - 10, :] = 0.9
    unsafe = segmented_gated_delta_rule(inp["q"], k2, inp["v"], inp["g"], inp["beta"], [cuts], [table],
                                        initial_state=inp["initial_state"], guard_eps=EPS)
    assert not unsafe.used_warmup[0][1].any(), "b ||k||^2 = 3.6 > 2 inside the window: chained exactly"
    with pytest.raises(ValueError, match="guard_eps=2"):
        segmented_gated_delta_rule(inp["q"], k2, inp["v"], inp["g"], inp["beta"], [cuts], [table], guard_eps=2)
