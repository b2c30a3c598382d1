"""FLA's in-kernel gate and beta options on the H200, against the float64 oracle of the same formulas.

use_gate_in_kernel (g = -exp(A_log) * softplus(g_raw + dt_bias)), use_beta_sigmoid_in_kernel and
allow_neg_eigval (beta = 2 sigmoid(b)) are computed by the prep kernel and the CP guard
(csrc/gdn_gate_options.cuh). Per case and over three fresh random draws, for o and the final state
each: DESIGN.md's bar (rel L2 <= max(2 x FLA's error on the same raw inputs and options, 2e-3) and
< 1e-2; tests/test_gpu_forward.accuracy_bars), and at most 1.1 x the error of the same kernels run on
gates precomputed in PyTorch + 1e-4 (the options must cost no accuracy). Outputs are poisoned with
NaN first, so an element the kernels never write fails. CP cases force the segment length and
compare with the oracle and with the same call without CP.
"""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

import test_gpu_forward as fwd  # noqa: E402  (its helpers: bars, FLA, NaN-poisoned runs)
from gdn_inputs import rel_l2  # noqa: E402

from flashqla_tune import ops, runtime  # noqa: E402
from flashqla_tune.oracle import apply_gate_options, chunk_gated_delta_rule_chunked  # noqa: E402
from flashqla_tune.oracle import recurrent_gated_delta_rule  # noqa: E402

DEV = "cuda"
G, S, SN, GSN = (True, False, False), (False, True, False), (False, True, True), (True, True, True)


def raw_gates(kind, shape, hv, gen):
    """(g_raw, A_log, dt_bias) whose gate -exp(A_log) softplus(g_raw + dt_bias) decays as `kind` says:
    mixed: A in [1, 16] and dt_bias = softplus^-1(dt), dt in [1e-3, 0.1] (as models initialise them),
    every fourth head A_log = -inf (g = 0); strong: ~-0.7 / token; weak: ~-0.002 / token; zero: A_log =
    -inf everywhere; threshold: A = 0.01 with a twentieth of g_raw + dt_bias in (20, 30), above
    softplus's threshold; no_decay_raw: g_raw = -50, so the raw g looks like strong decay and the gate
    is ~1e-22 (none)."""
    g_raw = torch.randn(shape, generator=gen, device=DEV)
    dt_bias = torch.zeros(hv, device=DEV)
    if kind == "mixed":
        A_log = torch.empty(hv, device=DEV).uniform_(0.0, math.log(16.0), generator=gen)
        dt = torch.exp(torch.empty(hv, device=DEV).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
        dt_bias = dt + torch.log(-torch.expm1(-dt))      # softplus(dt_bias) = dt
        A_log[::4] = -math.inf
    elif kind == "threshold":
        A_log = torch.full((hv,), math.log(0.01), device=DEV)
        dt_bias = torch.randn(hv, generator=gen, device=DEV)
        spikes = torch.rand(shape, generator=gen, device=DEV) < 0.05
        g_raw = torch.where(spikes, 20.0 + 10 * torch.rand(shape, generator=gen, device=DEV) - dt_bias, g_raw)
    elif kind == "strong":
        A_log = torch.zeros(hv, device=DEV)
    elif kind == "weak":
        A_log = torch.full((hv,), math.log(0.003), device=DEV)
    elif kind == "zero":
        A_log = torch.full((hv,), -math.inf, device=DEV)
    elif kind == "no_decay_raw":
        g_raw = torch.full(shape, -50.0, device=DEV)
        A_log = torch.zeros(hv, device=DEV)
    else:
        raise ValueError(kind)
    return g_raw, A_log, dt_bias


def make_case(seed, seqlens, hqk, hv, dtype, decay, h0, layout_vk, options, normalised=True, batch=None,
              k_scale=1.0, dt_bias=True):
    """fwd.make_case's inputs with raw g and beta for `options` (g precomputed where the option is off)."""
    inp = fwd.make_case(seed, seqlens, hqk, hv, dtype, "mixed", h0, layout_vk, normalised, batch, k_scale)
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    gate_in_kernel, beta_sigmoid, _ = options
    if gate_in_kernel:
        inp["g"], inp["A_log"], inp["dt_bias"] = raw_gates(decay, inp["g"].shape, hv, gen)
        if not dt_bias:
            inp["dt_bias"] = None
    else:
        inp["g"] = fwd.gate_values(decay if decay in ("strong", "weak", "zero", "mixed") else "mixed",
                                   inp["g"].shape, gen, torch.float32)
        inp["A_log"] = inp["dt_bias"] = None
    if beta_sigmoid:
        inp["beta"] = 2.0 * torch.randn(inp["beta"].shape, generator=gen, device=DEV)
    inp["options"] = options
    return inp


def precomputed(inp):
    """The same call with g and beta computed in PyTorch (ops.gates_in_torch) and no options."""
    g, beta = ops.gates_in_torch(inp["g"], inp["beta"], inp["A_log"], inp["dt_bias"], inp["options"])
    return {**inp, "g": g.contiguous(), "beta": beta.contiguous(), "A_log": None, "dt_bias": None,
            "options": ops.NO_GATE_OPTIONS}


def run_ours(inp, l2norm, warmup=None, segment_length=None):
    """runtime.forward on the default plan of the case's options, into NaN-poisoned buffers."""
    with torch.no_grad():
        return fwd.run_ours(inp, l2norm, warmup=warmup,
                            segment_lengths=None if segment_length is None else (segment_length,) * 32,
                            gate_options=inp["options"], a_log=inp["A_log"], dt_bias=inp["dt_bias"])


def reference(inp, l2norm):
    """The float64 chunked oracle (checked against the token recurrence) on the float64 transforms."""
    g, beta = apply_gate_options(inp["g"], inp["beta"], inp["A_log"], inp["dt_bias"], *inp["options"])
    return chunk_gated_delta_rule_chunked(inp["q"], inp["k"], inp["v"], g, beta, initial_state=inp["initial_state"],
                                          output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                          cu_seqlens=inp["cu_seqlens"])


def fla_errors(inp, l2norm, ref_o, ref_s):
    """FLA's error on the same raw inputs, with its own in-kernel options; None without FLA."""
    fla = fwd.fla_forward()
    if fla is None:
        return None
    gate_in_kernel, beta_sigmoid, neg = inp["options"]
    kw = dict(use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg)
    if gate_in_kernel:
        kw.update(use_gate_in_kernel=True, A_log=inp["A_log"], dt_bias=inp["dt_bias"])
    try:
        with torch.no_grad():
            o, s = fla(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=128 ** -0.5,
                       initial_state=inp["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                       cu_seqlens=inp["cu_seqlens"], **kw)
    except Exception as exc:  # an FLA that lacks an option: the bar's fixed part alone
        fwd.LOG.append(f"fla refused: {type(exc).__name__}: {str(exc)[:120]}")
        return None
    return rel_l2(o, ref_o), rel_l2(s, ref_s)


def check(inp, l2norm, label, warmup=None, segment_length=None):
    o, s = run_ours(inp, l2norm, warmup, segment_length)
    for t, what in ((o, "output"), (s, "final-state")):
        assert not torch.isnan(t).any(), f"{label}: unwritten (NaN) {what} elements"
    ref_o, ref_s = reference(inp, l2norm)
    err_o, err_s = rel_l2(o, ref_o), rel_l2(s, ref_s)
    base_o, base_s = (rel_l2(t, r) for t, r in zip(run_ours(precomputed(inp), l2norm, warmup, segment_length),
                                                    (ref_o, ref_s)))
    fla = fla_errors(inp, l2norm, ref_o, ref_s)
    bar_o, bar_s = fwd.accuracy_bars(fla)
    line = (f"{label} o={err_o:.2e} (torch gates {base_o:.2e}, bar {bar_o:.2e}) "
            f"state={err_s:.2e} (torch gates {base_s:.2e}, bar {bar_s:.2e})"
            + (f" fla_o={fla[0]:.2e} fla_state={fla[1]:.2e}" if fla else " fla=absent"))
    print(line)
    fwd.LOG.append(line)
    assert err_o <= bar_o and err_s <= bar_s, line
    assert err_o <= 1.1 * base_o + 1e-4 and err_s <= 1.1 * base_s + 1e-4, line
    if segment_length is not None:   # CP: at most 1.1 x the same call's error without CP + 1e-4
        ex_o, ex_s = (rel_l2(t, r) for t, r in zip(run_ours(inp, l2norm), (ref_o, ref_s)))
        assert err_o <= 1.1 * ex_o + 1e-4 and err_s <= 1.1 * ex_s + 1e-4, f"{line} no-CP o={ex_o:.2e} s={ex_s:.2e}"


LONG_AND_SHORT = [1, 17, 63, 64, 65, 127, 300, 4100, 5, 0, 129]

CASES = {
    # name: (seqlens, hqk, hv, dtype, decay, h0, layout_vk, l2norm, options, dt_bias, batch)
    "gate_gva_varlen": (LONG_AND_SHORT, 2, 8, torch.bfloat16, "mixed", True, False, False, G, True, None),
    "gate_no_dt_bias_group3": ([600, 70], 16, 48, torch.bfloat16, "mixed", True, False, False, G, False, None),
    "gate_softplus_threshold": ([1100], 16, 16, torch.bfloat16, "threshold", True, False, False, G, True, None),
    "sigmoid_gva_varlen_fp16": (LONG_AND_SHORT, 2, 8, torch.float16, "mixed", True, False, False, S, True, None),
    "neg_eigval_l2norm": ([777, 1500], 4, 16, torch.bfloat16, "mixed", True, False, True, SN, True, None),
    "all_state_v_first": ([1000, 2049], 2, 8, torch.bfloat16, "mixed", True, True, True, GSN, True, None),
    "all_strong_decay": ([3000], 2, 8, torch.bfloat16, "strong", True, False, False, GSN, True, None),
    "all_weak_decay": ([3000], 2, 8, torch.bfloat16, "weak", True, False, False, GSN, True, None),
    "all_zero_decay_no_h0": ([2000], 2, 8, torch.bfloat16, "zero", False, False, False, GSN, True, None),
    "all_batch2_dense_fp16": ([300], 2, 8, torch.float16, "mixed", True, False, False, GSN, True, 2),
}

MIXED_2_8 = [5, 5, 5, 5, -1, 5, 5, 5]
CP_CASES = {
    # name: (seqlens, hqk, hv, decay, layout_vk, l2norm, k_scale, options, warmup, segment length)
    "cp_all_mixed_varlen": ([8192, 17, 4100, 0, 1000, 8192 + 33], 2, 8, "mixed", False, False, 1.0, GSN,
                            MIXED_2_8, 8),
    "cp_all_strong_state_v_first": ([8192, 300], 2, 8, "strong", True, True, 1.0, GSN, [3] * 8, 8),
    # raw g = -50 everywhere: a guard that summed the raw g would take every window, but the gate is
    # ~1e-22 (no decay), so every boundary must chain exactly
    "cp_raw_gate_that_does_not_decay": ([8192], 2, 8, "no_decay_raw", False, False, 1.0, G, [2] * 8, 8),
    # beta up to 2 with ||k||^2 = 1.69: windows with beta ||k||^2 > 2 must chain exactly
    "cp_neg_eigval_k_too_long": ([8192], 2, 8, "strong", False, False, 1.3, GSN, [1] * 8, 8),
    "cp_neg_eigval_l2norm": ([8192 + 100], 4, 16, "mixed", False, True, 1.0, SN,
                             [-1 if h % 2 == 0 else 4 for h in range(16)], 16),
}


@pytest.fixture(scope="module", autouse=True)
def built_plans():
    """Every plan this module runs (with the options, and without for the torch-gate runs), built in
    one parallel ninja run."""
    from flashqla_tune.cache import get_kernels

    shapes = {(hqk, hv, dtype == torch.bfloat16, vk, opts)
              for _, hqk, hv, dtype, _, _, vk, _, opts, _, _ in CASES.values()}
    shapes |= {(hqk, hv, True, vk, opts) for _, hqk, hv, _, vk, _, _, opts, _, _ in CP_CASES.values()}
    specs = {ops._spec(hqk, hv, 128, 128, bf16, vk, *opts) for hqk, hv, bf16, vk, opts in shapes}
    specs |= {ops._spec(hqk, hv, 128, 128, bf16, vk) for hqk, hv, bf16, vk, _ in shapes}
    get_kernels([runtime.default_plan_for(spec) for spec in sorted(specs, key=str)])


@pytest.mark.parametrize("name", list(CASES))
def test_options_match_the_float64_oracle(name):
    seqlens, hqk, hv, dtype, decay, h0, vk, l2norm, options, dt_bias, batch = CASES[name]
    for seed in range(3):
        inp = make_case(1000 * seed + 5, seqlens, hqk, hv, dtype, decay, h0, vk, options, normalised=not l2norm,
                        batch=batch, dt_bias=dt_bias)
        check(inp, l2norm, f"{name:28s} seed={seed}")


@pytest.mark.parametrize("name", list(CP_CASES))
def test_options_with_context_parallelism(name):
    """Warm-up CP with the guard on the transformed gate and beta: the oracle's bar, the torch-gate
    kernels' error and the no-CP error (DESIGN.md, "Verification")."""
    seqlens, hqk, hv, decay, vk, l2norm, k_scale, options, warmup, length = CP_CASES[name]
    for seed in range(3):
        inp = make_case(2000 * seed + 13, seqlens, hqk, hv, torch.bfloat16, decay, True, vk, options,
                        normalised=not l2norm, k_scale=k_scale)
        check(inp, l2norm, f"{name:28s} seed={seed}", warmup=warmup, segment_length=length)


def test_the_guard_chains_exactly_where_the_transformed_gate_does_not_decay():
    """cp_raw_gate_that_does_not_decay, sharpened: with windows of one chunk and segments of two, a
    guard that read the raw g (-50 per token) would drop almost the whole state at every boundary.
    The result must equal the no-CP chain's to within its own error."""
    inp = make_case(77, [64 * 64], 2, 8, torch.bfloat16, "no_decay_raw", True, False, G)
    o_cp, s_cp = run_ours(inp, False, warmup=[1] * 8, segment_length=2)
    o_ex, s_ex = run_ours(inp, False)
    ref_o, ref_s = reference(inp, False)
    assert rel_l2(o_cp, ref_o) <= 1.1 * rel_l2(o_ex, ref_o) + 1e-4
    assert rel_l2(s_cp, ref_s) <= 1.1 * rel_l2(s_ex, ref_s) + 1e-4


def op_args(inp):
    kw = dict(initial_state=inp["initial_state"], output_final_state=True, cu_seqlens=inp["cu_seqlens"],
              state_v_first=inp["state_v_first"], use_beta_sigmoid_in_kernel=inp["options"][1],
              allow_neg_eigval=inp["options"][2])
    if inp["options"][0]:
        kw.update(use_gate_in_kernel=True, A_log=inp["A_log"], dt_bias=inp["dt_bias"])
    if kw["initial_state"] is not None and inp["state_v_first"]:
        kw["initial_state"] = kw["initial_state"].transpose(-1, -2).contiguous()
    return (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"]), kw


def test_the_public_op_runs_the_options_in_the_kernels_and_in_a_cuda_graph():
    inp = make_case(3, [700, 300], 2, 8, torch.bfloat16, "mixed", True, True, GSN)
    args, kw = op_args(inp)
    with torch.no_grad():
        o, s = ops.chunk_gated_delta_rule(*args, **kw)
    ref_o, ref_s = reference(inp, False)
    assert rel_l2(o, ref_o) < 1e-2 and rel_l2(s.transpose(-1, -2), ref_s) < 1e-2
    fresh = make_case(4, [700, 300], 2, 8, torch.bfloat16, "mixed", True, True, GSN)
    fwd.assert_replay_on_new_inputs_equals_eager(lambda: ops.chunk_gated_delta_rule(*args, **kw), inp, fresh,
                                                 names=("q", "k", "v", "g", "beta", "A_log", "dt_bias"))


def test_gradients_through_the_options_reach_a_log_dt_bias_and_the_raw_inputs():
    """A call that needs a gradient computes the options in PyTorch before the custom op: its
    gradients, A_log's and dt_bias's included, match float64 autograd through the oracle."""
    inp = make_case(9, [200, 90], 2, 8, torch.bfloat16, "mixed", True, False, GSN)
    inp["A_log"][::4] = 0.5            # finite everywhere: a gradient through exp(-inf) is 0 / NaN-prone
    leaves = {name: inp[name].detach().clone().requires_grad_(True)
              for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
    case = {**inp, **leaves}
    args, kw = op_args(case)
    o, s = ops.chunk_gated_delta_rule(*args, **kw)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    torch.autograd.backward((o, s), (do, ds))
    ref_leaves = {name: t.detach().double().requires_grad_(True) for name, t in leaves.items()}
    ref_o, ref_s = recurrent_gated_delta_rule(
        ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], ref_leaves["g"], ref_leaves["beta"],
        initial_state=inp["initial_state"].double(), output_final_state=True, cu_seqlens=inp["cu_seqlens"],
        use_gate_in_kernel=True, A_log=ref_leaves["A_log"], dt_bias=ref_leaves["dt_bias"],
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    torch.autograd.backward((ref_o, ref_s), (do.double(), ds.double()))
    bars = {"q": 1e-2, "k": 1e-2, "v": 1e-2, "g": 2e-2, "beta": 2e-2, "A_log": 2e-2, "dt_bias": 2e-2}
    for name, leaf in leaves.items():
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), name
        err = rel_l2(leaf.grad, ref_leaves[name].grad)
        print(f"grad {name}: rel L2 {err:.2e} (bar {bars[name]:.0e})")
        assert err < bars[name], (name, err)


def test_fla_layer_shaped_call_state_v_first_with_every_option():
    """FLA's GatedDeltaNet layer's call (q/k l2norm, raw gate and beta, v-first state) at a supported
    shape, through the public op with no refusal."""
    inp = make_case(21, [513, 1024], 4, 8, torch.bfloat16, "mixed", True, True, GSN, normalised=False)
    args, kw = op_args(inp)
    with torch.no_grad():
        o, s = ops.chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True, **kw)
    ref_o, ref_s = reference(inp, True)
    assert rel_l2(o, ref_o) < 1e-2 and rel_l2(s.transpose(-1, -2), ref_s) < 1e-2
