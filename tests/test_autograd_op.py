"""Autograd through the op on the CPU: the custom op's registered backward, the final state's
gradient, the double-backward error, torch.compile tracing both directions, a pack's op and the
FLA backend taking grad calls. The Hopper forward needs a GPU, so a named test double
(TorchForwardDouble) stands in for runtime.forward; everything above it (the public op, its
packing of batch rows, the custom op, setup_context, the backward custom op and the chunked
backward) is the real code, and its gradients are checked against the float64 oracle."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gdn_inputs import gate_values, rel_l2  # noqa: E402
from pack_doubles import FakeLibraryOpener, make_pack  # noqa: E402

import flashqla_tune  # noqa: E402
from flashqla_tune import ops, runtime  # noqa: E402
from flashqla_tune.backward.autograd import DOUBLE_BACKWARD_ERROR  # noqa: E402
from flashqla_tune.fla_backend import verify_call  # noqa: E402
from flashqla_tune.measure.torch_chunked import chunk_gated_delta_rule_torch  # noqa: E402
from flashqla_tune.oracle.gradients import recurrent_gated_delta_rule_gradients  # noqa: E402

D = 128  # the head dims the op's shape checks accept


class TorchForwardDouble:
    """Test double for runtime.forward (the Hopper kernels): the chunked forward in float64 PyTorch
    on the packed inputs, o in v's dtype and the final state fp32 (empty when not asked for), as
    the kernels return them. Records the plan and warm-up table of each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, plan, q, k, v, g, beta, cu_seqlens, initial_state, scale, output_final_state, use_qk_l2norm,
                 warmup=None, **kw):
        self.calls.append((plan.name, warmup))
        o, final = chunk_gated_delta_rule_torch(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm, state_v_first=plan.spec.state_layout == "vk",
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens.cpu(), compute_dtype=torch.float64)
        final = final.float() if output_final_state else q.new_empty((0,), dtype=torch.float32)
        return o.to(v.dtype), final


@pytest.fixture(autouse=True)
def one_thread():
    """The float64 token oracle runs many small ops: one thread is fastest on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def forward_double(monkeypatch):
    double = TorchForwardDouble()
    monkeypatch.setattr(runtime, "forward", double)
    monkeypatch.setattr(ops, "check_gpu", lambda device: None)      # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(ops, "check_inputs", ops.check_shapes_and_types)
    return double


def make_leaves(seed, seqlens=None, batch=None, T=None, hqk=2, hv=4, dtype=torch.bfloat16, gate="mixed",
                h0=True, state_v_first=False, normalised=True):
    """Fresh random inputs for the op (K = V = 128), as leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)
    B, T = (1, sum(seqlens)) if seqlens is not None else (batch, T)
    q = torch.randn(B, T, hqk, D, generator=gen)
    k = torch.randn(B, T, hqk, D, generator=gen)
    if normalised:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(B, T, hv, D, generator=gen)
    g = gate_values(gate, (B, T, hv), gen, torch.float32)
    beta = torch.rand(B, T, hv, generator=gen)
    n = B if seqlens is None else len(seqlens)
    state = torch.randn((n, hv, D, D), generator=gen) if h0 else None
    leaves = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta, initial_state=state)
    for t in leaves.values():
        if t is not None:
            t.requires_grad_(True)
    cu = None if seqlens is None else torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()])
    return leaves, cu, gen


def oracle(leaves, cu, do, dht, **kw):
    inputs = {n: None if t is None else t.detach() for n, t in leaves.items()}
    return recurrent_gated_delta_rule_gradients(**inputs, do=do, dht=dht, cu_seqlens=cu, **kw)


# Relative L2 a gradient stored in each dtype can reach: its rounding, over fp32 math of a float64 forward
STORED = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-4}


def check_grads(leaves, ref):
    errors = {}
    for name, want in (("q", ref.dq), ("k", ref.dk), ("v", ref.dv), ("g", ref.dg), ("beta", ref.dbeta),
                       ("initial_state", ref.dh0)):
        t = leaves[name]
        if t is None:
            continue
        assert t.grad is not None, name
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
        errors[name] = rel_l2(t.grad, want)
        assert errors[name] < STORED[t.dtype], (name, errors)
    return errors


@pytest.mark.parametrize("dtype, state_v_first, l2norm", [(torch.bfloat16, False, True), (torch.float16, True, False)])
def test_op_gradients_match_the_float64_oracle_through_the_forward_double(forward_double, dtype, state_v_first,
                                                                           l2norm):
    """GVA (2 q/k heads, 4 v-heads), varlen with an empty, a one-token and a tail sequence, an initial
    state and a final-state gradient: every gradient lands on its leaf in the leaf's dtype, close to
    float64 autograd of the token recurrence on the same (rounded) inputs."""
    leaves, cu, gen = make_leaves(1, seqlens=[0, 1, 70, 59], dtype=dtype, state_v_first=state_v_first,
                                  normalised=not l2norm)
    o, final = ops.chunk_gated_delta_rule(**leaves, scale=0.25, output_final_state=True, cu_seqlens=cu,
                                          use_qk_l2norm_in_kernel=l2norm, state_v_first=state_v_first)
    assert o.grad_fn is not None and final.grad_fn is not None
    do = torch.randn(o.shape, generator=gen).to(dtype)
    dht = torch.randn(final.shape, generator=gen)
    torch.autograd.backward((o, final), (do, dht))
    ref = oracle(leaves, cu, do, dht, scale=0.25, use_qk_l2norm_in_kernel=l2norm, state_v_first=state_v_first)
    check_grads(leaves, ref)
    assert len(forward_double.calls) == 1


def test_batch_rows_without_state_and_a_loss_on_o_only(forward_double):
    leaves, _, gen = make_leaves(2, batch=2, T=80, hqk=1, hv=2, h0=False, gate="strong")
    o, final = ops.chunk_gated_delta_rule(**leaves)
    assert final is None
    do = torch.randn(o.shape, generator=gen).bfloat16()
    (o.float() * do.float()).sum().backward()
    check_grads(leaves, oracle(leaves, None, do, None))


def test_the_final_states_gradient_alone_is_accepted(forward_double):
    """A loss on the final state only: o's gradient is zero and the state gradient still reaches
    every input through the reverse chain."""
    leaves, cu, gen = make_leaves(3, seqlens=[130, 1])
    o, final = ops.chunk_gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=cu)
    dht = torch.randn(final.shape, generator=gen)
    (final * dht).sum().backward()
    check_grads(leaves, oracle(leaves, cu, torch.zeros(o.shape), dht))
    assert torch.equal(leaves["q"].grad, torch.zeros_like(leaves["q"]))   # q reaches o only
    assert all(leaves[n].grad.abs().sum() > 0 for n in ("k", "v", "g", "beta", "initial_state"))


def test_only_the_inputs_that_require_grad_get_one(forward_double):
    leaves, cu, gen = make_leaves(4, seqlens=[64], h0=True)
    for name in ("q", "g", "initial_state"):
        leaves[name].requires_grad_(False)
    o, _ = ops.chunk_gated_delta_rule(**leaves, cu_seqlens=cu)
    o.float().sum().backward()
    assert leaves["q"].grad is None and leaves["g"].grad is None and leaves["initial_state"].grad is None
    assert leaves["k"].grad is not None and leaves["beta"].grad is not None


def test_double_backward_raises_naming_it(forward_double):
    leaves, cu, _ = make_leaves(5, seqlens=[64])
    o, _ = ops.chunk_gated_delta_rule(**leaves, cu_seqlens=cu)
    dq, = torch.autograd.grad(o.float().square().sum(), leaves["q"], create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward") as info:
        dq.float().sum().backward()
    assert str(info.value) == DOUBLE_BACKWARD_ERROR and "flashqla_tune::gdn_fwd" in DOUBLE_BACKWARD_ERROR


def test_no_grad_calls_skip_the_custom_op(forward_double, monkeypatch):
    """The eager path without autograd still runs the implementation directly (no dispatch cost)."""
    leaves, cu, _ = make_leaves(6, seqlens=[10])
    monkeypatch.setattr(torch.ops.flashqla_tune, "gdn_fwd", lambda *a: pytest.fail("dispatched"))
    with torch.no_grad():
        o, _ = ops.chunk_gated_delta_rule(**leaves, cu_seqlens=cu)
    assert o.grad_fn is None and len(forward_double.calls) == 1


def test_torch_compile_traces_forward_and_backward_in_one_graph_each(forward_double):
    """fullgraph=True: no graph break in the forward; AOTAutograd traces the backward through the
    backward custom op's fake implementation, and the compiled gradients equal the eager ones."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return gm
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    leaves, cu, gen = make_leaves(7, seqlens=[100, 30])
    do = torch.randn(1, 130, 4, D, generator=gen)

    def step(q, k, v, g, beta, initial_state, cu):
        o, s = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                          cu_seqlens=cu)
        return (o.float() * do).sum() + s.square().sum()

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=backend)(*leaves.values(), cu).backward()
    compiled = {n: t.grad.clone() for n, t in leaves.items()}
    for t in leaves.values():
        t.grad = None
    step(*leaves.values(), cu).backward()
    for n, t in leaves.items():
        assert torch.equal(compiled[n], t.grad), n
    assert "flashqla_tune.gdn_fwd" in graphs["forward"].code
    assert "flashqla_tune.gdn_bwd" in graphs["backward"].code


def test_a_packs_op_is_differentiable(forward_double, tmp_path):
    pack = flashqla_tune.load(make_pack(tmp_path / "p"), gpu=None, open_library=FakeLibraryOpener())
    leaves, cu, gen = make_leaves(8, seqlens=[70, 10], hv=8)   # the pack's model: 2/8 heads
    o, final = pack.chunk_gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=cu,
                                           use_qk_l2norm_in_kernel=True, layer=1)
    do = torch.randn(o.shape, generator=gen).bfloat16()
    dht = torch.randn(final.shape, generator=gen)
    torch.autograd.backward((o, final), (do, dht))
    check_grads(leaves, oracle(leaves, cu, do, dht, use_qk_l2norm_in_kernel=True))
    (plan_name, warmup), = forward_double.calls
    assert warmup == pack.bound_call(leaves["q"], leaves["v"], False, 1).warmup   # the layer's table ran


def test_a_packs_op_applies_flas_in_kernel_options_differentiably(forward_double, tmp_path):
    """A pack's plans take precomputed gates: its op applies FLA's in-kernel options with the kernels'
    formulas in PyTorch first, so the result is the op's on those gates and autograd reaches A_log and
    dt_bias (dA_log = sum over tokens of dg * g, the gate being -exp(A_log) softplus(.))."""
    from flashqla_tune.oracle import apply_gate_options

    pack = flashqla_tune.load(make_pack(tmp_path / "p"), gpu=None, open_library=FakeLibraryOpener())
    leaves, cu, gen = make_leaves(9, seqlens=[70, 10], hv=8)
    A_log = torch.randn(8, generator=gen).requires_grad_(True)
    dt_bias = torch.randn(8, generator=gen).requires_grad_(True)
    o, _ = pack.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, use_gate_in_kernel=True, A_log=A_log,
                                       dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    do = torch.randn(o.shape, generator=gen).bfloat16()
    o.backward(do)
    g_t, beta_t = apply_gate_options(leaves["g"].detach(), leaves["beta"].detach(), A_log.detach(),
                                     dt_bias.detach(), True, True, True)
    pre = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    pre["g"], pre["beta"] = g_t.float().requires_grad_(True), beta_t.float().requires_grad_(True)
    o_pre, _ = pack.chunk_gated_delta_rule(**pre, cu_seqlens=cu)
    o_pre.backward(do)
    assert rel_l2(o.double(), o_pre.double()) < 1e-4   # fp32 gates against float64 ones rounded to fp32
    want = (pre["g"].grad.double() * g_t).sum((0, 1))
    assert rel_l2(A_log.grad.double(), want) < 1e-4 and dt_bias.grad is not None and leaves["g"].grad is not None


def FakeHopper(t):   # noqa: N802 - a test double for fla_backend.cuda_arch
    return (9, 0)


def test_the_fla_backend_takes_grad_calls(tmp_path):
    pack = flashqla_tune.load(make_pack(tmp_path / "p"), gpu=None, open_library=FakeLibraryOpener())
    q = torch.zeros(1, 6, 2, D, dtype=torch.bfloat16, requires_grad=True)
    v = torch.zeros(1, 6, 8, D, dtype=torch.bfloat16)
    g, beta = torch.zeros(1, 6, 8, requires_grad=True), torch.zeros(1, 6, 8)
    h0 = torch.zeros(1, 8, D, D, requires_grad=True)
    assert torch.is_grad_enabled()
    assert verify_call(pack, q, q.detach(), v, g, beta, initial_state=h0, device_arch=FakeHopper) == (True, None)


def test_the_backward_ops_fake_gives_contiguous_gradients_for_strided_inputs():
    # torch.compile allocates the backward's outputs from the fake: its strides must be the
    # implementation's (contiguous), also for a transposed q or initial state
    gen = torch.Generator().manual_seed(9)
    T, H, D = 70, 2, 16
    q = F.normalize(torch.randn(1, H, T, D, generator=gen), dim=-1).transpose(1, 2)
    k = F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
    v = torch.randn(1, T, H, D, generator=gen)
    g = gate_values("mixed", (1, T, H), gen)
    beta = torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(1, H, D, D, generator=gen).transpose(-1, -2)
    cu = torch.tensor([0, T])
    do, dht = torch.randn(1, T, H, D, generator=gen), torch.randn(1, H, D, D, generator=gen)
    args = (q, k, v, g, beta, cu, h0, do, dht, D ** -0.5, False, False, "", [8] * H, 1e-5, 0)
    torch.library.opcheck(torch.ops.flashqla_tune.gdn_bwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    real = torch.ops.flashqla_tune.gdn_bwd(*args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.flashqla_tune.gdn_bwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                 for a in args))
    for r, f in zip(real, fake):
        assert r.is_contiguous() and f.stride() == r.stride() and f.shape == r.shape


def test_the_backwards_grid_cache_stays_bounded():
    from flashqla_tune.backward import chunked_torch
    for n in range(chunked_torch.GRID_CACHE_SIZE + 20):
        chunked_torch.chunk_grid((0, n + 1, n + 70), "cpu")
    assert len(chunked_torch._GRIDS) == chunked_torch.GRID_CACHE_SIZE
    newest = (0, chunked_torch.GRID_CACHE_SIZE + 20, chunked_torch.GRID_CACHE_SIZE + 89)
    assert (newest, "cpu") in chunked_torch._GRIDS
