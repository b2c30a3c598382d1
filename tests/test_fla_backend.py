"""The FLA backend on the CPU: the verifier's refusals with reasons, and dispatch through a
stand-in of FLA's registry (fla_doubles) ahead of a FakeFlashQLABackend. The pack is a
pack_doubles pack; FakeHopper stands in for an sm_90 device check."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import flashqla_tune
from flashqla_tune.fla_backend import BACKEND_TYPE, ENV_VAR, backend_class, verify_call

sys.path.insert(0, str(Path(__file__).parent))
from fla_doubles import FakeFlashQLABackend, make_fake_fla_backends  # noqa: E402
from pack_doubles import FakeLibraryOpener, make_pack  # noqa: E402


def FakeHopper(t):   # noqa: N802 - a test double for fla_backend.cuda_arch
    return (9, 0)


@pytest.fixture
def pack_ops(tmp_path):
    return flashqla_tune.load(make_pack(tmp_path / "p"), gpu=None, open_library=FakeLibraryOpener())


def args(hqk=2, hv=8, T=6, dtype=torch.bfloat16, K=128, V=128):
    q = torch.zeros(1, T, hqk, K, dtype=dtype)
    return [q, q.clone(), torch.zeros(1, T, hv, V, dtype=dtype), torch.zeros(1, T, hv), torch.zeros(1, T, hv)]


def test_verifier_accepts_what_the_pack_runs(pack_ops):
    assert verify_call(pack_ops, *args(), use_qk_l2norm_in_kernel=True, device_arch=FakeHopper) == (True, None)
    assert verify_call(pack_ops, *args(8, 8), output_final_state=True, device_arch=FakeHopper,
                       chunk_indices=torch.zeros(1, 2, dtype=torch.int64), chunk_size=64) == (True, None)


@pytest.mark.parametrize("call, reason", [
    (lambda: (args(), {"use_gate_in_kernel": True}), "use_gate_in_kernel=True needs A_log"),
    (lambda: (args(), {"use_gate_in_kernel": True, "A_log": torch.zeros(4)}), "A_log shape (4,)"),
    (lambda: (args(), {"use_gate_in_kernel": True, "A_log": torch.zeros(8), "dt_bias": torch.zeros(8, 1)}),
     "dt_bias shape (8, 1)"),
    (lambda: (args(), {"allow_neg_eigval": True}), "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel"),
    (lambda: (args(), {"cp_context": object()}), "cp_context"),
    (lambda: (args(), {"transpose_state_layout": True}), "transpose_state_layout"),
    (lambda: (args(), {"head_first": False}), "unexpected keyword argument 'head_first'"),
    (lambda: (args(), {"chunk_size": 32}), "chunk_size=32"),
    (lambda: (args(), {"A_log": torch.zeros(8)}), "A_log"),
    (lambda: (args(), {"dt_bias": torch.zeros(8)}), "dt_bias"),
    (lambda: (args(), {"chunk_indices": torch.zeros(3)}), "chunk_indices shape (3,)"),
    (lambda: (args(dtype=torch.float32), {}), "torch.float32"),
    (lambda: (args(K=64), {}), "K=64"),
    (lambda: (args(V=256), {}), "V=256"),
    (lambda: (args(4, 16), {}), "Hqk=4/Hv=16"),                         # heads the pack lacks
    (lambda: (args(dtype=torch.float16), {}), "float16"),                # dtype the pack lacks
    (lambda: (args(), {"state_v_first": True}), "state vk"),
])
def test_verifier_refuses_with_a_reason(pack_ops, call, reason):
    a, kw = call()
    ok, why = verify_call(pack_ops, *a, device_arch=FakeHopper, **kw)
    assert not ok and reason in why


def test_verifier_takes_flas_positional_order(pack_ops):
    """FLA's dispatch hands the verifier the caller's arguments as they came: a positional call
    in FLA's order reaches the same parameters (chunk_indices before cp_context)."""
    q, k, v, g, beta = args()
    fla_order = [q, k, v, g, beta, None, None, False, True, False, False, False, None, None,
                 torch.zeros(1, 2, dtype=torch.int64), None]
    assert verify_call(pack_ops, *fla_order, device_arch=FakeHopper) == (True, None)
    for index, value, reason in ((9, 1, "use_beta_sigmoid_in_kernel must be a bool"),
                                 (10, True, "allow_neg_eigval=True"), (11, True, "state vk"),
                                 (15, object(), "cp_context=object")):
        call = list(fla_order)
        call[index] = value
        ok, why = verify_call(pack_ops, *call, device_arch=FakeHopper)
        assert not ok and reason in why, (index, why)


def test_verifier_serves_grad_calls_and_refuses_other_devices(pack_ops):
    a = args()
    a[2].requires_grad_(True)
    assert verify_call(pack_ops, *a, device_arch=FakeHopper) == (True, None)
    ok, why = verify_call(pack_ops, *args())          # the real device check: CPU tensors
    assert not ok and "not on a CUDA GPU" in why
    ok, why = verify_call(pack_ops, *args(), device_arch=lambda t: (10, 0))
    assert not ok and "sm_100" in why


def test_dispatch_through_the_registry_ahead_of_flashqla(pack_ops, monkeypatch):
    fla = make_fake_fla_backends()
    fla.register("gated_delta_rule")(FakeFlashQLABackend)
    cls = flashqla_tune.register_fla_backend(None, fla_backends=fla, pack_ops=pack_ops, device_arch=FakeHopper)
    assert issubclass(cls, fla.BaseBackend) and cls.priority < FakeFlashQLABackend.priority
    assert cls.backend_type == BACKEND_TYPE
    seen = {}

    def spy(*a, **kw):   # the kernels need a GPU: record what the backend passes on
        seen.update(kw)
        return "pack result"

    monkeypatch.setattr(pack_ops, "chunk_gated_delta_rule", spy)

    def chunk_gated_delta_rule(*a, **kw):   # FLA's Triton function, the last fallback
        return "FLA triton result"

    fla_fn = fla.dispatch("gated_delta_rule", chunk_gated_delta_rule)
    assert fla_fn(*args(), use_qk_l2norm_in_kernel=True) == "pack result"
    assert seen["layer"] is None and seen["use_qk_l2norm_in_kernel"] is True
    # a positional call in FLA's order, with FLA's keyword options, reaches the pack's op by name
    cu, cu_cpu, indices = torch.tensor([0, 6]), torch.tensor([0, 6]), torch.zeros(1, 2, dtype=torch.int64)
    seen.clear()
    assert fla_fn(*args(), 0.5, None, True, True, False, False, False, cu, cu_cpu, indices, None,
                  chunk_size=64, use_gate_in_kernel=False) == "pack result"
    assert (seen["scale"], seen["output_final_state"], seen["use_qk_l2norm_in_kernel"]) == (0.5, True, True)
    assert seen["cu_seqlens"] is cu and seen["cu_seqlens_cpu"] is cu_cpu and seen["chunk_indices"] is indices
    assert seen["state_v_first"] is False and seen["cp_context"] is None and seen["chunk_size"] == 64
    # A refused call goes on to the next backend, and FLA logs our reason.
    assert fla_fn(*args(), use_gate_in_kernel=True) == "FakeFlashQLA result"
    assert fla.log[-2] == (BACKEND_TYPE, "reject", fla.log[-2][2]) and "use_gate_in_kernel" in fla.log[-2][2]
    monkeypatch.setenv(ENV_VAR, "0")
    assert fla_fn(*args()) == "FakeFlashQLA result"


def test_register_without_fla_says_what_is_missing(pack_ops):
    try:
        import fla.backends  # noqa: F401
        pytest.skip("fla is importable here; the real registry is tested below")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="fla-core >= 0.6"):
        flashqla_tune.register_fla_backend(None, pack_ops=pack_ops)
    with pytest.raises(ValueError, match="priority='2'"):
        backend_class(pack_ops, object, priority="2")


def test_real_fla_registry(pack_ops):
    backends = pytest.importorskip("fla.backends")
    cls = flashqla_tune.register_fla_backend(None, pack_ops=pack_ops)
    registry = backends._get_operation_registry("gated_delta_rule")
    assert isinstance(registry._backends[BACKEND_TYPE], cls)
    assert registry._get_sorted_backends()[0].backend_type in (BACKEND_TYPE, "triton_ascend")


def test_verifier_takes_flas_in_kernel_gate_and_beta_options(pack_ops):
    """FLA's GatedDeltaNet layer calls with use_gate_in_kernel (A_log, dt_bias [Hv]),
    use_beta_sigmoid_in_kernel and allow_neg_eigval: the backend takes them."""
    gate = {"use_gate_in_kernel": True, "A_log": torch.zeros(8), "dt_bias": torch.zeros(8)}
    for kw in (gate, {**gate, "dt_bias": None}, {"use_beta_sigmoid_in_kernel": True},
               {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True},
               {**gate, "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}):
        assert verify_call(pack_ops, *args(), device_arch=FakeHopper, **kw) == (True, None), kw


def test_the_backend_hands_the_pack_flas_options_as_given(pack_ops, monkeypatch):
    """The pack's op applies FLA's in-kernel options (tests/test_autograd_op.py checks how): the
    backend passes them on untouched."""
    seen = {}
    monkeypatch.setattr(pack_ops, "chunk_gated_delta_rule", lambda *a, **kw: seen.update(kw, args=a) or "pack result")
    cls = backend_class(pack_ops, object, device_arch=FakeHopper)
    q, k, v, g_raw, b_raw = args()
    A_log, dt_bias = torch.randn(8), torch.randn(8)
    assert cls().chunk_gated_delta_rule(q, k, v, g_raw, b_raw, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                        chunk_size=64) == "pack result"
    assert seen["args"][3] is g_raw and seen["args"][4] is b_raw
    assert seen["use_beta_sigmoid_in_kernel"] is True and seen["allow_neg_eigval"] is True
    assert seen["use_gate_in_kernel"] is True and seen["A_log"] is A_log and seen["dt_bias"] is dt_bias
    assert seen["chunk_size"] == 64 and seen["layer"] is None

