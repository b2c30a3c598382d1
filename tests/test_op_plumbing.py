"""The op's plumbing on the CPU: public wrapper -> torch.library custom op -> runtime -> the
launch struct a kernel library receives. A test double stands in for the library (it records
the FqtGdnFwdArgs instead of launching), so no GPU is needed; the GPU tests run the real one."""
from __future__ import annotations

import ctypes
import math

import pytest
import torch

from gdn_inputs import off_16_byte_boundary

from flashqla_tune import ops, runtime
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec


class RecordingLibraryDouble:
    """Test double for loader.KernelLibrary: records each launch's arguments."""

    def __init__(self):
        self.calls = []

    def workspace_bytes(self, total_tokens, num_seqs, max_segments=0):
        return 4096 + total_tokens + 65536 * max_segments

    def launch(self, args, stream):
        copy = type(args)()
        ctypes.pointer(copy)[0] = args
        # read the offsets now: like a kernel, the double sees them while the call holds them
        cu = ctypes.cast(args.cu_seqlens, ctypes.POINTER(ctypes.c_int64))
        self.calls.append((copy, stream, [cu[i] for i in range(args.num_seqs + 1)]))


LIBRARY = RecordingLibraryDouble()   # registered once: runtime keeps the first library of a plan
PLAN = default_plan(GDNSpec(2, 8, state_layout="vk"))
runtime.register_library(PLAN, LIBRARY)


@pytest.fixture
def recorded(monkeypatch):
    lib, plan = LIBRARY, PLAN
    lib.calls.clear()
    monkeypatch.setattr(runtime, "current_stream_handle", lambda device: 1234)
    monkeypatch.setattr(ops, "check_gpu", lambda device: None)      # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(ops, "check_inputs", ops.check_shapes_and_types)
    return lib, plan


def test_op_passes_packed_tensors_and_flags_to_the_library(recorded):
    lib, plan = recorded
    B, T = 2, 100
    q = torch.randn(B, T, 2, 128, dtype=torch.bfloat16)
    k = torch.randn(B, T, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(B, T, 8, 128, dtype=torch.bfloat16)
    g = torch.randn(B, T, 8, dtype=torch.bfloat16)        # bf16 gates are upcast
    beta = torch.rand(B, T, 8)
    h0 = torch.randn(B, 8, 128, 128)
    o, final = ops.run_checked(q, k, v, g, beta, None, h0, True, True, True, None, plan_name=plan.name)
    assert o.shape == (B, T, 8, 128) and o.dtype == torch.bfloat16
    assert final.shape == (B, 8, 128, 128) and final.dtype == torch.float32
    (args, stream, offsets), = lib.calls
    assert stream == 1234
    assert (args.total_tokens, args.num_seqs, args.use_qk_l2norm) == (B * T, B, 1)
    assert args.scale == pytest.approx(128 ** -0.5)
    assert args.q == q.data_ptr() and args.k == k.data_ptr() and args.v == v.data_ptr()
    assert args.initial_state == h0.data_ptr() and args.final_state == final.data_ptr()
    assert args.o == o.data_ptr() and args.workspace and args.g != g.data_ptr()  # g went through fp32
    assert offsets == [0, T, 2 * T]     # batch rows packed as varlen


def test_no_final_state_and_no_initial_state(recorded):
    lib, plan = recorded
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, 64, 8, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, 64, 8)
    o, final = ops.run_checked(q, q, v, g, g, 0.5, None, False, False, True, torch.tensor([0, 64]),
                               plan_name=plan.name)
    assert final is None
    (args, _, offsets), = lib.calls
    assert offsets == [0, 64]
    assert args.initial_state is None and args.final_state is None and args.scale == 0.5


def test_q_k_v_off_a_16_byte_boundary_reach_the_library_as_aligned_copies(recorded):
    """TMA needs q, k and v on 16-byte boundaries: a contiguous view one element past one is
    copied (same values) instead of handing the driver an address it refuses."""
    lib, plan = recorded
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    k = off_16_byte_boundary(torch.randn_like(q))
    v = torch.randn(1, 64, 8, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, 64, 8)
    assert k.is_contiguous() and k.data_ptr() % 16 != 0
    ops.run_checked(q, k, v, g, g, None, None, False, False, True, torch.tensor([0, 64]), plan_name=plan.name)
    (args, _, _), = lib.calls
    assert args.q == q.data_ptr() and args.v == v.data_ptr()   # aligned ones are passed as they are
    assert args.k != k.data_ptr() and args.k % 16 == 0
    moved = runtime.tma_ready(k)
    assert moved.data_ptr() % 16 == 0 and torch.equal(moved, k)
    assert runtime.tma_ready(q) is q


def test_unknown_plan_name_is_a_clear_error(recorded):
    q = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, 8, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(KeyError, match="plan nope is not loaded from any pack"):
        ops.run_checked(q, q, v, torch.zeros(1, 8, 8), torch.zeros(1, 8, 8), None, None, False, False, False,
                        None, plan_name="nope")


def test_fake_tensors_take_the_custom_op_and_eager_calls_skip_its_dispatch(recorded, monkeypatch):
    """Under fake tensors (as torch.compile traces) the registered op and its fake implementation
    answer, and no library is launched; eager calls go to the implementation directly."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lib, plan = recorded
    with FakeTensorMode():
        q = torch.empty(1, 130, 2, 128, dtype=torch.bfloat16)
        v = torch.empty(1, 130, 8, 128, dtype=torch.bfloat16)
        g, beta = torch.empty(1, 130, 8), torch.empty(1, 130, 8)
        cu = torch.tensor([0, 30, 130])
        assert ops.needs_custom_op(q)
        o, final = ops.run_checked(q, q, v, g, beta, None, None, True, False, True, cu, plan_name=plan.name)
        assert o.shape == (1, 130, 8, 128) and final.shape == (2, 8, 128, 128)
    assert lib.calls == []

    dispatched = []
    monkeypatch.setattr(torch.ops.flashqla_tune, "gdn_fwd", lambda *a: dispatched.append(a))
    q = torch.randn(1, 130, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, 130, 8, 128, dtype=torch.bfloat16)
    assert not ops.needs_custom_op(q)
    ops.run_checked(q, q, v, torch.randn(1, 130, 8), torch.rand(1, 130, 8), None, None, False, False, True,
                    torch.tensor([0, 130]), plan_name=plan.name)
    assert dispatched == [] and len(lib.calls) == 1


def test_prep_schedule_reaches_the_library_and_bad_names_are_refused(recorded):
    lib, plan = recorded
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, 64, 8, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, 64, 8)
    cu = torch.tensor([0, 64])
    for name, code in (("auto", 0), ("serial", 1), ("overlap", 2)):
        runtime.forward(plan, q, q, v, g, g, cu, None, 1.0, False, False, prep_schedule=name)
        assert lib.calls[-1][0].prep_schedule == code
    with pytest.raises(ValueError, match="prep_schedule='sideways' must be one of"):
        runtime.forward(plan, q, q, v, g, g, cu, None, 1.0, False, False, prep_schedule="sideways")


def test_warmup_table_reaches_the_library_with_a_segment_bound(recorded, monkeypatch):
    """ops.chunk_gated_delta_rule(..., warmup=...) checks the table and passes the kernels its device
    copy, the segment table, the segment bound (which also sizes the workspace) and log(eps)."""
    from flashqla_tune import warmup_tables

    lib, plan = recorded
    monkeypatch.setattr(warmup_tables, "sm_count", lambda device: 132)
    monkeypatch.setattr(runtime, "default_plan_for", lambda spec: plan)
    T = 8192
    q = torch.randn(1, T, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, T, 8, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, T, 8)
    table = [3, 3, 3, 3, -1, 3, 3, 3]
    ops.chunk_gated_delta_rule(q, q, v, g, g, state_v_first=True, cu_seqlens=torch.tensor([0, T]), warmup=table,
                               warmup_eps=1e-4)
    args = lib.calls[-1][0]
    tables = warmup_tables.tables_for(tuple(table), plan, q.device, 1e-4)
    assert args.warmup == tables.warmup.data_ptr() and args.segment_chunks == tables.segment_chunks.data_ptr()
    assert args.max_segments == warmup_tables.max_segments(tables.lengths, T, 1) > 1
    assert args.log_eps == pytest.approx(math.log(1e-4))
    assert args.exact_heads == tables.exact_heads == 1  # the table's one -1 sizes the chain's column slices
    # without a table: the default window on every head, guarded like any other
    ops.chunk_gated_delta_rule(q, q, v, g, g, state_v_first=True, cu_seqlens=torch.tensor([0, T]))
    args = lib.calls[-1][0]
    default = warmup_tables.tables_for(warmup_tables.default_table(8), plan, q.device, warmup_tables.DEFAULT_EPS)
    assert args.warmup == default.warmup.data_ptr() and default.warmup.tolist() == [8] * 8
    assert args.max_segments == warmup_tables.max_segments(default.lengths, T, 1) > 1 and args.exact_heads == 0
    # a call whose sequences are all too short to split runs no CP kernel at all
    ops.chunk_gated_delta_rule(q[:, :2048], q[:, :2048], v[:, :2048], g[:, :2048], g[:, :2048], state_v_first=True,
                               cu_seqlens=torch.tensor([0, 1024, 2048]))
    args = lib.calls[-1][0]
    assert args.warmup is None and args.segment_chunks is None and args.max_segments == 0 and args.exact_heads == 0
    # eight 1024-token sequences: ceil(T / 64) = 128 chunks could split, so without the host's
    # copy of cu_seqlens the CP kernels run (and find nothing to split); with it they are skipped
    cu8 = torch.arange(0, T + 1, 1024)
    ops.chunk_gated_delta_rule(q, q, v, g, g, state_v_first=True, cu_seqlens=cu8)
    assert lib.calls[-1][0].max_segments == warmup_tables.max_segments(default.lengths, T, 8) > 8
    ops.chunk_gated_delta_rule(q, q, v, g, g, state_v_first=True, cu_seqlens=cu8, cu_seqlens_cpu=cu8.clone())
    assert lib.calls[-1][0].max_segments == 0 and lib.calls[-1][0].warmup is None
    # a host copy that understates the lengths only costs speed: the call runs one exact chain
    # per sequence (no CP kernels, no CP workspace), which is right for any lengths
    ops.chunk_gated_delta_rule(q, q, v, g, g, state_v_first=True, cu_seqlens=torch.tensor([0, T]),
                               cu_seqlens_cpu=torch.tensor([0, 1024]))
    assert lib.calls[-1][0].max_segments == 0 and lib.calls[-1][0].warmup is None
    # one long sequence among short ones: the bound still comes from T, not from the host's copy
    cu_mixed = torch.tensor([0, 1024, T])
    ops.chunk_gated_delta_rule(q, q, v, g, g, state_v_first=True, cu_seqlens=cu_mixed, cu_seqlens_cpu=cu_mixed)
    assert lib.calls[-1][0].max_segments == warmup_tables.max_segments(default.lengths, T, 2) > 2
    # the single chain (the benchmark's no-CP column): run_checked without a table
    ops.run_checked(q, q, v, g, g, None, None, False, False, True, torch.tensor([0, T]), plan_name="")
    assert lib.calls[-1][0].warmup is None and lib.calls[-1][0].max_segments == 0
    with pytest.raises(warmup_tables.WarmupError, match="warmup has 2 entries; the call has Hv=8"):
        ops.chunk_gated_delta_rule(q, q, v, g, g, state_v_first=True, cu_seqlens=torch.tensor([0, T]), warmup=[1, 1])


def test_a_registered_segment_table_overrides_the_cost_model(recorded, monkeypatch):
    """A pack's plan registered with a segment table: calls under that name split by it."""
    from flashqla_tune import warmup_tables

    lib, plan = recorded
    monkeypatch.setattr(warmup_tables, "sm_count", lambda device: 132)
    override = (0,) * 7 + (32,) * 25
    name = runtime.register_library(plan, lib, f"{plan.name}@cp-test", override)
    T = 8192
    q = torch.randn(1, T, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, T, 8, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, T, 8)
    table = [3] * 8
    ops.run_checked(q, q, v, g, g, None, None, False, False, True, torch.tensor([0, T]), plan_name=name,
                    warmup=table)
    args = lib.calls[-1][0]
    tables = warmup_tables.tables_for(tuple(table), plan, q.device, warmup_tables.DEFAULT_EPS, override)
    assert tables.lengths == override and args.segment_chunks == tables.segment_chunks.data_ptr()
    # the bound for one sequence of at most ceil(T / 64) = 128 chunks in segments of 32: 4
    assert args.max_segments == warmup_tables.max_segments(override, T, 1) == 4
    with pytest.raises(ValueError, match="a segment table has 32 non-negative ints"):
        runtime.register_library(plan, lib, "bad", (1, 2))


def test_the_op_binds_its_table_and_eps_and_the_custom_op_rebinds_them_by_name(recorded, monkeypatch):
    """ops.chunk_gated_delta_rule checks its arguments into a BoundCall and calls it; the custom op's
    implementation rebuilds the same binding from the plan name, table and eps it is handed."""
    lib, plan = recorded
    bf16 = torch.bfloat16
    spec = ops.call_spec(torch.empty(1, 1, 2, 128, dtype=bf16), torch.empty(1, 1, 8, 128, dtype=bf16), True)
    bound = ops.BoundCall(spec, "", (3,) * 8, 1e-4)
    assert bound.plan == plan and bound.segment_lengths is None
    seen = []
    monkeypatch.setattr(ops, "run_checked", lambda *args, **kw: seen.append(kw))
    T = 64
    q = torch.randn(1, T, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, T, 8, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, T, 8)
    ops.chunk_gated_delta_rule(q, q, v, g, g, state_v_first=True, warmup=torch.tensor([3] * 8), warmup_eps=1e-4)
    assert seen == [dict(plan_name="", warmup=[3] * 8, warmup_eps=1e-4, longest_tokens=T, sequence_tokens=T)]
    monkeypatch.undo()

    name = runtime.register_library(plan, lib, f"{plan.name}@cp-bound", (0,) * 7 + (32,) * 25)
    named = ops.BoundCall(bound.spec, name, (3,) * 8, 1e-4)
    assert named.plan == plan and named.segment_lengths == (0,) * 7 + (32,) * 25
    with pytest.raises(KeyError, match="plan nope is not loaded from any pack"):
        ops.BoundCall(bound.spec, "nope", None, 1e-4).plan


def test_only_the_packless_op_may_start_the_host_path_build(recorded, monkeypatch):
    """A pack's calls (a registered plan name) never compile the C++ host path, even where the
    pack-less op uses the same plan and library: the binding, not the library, says whose call it is."""
    from flashqla_tune import host_path, warmup_tables

    lib, plan = recorded
    seen = []
    monkeypatch.setattr(host_path, "known", lambda key: False)
    monkeypatch.setattr(host_path, "remember", lambda *args, **kw: seen.append(kw["may_build"]))
    monkeypatch.setattr(warmup_tables, "tables_for", lambda *args, **kw: "tables")
    bf16 = torch.bfloat16
    spec = ops.call_spec(torch.empty(1, 1, 2, 128, dtype=bf16), torch.empty(1, 1, 8, 128, dtype=bf16), True)
    name = runtime.register_library(plan, lib, f"{plan.name}@may-build")
    ops.BoundCall(spec, "", (3,) * 8, 1e-4).remember_host_context(("packless",), torch.device("cpu"))
    ops.BoundCall(spec, name, (3,) * 8, 1e-4).remember_host_context(("pack",), torch.device("cpu"))
    assert seen == [True, False]


def test_a_packs_call_is_bound_once_per_signature_and_reaches_the_library(recorded, monkeypatch, tmp_path):
    """A pack's op builds its BoundCall (plan for the heads, the layer's table, the calibration's
    eps) on the first call of a signature and reuses it; refusals are raised again, never kept."""
    import sys
    from pathlib import Path

    import flashqla_tune
    from flashqla_tune import warmup_tables

    sys.path.insert(0, str(Path(__file__).parent))
    from pack_doubles import make_pack

    lib, _ = recorded
    monkeypatch.setattr(runtime, "_libraries", {})   # the pack's plans get this test's double
    monkeypatch.setattr(warmup_tables, "sm_count", lambda device: 132)
    pack = flashqla_tune.load(make_pack(tmp_path / "p"), gpu=None, open_library=lambda so, plan: lib)
    T = 8192
    q = torch.randn(1, T, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, T, 8, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, T, 8)
    bound = pack.bound_call(q, v, False, layer=1)
    assert pack.bound_call(q, v, False, layer=1) is bound
    assert bound.warmup == tuple(pack.warmup_table(1).tolist()) and bound.warmup_eps == pack.warmup_eps
    assert bound.plan == pack.plan_for(q, v, False) and bound.plan_name == pack.registered[bound.plan.name]
    assert pack.bound_call(q, v, False) is not bound   # the model-wide table is another signature
    pack.chunk_gated_delta_rule(q, q, v, g, g, layer=1)
    args = lib.calls[-1][0]
    tables = warmup_tables.tables_for(bound.warmup, bound.plan, q.device, pack.warmup_eps)
    assert args.warmup == tables.warmup.data_ptr() and args.log_eps == pytest.approx(math.log(pack.warmup_eps))
    for _ in range(2):
        with pytest.raises(ValueError, match="layer=7: the pack's model has GDN layers 0..2"):
            pack.bound_call(q, v, False, layer=7)
        with pytest.raises(ops.UnsupportedError, match="has no kernel for this call's"):
            pack.bound_call(q, v, True, layer=1)
    assert len(pack._bound_calls) == 2


def test_torch_compile_traces_the_op_in_one_graph(recorded, monkeypatch):
    """torch.compile(fullgraph=True) traces the op's Python path (checks, binding, custom op) without
    a graph break; the compiled call launches the library like an eager one."""
    from flashqla_tune import warmup_tables

    lib, plan = recorded
    monkeypatch.setattr(warmup_tables, "sm_count", lambda device: 132)
    T = 8192
    q = torch.randn(1, T, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, T, 8, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, T, 8)
    cu = torch.tensor([0, T])

    def step(q, k, v, g, beta, cu):
        o, s = ops.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, state_v_first=True,
                                          cu_seqlens=cu, chunk_size=64)
        return o.float().sum() + s.sum()

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(step, fullgraph=True, backend="eager")(q, q, v, g, g, cu)
    compiled = lib.calls[-1][0]
    ops.chunk_gated_delta_rule(q, q, v, g, g, output_final_state=True, state_v_first=True, cu_seqlens=cu)
    eager = lib.calls[-1][0]
    assert len(lib.calls) == 2
    assert (compiled.warmup, compiled.segment_chunks, compiled.max_segments) == \
        (eager.warmup, eager.segment_chunks, eager.max_segments) and eager.max_segments > 1


class HostPathDouble:
    """Test double for host_path.forward: records each call it is asked to take and takes none."""

    def __init__(self):
        self.asked = []

    def __call__(self, key, *args):
        self.asked.append(args)
        return None


@pytest.fixture
def op_calls(monkeypatch):
    """ops.chunk_gated_delta_rule on CPU tensors up to run_checked, which records its arguments
    instead of packing and launching; host_path.forward is a HostPathDouble."""
    seen, asked = [], HostPathDouble()
    monkeypatch.setattr(ops, "check_inputs", ops.check_shapes_and_types)
    monkeypatch.setattr(ops, "run_checked", lambda *args, **kw: seen.append((args, kw)) or ("o", "final"))
    monkeypatch.setattr(ops.host_path, "forward", asked)
    return seen, asked


def _op_inputs(T=64):
    q = torch.randn(1, T, 2, 128, dtype=torch.bfloat16)
    return q, q.clone(), torch.randn(1, T, 8, 128, dtype=torch.bfloat16), torch.zeros(1, T, 8), torch.rand(1, T, 8)


def test_a_positional_call_in_flas_order_reaches_its_parameters(op_calls):
    from flashqla_tune import warmup_tables

    seen, asked = op_calls
    q, k, v, g, beta = _op_inputs()
    h0 = torch.zeros(2, 8, 128, 128)
    cu, cu_cpu, indices = torch.tensor([0, 24, 64]), torch.tensor([0, 24, 64]), torch.zeros(2, 2, dtype=torch.int64)
    assert ops.chunk_gated_delta_rule(q, k, v, g, beta, 0.25, h0, True, True, False, False, True, cu, cu_cpu,
                                      indices, None) == ("o", "final")
    (args, kw), = seen
    assert args[:5] == (q, k, v, g, beta) and args[5] == 0.25 and args[6] is h0
    assert args[7:10] == (True, True, True)            # output_final_state, use_qk_l2norm, state_v_first
    assert args[10] is cu and kw["longest_tokens"] == 40  # cu_seqlens_cpu's longest sequence
    assert kw["warmup"] == list(warmup_tables.default_table(8))
    assert len(asked.asked) == 1 and asked.asked[0][9] is cu and asked.asked[0][10] is cu_cpu


def test_a_call_in_the_old_positional_order_is_refused_naming_the_order(op_calls):
    """(..., use_qk_l2norm, state_v_first, cu_seqlens) puts cu_seqlens into allow_neg_eigval: a
    TypeError that names the argument and FLA's order, not a tensor's ambiguous truth value."""
    seen, asked = op_calls
    with pytest.raises(TypeError, match=r"allow_neg_eigval must be a bool, got Tensor; the positional order is FLA's"):
        ops.chunk_gated_delta_rule(*_op_inputs(), None, None, False, False, False, torch.tensor([0, 64]))
    assert seen == [] and asked.asked == []


def test_chunk_size_64_is_taken_and_any_other_is_refused_by_name(op_calls):
    seen, asked = op_calls
    x = _op_inputs()
    ops.chunk_gated_delta_rule(*x, chunk_size=64, use_gate_in_kernel=False, A_log=None, dt_bias=None)
    assert len(seen) == 1
    for size in (32, 16, 128, "64", True):
        with pytest.raises(ops.UnsupportedError, match=rf"chunk_size={size!r} is not supported"):
            ops.chunk_gated_delta_rule(*x, chunk_size=size)
    assert len(seen) == 1 and len(asked.asked) == 1


@pytest.mark.parametrize("option, error, match", [
    (dict(allow_neg_eigval=True), ops.UnsupportedError, "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel"),
    (dict(cp_context=object()), ops.UnsupportedError, "cp_context=object is not supported"),
    (dict(use_gate_in_kernel=True), ValueError, "use_gate_in_kernel=True needs A_log"),
    (dict(use_gate_in_kernel=1, A_log=torch.zeros(8)), TypeError, "use_gate_in_kernel must be a bool, got int"),
    (dict(A_log=torch.zeros(8)), ops.UnsupportedError, "A_log .* was given with use_gate_in_kernel=False"),
    (dict(dt_bias=torch.zeros(8)), ops.UnsupportedError, "dt_bias .* was given with use_gate_in_kernel=False"),
    (dict(chunk_indices=[[0, 0]]), TypeError, "chunk_indices must be None or FLA's"),
    (dict(chunk_indices=torch.zeros(3)), ValueError, r"chunk_indices shape \(3,\)"),
    (dict(head_first=False), TypeError, "unexpected keyword argument 'head_first'"),
    (dict(transpose_state_layout=True), TypeError, "'transpose_state_layout' .*pass state_v_first"),
    (dict(warmup_eps=1e-4, chunk_sise=64), TypeError, "unexpected keyword argument 'chunk_sise'"),
])
def test_options_the_kernels_cannot_honour_are_refused_by_name_before_any_work(op_calls, option, error, match):
    seen, asked = op_calls
    with pytest.raises(error, match=match):
        ops.chunk_gated_delta_rule(*_op_inputs(), **option)
    assert seen == [] and asked.asked == []      # neither the C++ path nor the Python path was asked


def test_a_refused_option_is_refused_where_the_host_path_would_take_the_call(op_calls, monkeypatch):
    """The fast path's check: a signature the C++ path knows still refuses an option by name,
    and the common call with no options (or only honoured ones) is still handed to it."""
    seen, _ = op_calls
    taken = []
    monkeypatch.setattr(ops, "host_key", lambda *a: "known signature")
    monkeypatch.setattr(ops.host_path, "forward", lambda key, *a: taken.append(key) or ("fast o", None))
    x = _op_inputs()
    assert ops.chunk_gated_delta_rule(*x) == ("fast o", None)
    assert ops.chunk_gated_delta_rule(*x, chunk_size=64, chunk_indices=torch.zeros(1, 2)) == ("fast o", None)
    with pytest.raises(ops.UnsupportedError, match="allow_neg_eigval=True"):
        ops.chunk_gated_delta_rule(*x, allow_neg_eigval=True)
    with pytest.raises(TypeError, match="'warmup_eps_'"):
        ops.chunk_gated_delta_rule(*x, warmup_eps_=1e-4)
    assert taken == ["known signature"] * 2 and seen == []


def test_warmup_and_warmup_eps_are_keyword_only(op_calls):
    seen, _ = op_calls
    x = _op_inputs()
    fla_defaults = (None, None, False, False, False, False, False, None, None, None, None)
    with pytest.raises(TypeError, match="positional argument"):
        ops.chunk_gated_delta_rule(*x, *fla_defaults, [3] * 8)
    ops.chunk_gated_delta_rule(*x, *fla_defaults, warmup=[3] * 8, warmup_eps=1e-4)
    assert seen[-1][1]["warmup"] == [3] * 8 and seen[-1][1]["warmup_eps"] == 1e-4
