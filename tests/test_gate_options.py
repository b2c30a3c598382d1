"""FLA's in-kernel gate and beta options on the CPU: the op's checks and routing, the spec, plan,
render and cache key, the PyTorch and float64 formulas. The GPU side is tests/test_gpu_gate_options.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flashqla_tune import ops, runtime
from flashqla_tune.cache import keyed_source
from flashqla_tune.oracle import apply_gate_options, fla_beta, fla_gate, recurrent_gated_delta_rule
from flashqla_tune.plan import default_plan, kernel_spec
from flashqla_tune.render import Renderer, plan_json, render_context
from flashqla_tune.spec import GATE_OPTIONS, GDNSpec, SpecError

HV = 8


def _inputs(T=64, requires_grad=False):
    q = torch.randn(1, T, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, 128, dtype=torch.bfloat16)
    g, beta = torch.randn(1, T, HV), torch.randn(1, T, HV)
    if requires_grad:
        g.requires_grad_(True)
    return q, q.clone(), v, g, beta


@pytest.fixture
def run_calls(monkeypatch):
    """The op on CPU tensors up to run_checked, which records its arguments instead of launching."""
    seen = []
    monkeypatch.setattr(ops, "check_inputs", ops.check_shapes_and_types)
    monkeypatch.setattr(ops, "run_checked", lambda *args, **kw: seen.append((args, kw)) or ("o", "final"))
    monkeypatch.setattr(ops.host_path, "forward", lambda *a: pytest.fail("a gated call must not take the C++ path"))
    return seen


# --- the op -------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, want", [
    (dict(use_gate_in_kernel=True, A_log="A", dt_bias="dt"), (True, False, False)),
    (dict(use_gate_in_kernel=True, A_log="A"), (True, False, False)),
    (dict(use_beta_sigmoid_in_kernel=True), (False, True, False)),
    (dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True), (False, True, True)),
    (dict(use_gate_in_kernel=True, A_log="A", dt_bias="dt", use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
     (True, True, True)),
])
def test_the_op_takes_flas_options_and_hands_them_to_the_kernels(run_calls, options, want):
    params = {"A": torch.randn(HV), "dt": torch.randn(HV)}
    options = {k: params.get(v, v) if isinstance(v, str) else v for k, v in options.items()}
    x = _inputs()
    assert ops.chunk_gated_delta_rule(*x, **options, chunk_size=64) == ("o", "final")
    (args, kw), = run_calls
    assert kw["gate_options"] == want and kw["plan_name"] == ""
    assert kw["A_log"] is options.get("A_log") and kw["dt_bias"] is options.get("dt_bias")
    assert args[3] is x[3] and args[4] is x[4]          # g and beta raw: the kernels transform them


def test_a_call_that_needs_a_gradient_computes_the_gates_in_torch_first(run_calls):
    """The custom op's backward differentiates the gates it is given: a grad call hands it the
    transformed g and beta (autograd reaches A_log, dt_bias and the raw inputs through them) and no
    gate options."""
    q, k, v, g, beta = _inputs(requires_grad=True)
    A_log, dt_bias = torch.randn(HV, requires_grad=True), torch.randn(HV)
    ops.chunk_gated_delta_rule(q, k, v, g, beta, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                               use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    (args, kw), = run_calls
    assert "gate_options" not in kw and "A_log" not in kw
    want_g, want_beta = apply_gate_options(g.detach(), beta, A_log.detach(), dt_bias, True, True, True)
    torch.testing.assert_close(args[3].double(), want_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(args[4].double(), want_beta, rtol=1e-5, atol=1e-6)
    (args[3].sum() + args[4].sum()).backward()
    assert g.grad is not None and A_log.grad is not None
    # A_log requiring grad alone makes the call a grad call too
    run_calls.clear()
    ops.chunk_gated_delta_rule(*_inputs(), use_gate_in_kernel=True, A_log=A_log)
    assert "gate_options" not in run_calls[0][1]


@pytest.mark.parametrize("A_log, dt_bias, error, match", [
    (torch.zeros(HV + 1), None, ValueError, r"A_log shape \(9,\), expected \[Hv\]=\(8,\)"),
    (torch.zeros(1, HV), None, ValueError, r"A_log shape \(1, 8\)"),
    (torch.zeros(HV), torch.zeros(4), ValueError, r"dt_bias shape \(4,\), expected \[Hv\]=\(8,\)"),
    (torch.zeros(HV, dtype=torch.float64), None, ops.UnsupportedError, "A_log dtype torch.float64"),
    (torch.zeros(HV), torch.zeros(HV, dtype=torch.int32), ops.UnsupportedError, "dt_bias dtype torch.int32"),
    ([0.0] * HV, None, TypeError, "A_log must be a torch.Tensor of shape \\[Hv\\]=\\(8,\\), got list"),
    (torch.zeros(HV, device="meta"), None, ValueError, "A_log is on meta but q is on cpu"),
    (torch.zeros(HV), torch.zeros(HV, device="meta"), ValueError, "dt_bias is on meta but q is on cpu"),
])
def test_gate_parameters_are_checked_naming_the_value(run_calls, A_log, dt_bias, error, match):
    with pytest.raises(error, match=match):
        ops.chunk_gated_delta_rule(*_inputs(), use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    assert run_calls == []


def test_inconsistent_uses_of_the_options_are_refused_by_name():
    """What FLA would silently ignore or refuse: A_log or dt_bias without use_gate_in_kernel,
    allow_neg_eigval without the sigmoid, the in-kernel gate without A_log."""
    for kw, match in ((dict(kwargs={"A_log": torch.zeros(HV)}), "A_log .* use_gate_in_kernel=False"),
                      (dict(kwargs={"dt_bias": torch.zeros(HV)}), "dt_bias .* use_gate_in_kernel=False"),
                      (dict(allow_neg_eigval=True), "requires use_beta_sigmoid_in_kernel=True"),
                      (dict(kwargs={"use_gate_in_kernel": True}), "needs A_log")):
        with pytest.raises(ValueError, match=match):
            ops.check_options(**kw)


def test_run_checked_refuses_a_gated_call_that_needs_a_gradient_or_a_packs_plan(monkeypatch):
    monkeypatch.setattr(ops, "check_gpu", lambda device: None)
    q, k, v, g, beta = _inputs(requires_grad=True)
    cu = torch.tensor([0, 64])
    with pytest.raises(RuntimeError, match="must compute them in PyTorch first"):
        ops.run_checked(q, k, v, g, beta, None, None, False, False, False, cu, "", gate_options=(False, True, False))
    with pytest.raises(ops.UnsupportedError, match="plan p .* built without in-kernel gate"):
        ops.run_checked(q, k, v, g.detach(), beta, None, None, False, False, False, cu, "p",
                        gate_options=(False, True, False))


def test_the_runtime_refuses_gate_parameters_that_do_not_fit_the_plan():
    x = _inputs()
    cu = torch.tensor([0, 64])
    gated = default_plan(GDNSpec(2, HV, gate_in_kernel=True))
    with pytest.raises(ValueError, match="computes the gate in the kernel, but the call passes A_log=None"):
        runtime.forward(gated, *x, cu, None, 0.1, False, False)
    with pytest.raises(ValueError, match="does not compute the gate in the kernel"):
        runtime.forward(default_plan(GDNSpec(2, HV)), *x, cu, None, 0.1, False, False, a_log=torch.zeros(HV))


# --- the formulas ---------------------------------------------------------------------------------

def test_the_torch_gates_are_flas_formulas_with_its_softplus_threshold():
    g_raw = torch.tensor([-40.0, -3.0, 0.0, 5.0, 19.9, 20.0, 20.5, 60.0])
    A_log, dt_bias = torch.full((8,), 0.3), torch.full((8,), -0.5)
    g, beta = ops.gates_in_torch(g_raw, g_raw, A_log, dt_bias, (True, True, True))
    x = g_raw.double() - 0.5
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(g.double(), -torch.exp(torch.tensor(0.3, dtype=torch.float64)) * softplus,
                               rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(beta.double(), 2 * torch.sigmoid(g_raw.double()), rtol=1e-6, atol=0)
    assert g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(fla_gate(g_raw, A_log, dt_bias), g.double(), rtol=1e-6, atol=1e-30)
    assert fla_gate(torch.tensor([25.0]), torch.zeros(1)).item() == -25.0   # above the threshold: x itself
    assert torch.all(fla_beta(torch.randn(100), allow_neg_eigval=True) < 2)
    gate_only, beta_as_given = ops.gates_in_torch(g_raw, g_raw, A_log, None, (True, False, False))
    assert beta_as_given is g_raw
    torch.testing.assert_close(gate_only.double(), fla_gate(g_raw, A_log), rtol=1e-6, atol=1e-30)


def test_the_oracle_applies_the_options_before_the_recurrence():
    torch.manual_seed(0)
    q, k = torch.randn(1, 40, 2, 32), torch.randn(1, 40, 2, 32)
    v, g_raw, b_raw = torch.randn(1, 40, 4, 16), torch.randn(1, 40, 4), torch.randn(1, 40, 4)
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    o, s = recurrent_gated_delta_rule(q, k, v, g_raw, b_raw, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                      use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    g, beta = fla_gate(g_raw, A_log, dt_bias), 2 * torch.sigmoid(b_raw.double())
    o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    with pytest.raises(ValueError, match="requires use_beta_sigmoid_in_kernel"):
        apply_gate_options(g_raw, b_raw, allow_neg_eigval=True)


# --- spec, plan, render, cache key --------------------------------------------------------------

def test_the_spec_names_its_options_and_keeps_the_old_dict_without_them():
    plain = GDNSpec(16, 32)
    assert all(name not in plain.to_dict() for name in GATE_OPTIONS)     # the plan JSON of existing plans
    gated = GDNSpec(16, 32, gate_in_kernel=True, beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    assert gated.name == plain.name + "_gik_bsig_neg"
    assert GDNSpec(16, 32, beta_sigmoid_in_kernel=True).name == plain.name + "_bsig"
    assert GDNSpec.from_dict(gated.to_dict()) == gated and GDNSpec.from_dict(plain.to_dict()) == plain
    assert gated.gate_options == (True, True, True)
    with pytest.raises(SpecError, match="allow_neg_eigval=True needs beta_sigmoid_in_kernel=True"):
        GDNSpec(16, 32, allow_neg_eigval=True)
    with pytest.raises(SpecError, match="gate_in_kernel must be a bool, got 1"):
        GDNSpec(16, 32, gate_in_kernel=1)
    with pytest.raises(SpecError, match="not of gate_kind='per_key'"):
        GDNSpec(16, 32, gate_kind="per_key", gate_in_kernel=True)


def test_the_options_reach_the_kernel_spec_the_plan_the_template_and_the_cache_key():
    plain = default_plan(GDNSpec(16, 32))
    gated = default_plan(GDNSpec(16, 32, gate_in_kernel=True, beta_sigmoid_in_kernel=True))
    assert kernel_spec(gated.spec).gate_options == (True, True, False)
    assert gated.name != plain.name and gated.tiles == plain.tiles
    ctx = render_context(gated)
    assert (ctx["gate_in_kernel"], ctx["beta_sigmoid_in_kernel"], ctx["allow_neg_eigval"]) == ("true", "true", "false")
    assert render_context(plain)["gate_in_kernel"] == "false"
    text = Renderer().render(gated)
    assert ("fqt::GateOptions</*gate_in_kernel=*/true, /*beta_sigmoid=*/true,\n"
            "                               /*neg_eigval=*/false>") in text
    assert "fqt::gdn_fwd_launch<Plan, Gates>" in text
    assert '"gate_in_kernel":true' in plan_json(gated) and "gate_in_kernel" not in plan_json(plain)
    assert keyed_source(gated).key != keyed_source(plain).key
    neg = dataclasses.replace(gated.spec, allow_neg_eigval=True)
    assert keyed_source(default_plan(neg)).key != keyed_source(gated).key


def test_a_call_picks_the_spec_of_its_options():
    q, _, v, _, _ = _inputs()
    assert ops.call_spec(q, v, False) == GDNSpec(2, HV)
    assert ops.call_spec(q, v, True, (True, True, True)) == GDNSpec(
        2, HV, state_layout="vk", gate_in_kernel=True, beta_sigmoid_in_kernel=True, allow_neg_eigval=True)


# --- through the custom op to the launch struct (a recording library stands in for the kernels) -

class RecordingLibrary:
    def __init__(self):
        self.calls = []

    def workspace_bytes(self, total_tokens, num_seqs, max_segments=0):
        return 4096

    def launch(self, args, stream):
        import ctypes

        copy = type(args)()
        ctypes.pointer(copy)[0] = args
        self.calls.append(copy)


GATED_LIBRARY = RecordingLibrary()
GATED_PLAN = default_plan(GDNSpec(2, HV, state_layout="vk", gate_in_kernel=True, beta_sigmoid_in_kernel=True,
                                  allow_neg_eigval=True))
runtime.register_library(GATED_PLAN, GATED_LIBRARY)


@pytest.fixture
def recorded(monkeypatch):
    from flashqla_tune import warmup_tables

    GATED_LIBRARY.calls.clear()
    monkeypatch.setattr(warmup_tables, "sm_count", lambda device: 132)
    monkeypatch.setattr(runtime, "current_stream_handle", lambda device: 1234)
    monkeypatch.setattr(ops, "check_gpu", lambda device: None)      # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(ops, "check_inputs", ops.check_shapes_and_types)
    return GATED_LIBRARY


def _gated_call(q, k, v, g, beta, A_log, dt_bias, cu):
    return ops.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, state_v_first=True, cu_seqlens=cu,
                                      use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, use_gate_in_kernel=True,
                                      A_log=A_log, dt_bias=dt_bias)


def test_the_launch_gets_the_raw_gates_and_the_gate_parameters(recorded):
    q, k, v, g, beta = _inputs(T=100)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    o, final = _gated_call(q, k, v, g, beta, A_log, dt_bias, torch.tensor([0, 100]))
    assert o.shape == v.shape and final.shape == (1, HV, 128, 128)
    args, = recorded.calls
    assert args.g == g.data_ptr() and args.beta == beta.data_ptr()          # raw, fp32 already: not copied
    assert args.a_log == A_log.data_ptr() and args.dt_bias == dt_bias.data_ptr()
    recorded.calls.clear()
    _gated_call(q, k, v, g, beta, A_log.bfloat16(), None, torch.tensor([0, 100]))
    args, = recorded.calls
    assert args.a_log and args.a_log != A_log.data_ptr() and args.dt_bias is None  # upcast; no bias


def test_torch_compile_traces_a_gated_call_in_one_graph(recorded):
    q, k, v, g, beta = _inputs(T=128)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    cu = torch.tensor([0, 128])

    def step(q, k, v, g, beta, A_log, dt_bias, cu):
        o, s = _gated_call(q, k, v, g, beta, A_log, dt_bias, cu)
        return o.float().sum() + s.sum()

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(step, fullgraph=True, backend="eager")(q, k, v, g, beta, A_log, dt_bias, cu)
    assert len(recorded.calls) == 1 and recorded.calls[0].a_log and recorded.calls[0].dt_bias
