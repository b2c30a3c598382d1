"""The chunked backward (backward/chunked_torch.py, fp32 math) against float64 autograd of the
token recurrence (oracle/gradients.py), by relative L2 of each gradient, on fresh random inputs:
GVA, varlen with tails, empty and one-token sequences, rows past the last offset, an initial state
and a final-state gradient, both state layouts, in-kernel L2 norm, strong, weak and zero decay,
fp16, bf16 and fp32 inputs. In float64 the algorithm is exact (to rounding)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdn_inputs import gate_values, rel_l2

from flashqla_tune.backward import chunk_gated_delta_rule_bwd_torch
from flashqla_tune.oracle.gradients import recurrent_gated_delta_rule_gradients
from flashqla_tune.oracle.segmented import EXACT, segmented_state_gradient, uniform_boundaries

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")

# The bar of each gradient in fp32 math: dq, dk, dv, dh0 and dbeta, dg (tighter than the GPU bar of
# 8e-3 and 2e-2 by far; what fp32 reaches on these inputs is in docs/backward.md).
FP32_BAR = {"dq": 1e-5, "dk": 1e-5, "dv": 1e-5, "dh0": 1e-5, "dbeta": 1e-5, "dg": 1e-5}
# A gradient returned in a 16-bit dtype carries that dtype's rounding on top.
STORED_BAR = {torch.bfloat16: 4e-3, torch.float16: 5e-4}


@pytest.fixture(autouse=True)
def one_thread():
    """The float64 token oracle runs many small ops: one thread is fastest on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def draw(seed, *, seqlens=None, batch=1, T=None, hqk=2, hv=4, K=64, V=64, dtype=torch.bfloat16,
         gate_dtype=torch.float32, gate="mixed", h0=True, dht=True, state_v_first=False, normalised=True,
         tail=0, state_dtype=torch.float32):
    """Fresh inputs, the output gradient do and (optionally) the final state's gradient dht. tail:
    rows after cu_seqlens[-1] that belong to no sequence."""
    gen = torch.Generator().manual_seed(seed)
    B, T = (1, sum(seqlens) + tail) if seqlens is not None else (batch, T)
    q = torch.randn(B, T, hqk, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, hqk, K, generator=gen, dtype=torch.float64)
    if normalised:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(B, T, hv, V, generator=gen, dtype=torch.float64)
    g = gate_values(gate, (B, T, hv), gen)
    beta = torch.rand(B, T, hv, generator=gen, dtype=torch.float64)
    N = B if seqlens is None else len(seqlens)
    shape = (N, hv, V, K) if state_v_first else (N, hv, K, V)
    state = torch.randn(shape, generator=gen, dtype=torch.float64) if h0 else None
    do = torch.randn(B, T, hv, V, generator=gen, dtype=torch.float64)
    dfinal = torch.randn(shape, generator=gen, dtype=torch.float64) if dht else None
    cu = None if seqlens is None else torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()])
    inputs = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(gate_dtype), beta=beta.to(gate_dtype),
                  initial_state=None if state is None else state.to(state_dtype), cu_seqlens=cu,
                  state_v_first=state_v_first)
    return inputs, do.to(dtype), None if dfinal is None else dfinal.to(state_dtype)


CASES = {
    "gva varlen tails, empty and one-token, bf16 gates": dict(seqlens=[0, 1, 65, 135, 63], gate_dtype=torch.bfloat16),
    "state_v_first, in-kernel l2 norm, strong decay, fp16": dict(seqlens=[100, 64, 1], dtype=torch.float16,
                                                                 state_v_first=True, normalised=False, gate="strong",
                                                                 l2norm=True),
    "batch rows, weak decay, dht without h0": dict(batch=2, T=150, gate="weak", h0=False),
    "zero decay, h0 without dht, fp32": dict(seqlens=[200], gate="zero", dht=False, dtype=torch.float32),
    "strong decay, l2 norm, both layouts' vk, fp32": dict(seqlens=[30, 140], gate="strong", normalised=False,
                                                         l2norm=True, state_v_first=True, dtype=torch.float32),
    "rows past the last offset, Hqk = Hv, fp32": dict(seqlens=[50, 77], tail=20, hqk=4, dtype=torch.float32),
    "no state at all, mixed decay, bf16": dict(seqlens=[129, 2], h0=False, dht=False, hqk=1),
}


def errors_of(case: dict, seed: int, compute_dtype=torch.float32):
    case = dict(case)
    l2norm = case.pop("l2norm", False)
    inputs, do, dht = draw(seed, **case)
    ref = recurrent_gated_delta_rule_gradients(**inputs, do=do, dht=dht, use_qk_l2norm_in_kernel=l2norm)
    got = chunk_gated_delta_rule_bwd_torch(**inputs, do=do, dht=dht, use_qk_l2norm_in_kernel=l2norm,
                                           compute_dtype=compute_dtype)
    assert (got.dh0 is None) == (inputs["initial_state"] is None)
    for name, tensor in (("dq", inputs["q"]), ("dk", inputs["k"]), ("dv", inputs["v"]), ("dbeta", inputs["beta"])):
        assert getattr(got, name).dtype == tensor.dtype and getattr(got, name).shape == tensor.shape, name
    assert got.dg.dtype == torch.promote_types(compute_dtype, torch.float32) and got.dg.shape == inputs["g"].shape
    if got.dh0 is not None:
        assert got.dh0.dtype == inputs["initial_state"].dtype and got.dh0.shape == inputs["initial_state"].shape
    errors = {n: rel_l2(getattr(got, n), getattr(ref, n)) for n in NAMES if getattr(ref, n) is not None}
    return errors, got, inputs


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_backward_matches_the_float64_oracle(name):
    """Three fresh draws per case; each gradient within the fp32 bar (plus its storage dtype's rounding)."""
    for seed in range(3):
        errors, got, _ = errors_of(CASES[name], 1000 * seed + len(name))
        for n, err in errors.items():
            stored = getattr(got, n).dtype
            bar = STORED_BAR.get(stored, FP32_BAR[n])
            assert err < bar, (name, seed, n, errors)


@pytest.mark.parametrize("name", ["gva varlen tails, empty and one-token, bf16 gates",
                                  "strong decay, l2 norm, both layouts' vk, fp32"])
def test_the_algorithm_is_exact_in_float64(name):
    case = dict(CASES[name], dtype=torch.float64, gate_dtype=torch.float64, state_dtype=torch.float64)
    errors, _, _ = errors_of(case, 7, compute_dtype=torch.float64)
    assert max(errors.values()) < 1e-11, errors


@pytest.mark.parametrize("name", ["gva varlen tails, empty and one-token, bf16 gates",
                                  "state_v_first, in-kernel l2 norm, strong decay, fp16",
                                  "batch rows, weak decay, dht without h0"])
def test_the_chunked_oracle_form_gives_the_token_recurrences_gradients(name):
    case = dict(CASES[name])
    l2norm = case.pop("l2norm", False)
    inputs, do, dht = draw(11, **case)
    token = recurrent_gated_delta_rule_gradients(**inputs, do=do, dht=dht, use_qk_l2norm_in_kernel=l2norm)
    chunked = recurrent_gated_delta_rule_gradients(**inputs, do=do, dht=dht, use_qk_l2norm_in_kernel=l2norm,
                                                   form="chunked")
    for n in NAMES:
        if getattr(token, n) is not None:
            assert rel_l2(getattr(chunked, n), getattr(token, n)) < 1e-12, n
    with pytest.raises(ValueError, match="form='scan'"):
        recurrent_gated_delta_rule_gradients(**inputs, do=do, dht=dht, form="scan")


def test_rows_past_the_last_offset_get_zero_gradients():
    _, got, inputs = errors_of(CASES["rows past the last offset, Hqk = Hv, fp32"], 3)
    end = int(inputs["cu_seqlens"][-1])
    for n in ("dq", "dk", "dv", "dg", "dbeta"):
        assert torch.equal(getattr(got, n)[:, end:], torch.zeros_like(getattr(got, n)[:, end:])), n


def test_a_call_without_tokens_passes_the_state_gradient_through():
    """Empty sequences only: dh0 is dht itself (the state passes unchanged), the token gradients are empty."""
    q = torch.zeros(1, 0, 2, 16)
    v = torch.zeros(1, 0, 4, 8)
    g = torch.zeros(1, 0, 4)
    h0 = torch.randn(2, 4, 16, 8)
    dht = torch.randn(2, 4, 16, 8)
    got = chunk_gated_delta_rule_bwd_torch(q, q, v, g, g, v, dht=dht, initial_state=h0,
                                           cu_seqlens=torch.tensor([0, 0, 0]))
    assert torch.equal(got.dh0, dht) and got.dh0.data_ptr() != dht.data_ptr()
    assert got.dq.shape == q.shape and got.dv.shape == v.shape and got.dg.shape == g.shape


def test_shapes_that_do_not_fit_are_refused():
    inputs, do, dht = draw(0, seqlens=[10], K=16, V=8)
    with pytest.raises(ValueError, match="must be v's"):
        chunk_gated_delta_rule_bwd_torch(**inputs, do=do[..., :4], dht=dht)
    with pytest.raises(ValueError, match="dht shape"):
        chunk_gated_delta_rule_bwd_torch(**inputs, do=do, dht=dht.transpose(-1, -2))
    inputs["cu_seqlens"] = torch.tensor([0, 11])
    with pytest.raises(ValueError, match="ends at 11"):
        chunk_gated_delta_rule_bwd_torch(**inputs, do=do, dht=dht)


# ---------------------------------------------------------------- the reverse chain under warm-up CP

EPS = 1e-5


def segmented_case(seed, gate, seqlens=(300, 200), hv=2):
    inputs, do, dht = draw(seed, seqlens=list(seqlens), hqk=1, hv=hv, K=16, V=8, dtype=torch.float64,
                           gate_dtype=torch.float64, gate=gate, state_dtype=torch.float64)
    cuts = [uniform_boundaries(n, 1) for n in seqlens]  # a segment per chunk
    return inputs, do, dht, cuts


def no_state(inputs):
    """The state gradients do not depend on the initial state (the chain is affine in it)."""
    return {n: t for n, t in inputs.items() if n != "initial_state"}


def table(cuts, hv, n):
    return [torch.full((len(c) + 1, hv), n, dtype=torch.int64) for c in cuts]


def test_the_exact_reverse_chain_gives_the_oracles_initial_state_gradient():
    inputs, do, dht, cuts = segmented_case(11, "mixed")
    res = segmented_state_gradient(**no_state(inputs), do=do, dht=dht, boundaries=cuts, warmup=table(cuts, 2, EXACT))
    ref = recurrent_gated_delta_rule_gradients(**inputs, do=do, dht=dht)
    assert rel_l2(res.initial_state_gradient, ref.dh0) < 1e-12
    for chosen, exact in zip(res.end_gradients, res.exact_end_gradients):
        assert torch.equal(chosen, exact)
    assert not any(u.any() for u in res.used_warmup)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_reverse_window_drops_at_most_eps_times_the_gradient_at_its_far_end(seed):
    """Strong decay: a one-chunk reverse window decays below log(eps); the guard lets it run and the
    gradient it starts the segment from is within eps * ||dS_w|| of the exact one, per head."""
    inputs, do, dht, cuts = segmented_case(20 + seed, "strong")
    res = segmented_state_gradient(**no_state(inputs), do=do, dht=dht, boundaries=cuts, warmup=table(cuts, 2, 1),
                                   guard_eps=EPS)
    used = 0
    for chosen, exact, far, warmed in zip(res.end_gradients, res.exact_end_gradients, res.window_end_gradients,
                                          res.used_warmup):
        for s, h in warmed.nonzero().tolist():
            used += 1
            assert (chosen[s, h] - exact[s, h]).norm() <= EPS * far[s, h].norm() * (1 + 1e-9)
        for s, h in (~warmed).nonzero().tolist():
            assert torch.allclose(chosen[s, h], exact[s, h], rtol=1e-12, atol=1e-12)
    assert used > 0


def test_the_guard_chains_exactly_where_the_reverse_window_does_not_decay():
    """Weak decay: without the guard a one-chunk window drops far more than eps * ||dS_w|| (so the
    bound above can fail); with it, every window is refused and the gradients are exact."""
    inputs, do, dht, cuts = segmented_case(30, "weak")
    unguarded = segmented_state_gradient(**no_state(inputs), do=do, dht=dht, boundaries=cuts, warmup=table(cuts, 2, 1))
    chosen, exact, far = unguarded.end_gradients[0], unguarded.exact_end_gradients[0], unguarded.window_end_gradients[0]
    assert (chosen[0, 0] - exact[0, 0]).norm() > 100 * EPS * far[0, 0].norm()
    guarded = segmented_state_gradient(**no_state(inputs), do=do, dht=dht, boundaries=cuts, warmup=table(cuts, 2, 1),
                                       guard_eps=EPS)
    assert not any(u.any() for u in guarded.used_warmup)
    ref = recurrent_gated_delta_rule_gradients(**inputs, do=do, dht=dht)
    assert rel_l2(guarded.initial_state_gradient, ref.dh0) < 1e-12


def test_a_reverse_window_past_the_sequence_end_starts_from_dht_and_is_exact():
    inputs, do, dht, cuts = segmented_case(40, "weak")
    res = segmented_state_gradient(**no_state(inputs), do=do, dht=dht, boundaries=cuts, warmup=table(cuts, 2, 16),
                                   guard_eps=EPS)
    assert not any(u.any() for u in res.used_warmup)
    for chosen, exact in zip(res.end_gradients, res.exact_end_gradients):
        assert torch.allclose(chosen, exact, rtol=1e-12, atol=1e-12)
