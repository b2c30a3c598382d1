"""The Hopper forward against the float64 oracle on the H200 (DESIGN.md, "Verification").

Bar per case, for o and the final state each, over three fresh random draws:
rel L2 <= max(2 x FLA's error on the same inputs, 2e-3) and < 1e-2. Outputs are poisoned
with NaN first, so an element the kernel never writes fails.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from gdn_inputs import gate_values, off_16_byte_boundary, rel_l2  # noqa: E402

from flashqla_tune import host_path, ops, runtime  # noqa: E402
from flashqla_tune.oracle import chunk_gated_delta_rule_chunked  # noqa: E402
from flashqla_tune.plan import KernelPlan, TileParams  # noqa: E402

DEV = "cuda"
LOG = []


def fla_forward():
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # FLA is optional: the bar then falls back to its absolute part
        return None
    return chunk_gated_delta_rule


def make_case(seed, seqlens, hqk, hv, dtype, decay, h0, layout_vk, normalised=True, batch=None, k_scale=1.0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(seqlens) if batch is None else seqlens[0]
    B = 1 if batch is None else batch
    q = torch.randn(B, T, hqk, 128, generator=gen, device=DEV)
    k = torch.randn(B, T, hqk, 128, generator=gen, device=DEV)
    if normalised:
        q, k = F.normalize(q, dim=-1), k_scale * F.normalize(k, dim=-1)
    v = torch.randn(B, T, hv, 128, generator=gen, device=DEV)
    g = gate_values(decay, (B, T, hv), gen, torch.float32)
    beta = torch.rand(B, T, hv, generator=gen, device=DEV)
    cu = None
    if batch is None:
        cu = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0).tolist()), device=DEV, dtype=torch.int64)
    n = B if cu is None else len(seqlens)
    state = None
    if h0:
        state = torch.randn((n, hv, 128, 128), generator=gen, device=DEV)
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta, initial_state=state,
                cu_seqlens=cu, state_v_first=layout_vk)


def variant_plan(hqk, hv, tiles):
    return KernelPlan(ops._spec(hqk, hv, 128, 128, True, False), tiles)


# One, four, two, three and eight v-heads per q/k head: 256 threads solve up to four at once on the
# tensor cores and eight (two head batches) a column per thread.
PREP_VARIANT_HEADS = [(16, 16), (2, 8), (4, 8), (16, 48), (2, 16)]
# Plans the tuner may pick besides the default (its search space and known-good list).
TILE_VARIANTS = [TileParams(output_group=1, stages=2), TileParams(block_v=128, stages=2), TileParams(stages=2),
                 TileParams(stages=1, producer_regs=24, ctas_per_sm=2)]


def run_ours(inp, l2norm, prep_schedule="auto", plan=None, warmup=None, segment_lengths=None,
             gate_options=ops.NO_GATE_OPTIONS, a_log=None, dt_bias=None):
    """Through the public op's plan (or `plan`), into NaN-poisoned buffers; warmup (a per-v-head
    table) turns on context parallelism, segment_lengths forces its segment table; gate_options
    (ops.gate_options_of's) pick the default plan built with FLA's in-kernel options, whose gate
    parameters a_log and dt_bias are."""
    q, v = inp["q"], inp["v"]
    B, T = q.shape[:2]
    plan = plan or runtime.default_plan_for(ops.call_spec(q, v, inp["state_v_first"], gate_options))
    cu = inp["cu_seqlens"]
    if cu is None:
        cu = torch.arange(0, (B + 1) * T, T, device=DEV, dtype=torch.int64)
    N = cu.numel() - 1
    o_buf = torch.full((1, B * T) + tuple(v.shape[2:]), float("nan"), dtype=v.dtype, device=DEV)
    f_buf = torch.full((N, v.shape[2], 128, 128), float("nan"), device=DEV)
    h0 = inp["initial_state"]
    if h0 is not None and inp["state_v_first"]:
        h0 = h0.transpose(-1, -2).contiguous()
    o, final = runtime.forward(plan, q.reshape(1, B * T, *q.shape[2:]), inp["k"].reshape(1, B * T, *q.shape[2:]),
                               v.reshape(1, B * T, *v.shape[2:]), inp["g"].reshape(1, B * T, -1),
                               inp["beta"].reshape(1, B * T, -1), cu, h0, 128 ** -0.5, True, l2norm,
                               out=o_buf, final_out=f_buf, prep_schedule=prep_schedule,
                               warmup=None if warmup is None else tuple(warmup), segment_lengths=segment_lengths,
                               a_log=a_log, dt_bias=dt_bias)
    if inp["state_v_first"]:
        final = final.transpose(-1, -2)
    return o.reshape(v.shape), final


def reference(inp, l2norm):
    h0 = inp["initial_state"]
    return chunk_gated_delta_rule_chunked(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                          initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=l2norm, cu_seqlens=inp["cu_seqlens"])


def accuracy_bars(fla):
    """DESIGN.md's bar for o and the state: max(2 x FLA's error, 2e-3), below 1e-2 (1e-2 without FLA)."""
    if fla is None:
        return 1e-2, 1e-2
    return tuple(min(max(2 * err, 2e-3), 1e-2) for err in fla)


def assert_written_and_equal(a, b):
    """Both results (o, state) have every element written (no NaN) and are bitwise equal."""
    for t in (*a, *b):
        assert not torch.isnan(t).any()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def captured(call, warmups=1):
    """call() run `warmups` times on a side stream (plans built, host paths settled), then captured in
    a CUDA graph: (the graph, what the captured call returned)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def assert_replay_on_new_inputs_equals_eager(call, inp, fresh,
                                            names=("q", "k", "v", "g", "beta", "initial_state")):
    """call() (reading the tensors of inp) warmed up on a side stream, captured in a CUDA graph;
    then inp's tensors `names` take fresh's values in place and the replay must equal an eager call
    bitwise."""
    with torch.no_grad():
        graph, (o_g, s_g) = captured(call)
        for name in names:
            inp[name].copy_(fresh[name])
        graph.replay()
        o_e, s_e = call()
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_e) and torch.equal(s_g, s_e)


def fla_errors(inp, l2norm, ref_o, ref_s):
    fla = fla_forward()
    if fla is None:
        return None
    h0 = inp["initial_state"]
    with torch.no_grad():
        o, s = fla(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=128 ** -0.5, initial_state=h0,
                   output_final_state=True, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=inp["cu_seqlens"])
    return rel_l2(o, ref_o), rel_l2(s, ref_s)


LONG_AND_SHORT = [1, 17, 63, 64, 65, 127, 300, 4100, 5, 0, 129]

CASES = {
    # name: (seqlens, hqk, hv, dtype, decay, h0, layout_vk, l2norm, normalised, batch)
    "gva_varlen_bf16_mixed": (LONG_AND_SHORT, 2, 8, torch.bfloat16, "mixed", True, False, False, True, None),
    "gva_varlen_fp16_mixed": (LONG_AND_SHORT, 2, 8, torch.float16, "mixed", True, False, False, True, None),
    "state_v_first": ([1000, 2049], 2, 8, torch.bfloat16, "mixed", True, True, False, True, None),
    "l2norm_in_kernel": ([777, 1500], 4, 16, torch.bfloat16, "mixed", True, False, True, False, None),
    "strong_decay": ([3000], 2, 8, torch.bfloat16, "strong", True, False, False, True, None),
    "weak_decay": ([3000], 2, 8, torch.bfloat16, "weak", True, False, False, True, None),
    "zero_decay": ([2000], 2, 8, torch.bfloat16, "zero", False, False, False, True, None),
    "no_gva_no_h0": ([513, 64], 4, 4, torch.bfloat16, "mixed", False, False, False, True, None),
    "group3_hv48": ([600], 16, 48, torch.bfloat16, "mixed", True, False, False, True, None),
    # two v-heads per q/k head: the default 128-thread prep solves them in turn on the tensor cores
    "gqa2_varlen": (LONG_AND_SHORT, 4, 8, torch.bfloat16, "mixed", True, False, False, True, None),
    "batch2_dense": ([300], 2, 8, torch.float16, "mixed", True, False, False, True, 2),
}


@pytest.fixture(scope="module", autouse=True)
def built_plans():
    """Every plan this module runs, built in one parallel ninja run instead of one at a time."""
    from flashqla_tune.cache import get_kernels

    specs = {ops._spec(hqk, hv, 128, 128, dtype == torch.bfloat16, vk)
             for _, hqk, hv, dtype, _, _, vk, _, _, _ in CASES.values()}
    specs |= {ops._spec(hqk, hv, 128, 128, dtype == torch.bfloat16, vk)
              for _, hqk, hv, dtype, _, _, vk, _, _, _, _ in CP_CASES.values()}
    plans = [runtime.default_plan_for(spec) for spec in sorted(specs, key=str)]
    get_kernels(plans + [variant_plan(hqk, hv, TileParams(prep_threads=threads))
                         for hqk, hv in PREP_VARIANT_HEADS for threads in (128, 256)]
                + [variant_plan(2, 8, tiles) for tiles in TILE_VARIANTS])


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_float64_oracle(name):
    seqlens, hqk, hv, dtype, decay, h0, vk, l2norm, normalised, batch = CASES[name]
    for seed in range(3):
        inp = make_case(1000 * seed + 7, seqlens, hqk, hv, dtype, decay, h0, vk, normalised, batch)
        with torch.no_grad():
            o, s = run_ours(inp, l2norm)
        torch.cuda.synchronize()
        ref_o, ref_s = reference(inp, l2norm)
        assert not torch.isnan(o).any(), f"{name}: unwritten (NaN) output elements"
        assert not torch.isnan(s).any(), f"{name}: unwritten (NaN) final-state elements"
        err_o, err_s = rel_l2(o, ref_o), rel_l2(s, ref_s)
        fla = fla_errors(inp, l2norm, ref_o, ref_s)
        bar_o, bar_s = accuracy_bars(fla)
        line = (f"{name:24s} seed={seed} o={err_o:.2e} (bar {bar_o:.2e}) state={err_s:.2e} (bar {bar_s:.2e})"
                + (f" fla_o={fla[0]:.2e} fla_state={fla[1]:.2e}" if fla else " fla=absent"))
        print(line)
        LOG.append(line)
        assert err_o <= bar_o and err_s <= bar_s, line


def test_public_op_graph_capture_and_dense_batch():
    inp = make_case(3, [700, 300], 2, 8, torch.bfloat16, "mixed", True, False)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    kw = dict(initial_state=inp["initial_state"], output_final_state=True, cu_seqlens=inp["cu_seqlens"])
    with torch.no_grad():
        o_eager, s_eager = ops.chunk_gated_delta_rule(*args, **kw)
        graph, (o_g, s_g) = captured(lambda: ops.chunk_gated_delta_rule(*args, **kw))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_eager) and torch.equal(s_g, s_eager)


HOST_PATH_CASES = {
    # 2/8 varlen with a calibrated-style table and host offsets: the C++ path plans CP itself
    "varlen_cp_table": (dict(seqlens=[5000, 37, 2100], hqk=2, hv=8, h0=True, layout_vk=False),
                        dict(warmup=[8, -1, 4, 8, 2, -1, 8, 8], host_offsets=True, final=True)),
    # batch rows (device offsets made by the C++ path), the [N, Hv, V, K] state layout, default window
    "batch_rows_vk": (dict(seqlens=[700], hqk=16, hv=16, h0=True, layout_vk=True, batch=2),
                      dict(warmup=None, host_offsets=False, final=True)),
    # int32 offsets (converted), in-kernel L2 norm, an explicit scale, no states
    "int32_l2norm_no_state": (dict(seqlens=[300, 64, 1000], hqk=4, hv=16, h0=False, layout_vk=False),
                              dict(warmup=None, host_offsets=False, final=False, int32=True, l2norm=True, scale=0.1)),
}


@pytest.mark.parametrize("name", list(HOST_PATH_CASES))
def test_cpp_host_path_agrees_bitwise_with_the_python_path(name, monkeypatch):
    """The C++ host path launches what the Python path launches: the same outputs, bit for bit, and
    the second call of a signature does take it."""
    shape, opts = HOST_PATH_CASES[name]
    inp = make_case(21, shape["seqlens"], shape["hqk"], shape["hv"], torch.bfloat16, "mixed", shape["h0"],
                    shape["layout_vk"], normalised=not opts.get("l2norm"), batch=shape.get("batch"))
    cu = inp["cu_seqlens"]
    if cu is not None and opts.get("int32"):
        cu = cu.to(torch.int32)
    kw = dict(initial_state=inp["initial_state"], output_final_state=opts["final"], cu_seqlens=cu,
              cu_seqlens_cpu=cu.cpu() if opts["host_offsets"] else None, state_v_first=inp["state_v_first"],
              warmup=opts["warmup"], use_qk_l2norm_in_kernel=opts.get("l2norm", False), scale=opts.get("scale"))
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    host_path.extension()  # built in the background otherwise: wait for it here
    with torch.no_grad():
        monkeypatch.setenv(host_path.ENV_SWITCH, "python")
        o_py, s_py = ops.chunk_gated_delta_rule(*args, **kw)
        monkeypatch.delenv(host_path.ENV_SWITCH)
        ops.chunk_gated_delta_rule(*args, **kw)  # the Python path, which keeps the signature's context
        taken = host_path.taken
        o_cpp, s_cpp = ops.chunk_gated_delta_rule(*args, **kw)
    torch.cuda.synchronize()
    assert host_path.taken == taken + 1, "the second call of the signature did not take the C++ path"
    assert torch.equal(o_cpp, o_py) and o_cpp.shape == o_py.shape
    assert (s_cpp is None and s_py is None) if not opts["final"] else torch.equal(s_cpp, s_py)


def test_q_k_v_off_a_16_byte_boundary_give_what_aligned_ones_give():
    """q, k and v as contiguous views one element past a 16-byte boundary, whose address TMA
    refuses: the C++ host path, live for the signature, hands such calls to the Python path, which
    copies them; the result is bitwise what the same values on a boundary give."""
    inp = make_case(15, [300, 77, 1000], 2, 8, torch.bfloat16, "mixed", True, False)
    shifted = [off_16_byte_boundary(inp[name]) for name in ("q", "k", "v")]
    kw = dict(initial_state=inp["initial_state"], output_final_state=True, cu_seqlens=inp["cu_seqlens"])
    host_path.extension()
    with torch.no_grad():
        aligned = ops.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw)
        before = host_path.taken
        ops.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw)
        assert host_path.taken == before + 1, "the C++ path must be live for this signature"
        for _ in range(2):
            assert_written_and_equal(aligned, ops.chunk_gated_delta_rule(*shifted, inp["g"], inp["beta"], **kw))
        assert host_path.taken == before + 1, "the C++ path took a view off a 16-byte boundary"
    torch.cuda.synchronize()


def test_torch_compile_traces_through_the_op():
    inp = make_case(5, [200], 2, 8, torch.bfloat16, "mixed", True, False)

    def step(q, k, v, g, beta, h0, cu):
        o, s = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        return o.float().sum() + s.sum()

    with torch.no_grad():
        eager = step(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["initial_state"], inp["cu_seqlens"])
        compiled = torch.compile(step, fullgraph=True)(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                                       inp["initial_state"], inp["cu_seqlens"])
    assert torch.allclose(eager, compiled, rtol=1e-5)


def one_sequence_of(inp, n):
    """Sequence n of a varlen case as a case of its own (same tensors, sliced)."""
    lo, hi = (int(x) for x in inp["cu_seqlens"][n:n + 2])
    one = {name: inp[name][:, lo:hi] for name in ("q", "k", "v", "g", "beta")}
    one.update(initial_state=inp["initial_state"][n:n + 1], state_v_first=inp["state_v_first"],
               cu_seqlens=torch.tensor([0, hi - lo], device=DEV))
    return one, slice(lo, hi)


def test_batch_invariance_is_bitwise():
    """A sequence's output and final state do not depend on what else is in the batch."""
    inp = make_case(6, [1500, 333, 64, 2100], 2, 8, torch.bfloat16, "mixed", True, False)
    with torch.no_grad():
        o_all, s_all = ops.chunk_gated_delta_rule(
            inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], initial_state=inp["initial_state"],
            output_final_state=True, cu_seqlens=inp["cu_seqlens"])
        one, rows = one_sequence_of(inp, 1)  # the second sequence alone
        o_one, s_one = ops.chunk_gated_delta_rule(
            *(one[n] for n in ("q", "k", "v", "g", "beta")), initial_state=one["initial_state"],
            output_final_state=True, cu_seqlens=one["cu_seqlens"])
    assert torch.equal(o_all[:, rows], o_one) and torch.equal(s_all[1:2], s_one)


def test_int32_offsets_and_empty_sequences():
    inp = make_case(8, [0, 100, 0, 70, 0], 2, 8, torch.bfloat16, "mixed", True, False)
    cu32 = inp["cu_seqlens"].to(torch.int32)
    with torch.no_grad():
        o64, s64 = ops.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                              initial_state=inp["initial_state"], output_final_state=True,
                                              cu_seqlens=inp["cu_seqlens"])
        o32, s32 = ops.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                              initial_state=inp["initial_state"], output_final_state=True,
                                              cu_seqlens=cu32, cu_seqlens_cpu=cu32.cpu())
    assert torch.equal(o64, o32) and torch.equal(s64, s32)
    # an empty sequence's final state is its initial state
    for n in (0, 2, 4):
        assert torch.equal(s64[n], inp["initial_state"][n])


def test_rows_no_sequence_owns_do_not_leak():
    """cu_seqlens[-1] < T: the rows past it belong to no sequence and may hold anything (here NaN).
    The last sequence's tail chunk loads them; its output and final state must equal the run on
    the owned rows alone, bit for bit (the kernel zeroes a tail chunk's padding rows of K and V)."""
    inp = make_case(10, [300, 477, 223], 2, 8, torch.bfloat16, "mixed", True, False)
    owned = 777
    cu = torch.tensor([0, 300, owned], device=DEV)
    poisoned = {n: inp[n].clone() for n in ("q", "k", "v", "g", "beta")}
    for t in poisoned.values():
        t[:, owned:] = float("nan")
    with torch.no_grad():
        o_bad, s_bad = ops.chunk_gated_delta_rule(*(poisoned[n] for n in ("q", "k", "v", "g", "beta")),
                                                  initial_state=inp["initial_state"][:2], output_final_state=True,
                                                  cu_seqlens=cu)
        o_ref, s_ref = ops.chunk_gated_delta_rule(*(inp[n][:, :owned] for n in ("q", "k", "v", "g", "beta")),
                                                  initial_state=inp["initial_state"][:2], output_final_state=True,
                                                  cu_seqlens=cu)
    assert torch.equal(o_bad[:, :owned], o_ref) and torch.equal(s_bad, s_ref)


def test_malformed_offsets_never_fault():
    """cu_seqlens is clamped in the kernels: garbage offsets give garbage rows, never a fault."""
    inp = make_case(9, [300, 200], 2, 8, torch.bfloat16, "mixed", True, False)
    for bad in ([0, 400, 100], [-50, 10_000, 20_000], [0, 2**40, 3]):
        cu = torch.tensor(bad, device=DEV, dtype=torch.int64)
        with torch.no_grad():
            ops.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                       initial_state=inp["initial_state"], output_final_state=True, cu_seqlens=cu)
        torch.cuda.synchronize()  # an out-of-bounds access would surface here as a CUDA error


@pytest.mark.parametrize("seqlens, hqk, hv, l2norm", [
    ([32768], 2, 8, False),              # one long row: the case the overlap is for
    ([1, 4100, 0, 129, 777], 2, 8, True),  # tails, an empty sequence, normalised in the prep
    ([3000, 2049], 4, 16, False),          # chunk-major order across two sequences
])
def test_prep_schedules_agree_bitwise(seqlens, hqk, hv, l2norm):
    """The prep kernel overlapped with the sequential kernel (ready flags) and serialised before it
    (grid dependency) compute the same numbers; both write every element."""
    inp = make_case(11, seqlens, hqk, hv, torch.bfloat16, "mixed", True, False, normalised=not l2norm)
    with torch.no_grad():
        serial = run_ours(inp, l2norm, "serial")
        overlap = run_ours(inp, l2norm, "overlap")
    torch.cuda.synchronize()
    assert_written_and_equal(serial, overlap)


@pytest.mark.parametrize("hqk, hv", PREP_VARIANT_HEADS)
def test_prep_thread_counts_meet_the_bar(hqk, hv):
    """Both prep CTAs against the float64 oracle, every element written: 256 threads solve up to
    four v-heads at once on the tensor cores (more, a column per thread and v-head); 128 threads
    solve them one after another on the tensor cores. With one v-head per q/k head both run the
    same solve: bitwise equal."""
    inp = make_case(12, [3000, 1, 777, 0, 130], hqk, hv, torch.bfloat16, "mixed", True, False, normalised=False)
    with torch.no_grad():
        results = {threads: run_ours(inp, True, plan=variant_plan(hqk, hv, TileParams(prep_threads=threads)))
                   for threads in (256, 128)}
    torch.cuda.synchronize()
    ref_o, ref_s = reference(inp, True)
    bar_o, bar_s = accuracy_bars(fla_errors(inp, True, ref_o, ref_s))
    for threads, (o, s) in results.items():
        assert not torch.isnan(o).any() and not torch.isnan(s).any()
        err_o, err_s = rel_l2(o, ref_o), rel_l2(s, ref_s)
        line = f"{hqk}/{hv} prep_threads={threads} o={err_o:.2e} (bar {bar_o:.2e}) state={err_s:.2e} (bar {bar_s:.2e})"
        print(line)
        assert err_o <= bar_o and err_s <= bar_s, line
    if hqk == hv:
        assert_written_and_equal(results[256], results[128])


@pytest.mark.parametrize("hqk, hv, seqlens, dtype, state_v_first", [
    (2, 8, [1500, 333, 64, 2100, 700, 129, 1, 999, 4000], torch.bfloat16, False),  # 9 x 8 x 2 = 144 CTAs
    (16, 16, [777, 2049, 65, 300, 1200], torch.bfloat16, False),  # 5 x 16 x 2 = 160: the 128-thread prep
    (4, 16, [900, 65, 1, 2000, 130], torch.float16, True),        # fp16 inputs, the [V, K] state
])
def test_two_ctas_per_sm_for_many_chains_is_bitwise_the_plans_kernel(hqk, hv, seqlens, dtype, state_v_first):
    """A call with more sequential CTAs than SMs runs the plan's sequential kernel at two CTAs per
    SM (TwoPerSmConfig in csrc/gdn_fwd_mainloop.cuh); each sequence alone runs the plan's own. Both
    give bitwise the same output and final state (batch invariance across the switch)."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert 2 * hv * len(seqlens) > sms >= 2 * hv, "the batch must cross the switch and one sequence not"
    inp = make_case(14, seqlens, hqk, hv, dtype, "mixed", True, state_v_first)
    with torch.no_grad():
        o_all, s_all = run_ours(inp, False)
        for n in (1, 3, len(seqlens) - 1):
            one, rows = one_sequence_of(inp, n)
            o_one, s_one = run_ours(one, False)
            assert_written_and_equal((o_all[:, rows], s_all[n:n + 1]), (o_one, s_one))


@pytest.mark.parametrize("tiles", TILE_VARIANTS, ids=lambda t: KernelPlan(ops._spec(2, 8, 128, 128, True, False), t).name.split("__")[1])
def test_tile_variants_meet_the_accuracy_bar(tiles):
    """Non-default plans (output warp group, two consumers, other pipeline depths, two CTAs per
    SM) against the float64 oracle on the varlen case with tails, states and in-kernel L2 norm."""
    for seed in range(2):
        inp = make_case(2000 + seed, LONG_AND_SHORT, 2, 8, torch.bfloat16, "mixed", True, False, normalised=False)
        with torch.no_grad():
            o, s = run_ours(inp, True, plan=variant_plan(2, 8, tiles))
        torch.cuda.synchronize()
        assert not torch.isnan(o).any() and not torch.isnan(s).any()
        ref_o, ref_s = reference(inp, True)
        fla = fla_errors(inp, True, ref_o, ref_s)
        bar_o, bar_s = accuracy_bars(fla)
        err_o, err_s = rel_l2(o, ref_o), rel_l2(s, ref_s)
        line = f"variant {tiles} seed={seed} o={err_o:.2e} (bar {bar_o:.2e}) state={err_s:.2e} (bar {bar_s:.2e})"
        print(line)
        assert err_o <= bar_o and err_s <= bar_s, line


def test_overlapped_schedule_replays_in_a_cuda_graph():
    """The overlapped schedule (flag memset, prep, programmatic dependent launch of the sequential
    kernel) captured in a CUDA graph and replayed on new inputs gives the eager result bitwise."""
    inp = make_case(13, [6000, 2500], 2, 8, torch.bfloat16, "mixed", True, False)
    plan = runtime.default_plan_for(ops.call_spec(inp["q"], inp["v"], False))

    def call():
        return runtime.forward(plan, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["cu_seqlens"],
                               inp["initial_state"], 128 ** -0.5, True, False, prep_schedule="overlap")

    assert_replay_on_new_inputs_equals_eager(call, inp, make_case(14, [6000, 2500], 2, 8, torch.bfloat16, "mixed",
                                                                  True, False))


# ---- Warm-up context parallelism (docs/cp-design.md) ----
# "mixed" gates leave every fourth v-head at g = 0: head 0 claims a 5-chunk window anyway, so the
# guard has to chain it exactly; head 4 is marked exact.
MIXED_2_8 = [5, 5, 5, 5, -1, 5, 5, 5]
CP_CASES = {
    # name: (seqlens, hqk, hv, dtype, decay, h0, layout_vk, l2norm, k_scale, warmup, segment length)
    # The segment length is forced (every bucket), so what the cases cover does not move with the
    # cost model; the model's own tables run in the batch-invariance and CUDA-graph tests.
    "mixed_varlen": ([8192, 17, 4100, 0, 1000, 8192 + 33], 2, 8, torch.bfloat16, "mixed", True, False, False, 1.0,
                     MIXED_2_8, 8),
    "windows_1_to_9": ([8192 + 100], 2, 8, torch.bfloat16, "strong", True, False, False, 1.0,
                       [1, 2, 3, 4, 5, 6, 7, 9], 10),
    "weak_decay_guard_fails": ([8192], 2, 8, torch.bfloat16, "weak", True, False, False, 1.0, [2] * 8, 8),
    "all_exact_fp16": ([6000, 3000], 2, 8, torch.float16, "mixed", True, False, False, 1.0, [-1] * 8, 16),
    "state_v_first": ([8192, 300], 2, 8, torch.bfloat16, "mixed", True, True, False, 1.0, MIXED_2_8, 8),
    # one sequence with two exact heads: the chain's 4-column CTAs with the [V, K] layout (the
    # width follows the sequences and exact heads, csrc/gdn_fwd_host.cuh chain_columns:
    # l2norm_in_kernel's eight exact heads take 8 columns, all_exact_fp16's two sequences 16)
    "state_v_first_one_sequence": ([8192 + 17], 2, 8, torch.bfloat16, "strong", True, True, False, 1.0,
                                   [-1, 3, 3, 3, -1, 3, 3, 3], 4),
    "l2norm_in_kernel": ([8192], 4, 16, torch.bfloat16, "mixed", True, False, True, 1.0,
                         [-1 if h % 2 == 0 else 4 for h in range(16)], 16),
    "k_too_long_no_warmup": ([8192], 2, 8, torch.bfloat16, "strong", False, False, False, 1.6, [1] * 8, 8),
}


def model_segments_of(inp, warmup):
    """How many segments the cost model's table gives the longest sequence (so a test proves it splits)."""
    from flashqla_tune import warmup_tables
    from flashqla_tune.segment_policy import bucket_of_chunks, segments_of
    plan = runtime.default_plan_for(ops.call_spec(inp["q"], inp["v"], inp["state_v_first"]))
    lengths = warmup_tables.segment_lengths(tuple(warmup), plan, torch.cuda.get_device_properties(0).multi_processor_count)
    cu = inp["cu_seqlens"].tolist()
    chunks = max(-(-(b - a) // 64) for a, b in zip(cu, cu[1:]))
    return segments_of(chunks, lengths[bucket_of_chunks(chunks)])


def check_cp_against_oracle(inp, l2norm, warmup, length, label):
    """CP with every bucket's segment length forced to `length` against the float64 oracle: no
    unwritten (NaN) element, the accuracy bar, and at most 1.1 x the no-CP error + 1e-4."""
    with torch.no_grad():
        o_cp, s_cp = run_ours(inp, l2norm, warmup=warmup, segment_lengths=(length,) * 32)
        o_ex, s_ex = run_ours(inp, l2norm)
    torch.cuda.synchronize()
    ref_o, ref_s = reference(inp, l2norm)
    for t in (o_cp, s_cp):
        assert not torch.isnan(t).any(), f"{label}: unwritten (NaN) elements with CP"
    err_o, err_s = rel_l2(o_cp, ref_o), rel_l2(s_cp, ref_s)
    ex_o, ex_s = rel_l2(o_ex, ref_o), rel_l2(s_ex, ref_s)
    bar_o, bar_s = accuracy_bars(fla_errors(inp, l2norm, ref_o, ref_s))
    line = (f"cp {label} o={err_o:.2e} (no-CP {ex_o:.2e}, bar {bar_o:.2e}) "
            f"state={err_s:.2e} (no-CP {ex_s:.2e}, bar {bar_s:.2e})")
    print(line)
    LOG.append(line)
    assert err_o <= bar_o and err_s <= bar_s, line
    assert err_o <= 1.1 * ex_o + 1e-4 and err_s <= 1.1 * ex_s + 1e-4, line


@pytest.mark.parametrize("name", list(CP_CASES))
def test_context_parallel_matches_the_oracle_and_the_exact_chain(name):
    """CP (calibrated warm-up, guard, exact M/H chaining) against the float64 exact recurrence: the
    accuracy bar, and at most 1.1 x the no-CP error + 1e-4 (DESIGN.md, "Verification")."""
    seqlens, hqk, hv, dtype, decay, h0, vk, l2norm, k_scale, warmup, length = CP_CASES[name]
    for seed in range(3):
        inp = make_case(2000 * seed + 11, seqlens, hqk, hv, dtype, decay, h0, vk, normalised=not l2norm,
                        k_scale=k_scale)
        check_cp_against_oracle(inp, l2norm, warmup, length, f"{name:24s} seed={seed}")


@pytest.mark.parametrize("length", [1, 3, 4])
def test_forced_short_segments_with_a_guard_that_fails_mid_sequence(length):
    """Segment tables the cost model would not pick (one-chunk segments; L = 3 and 4 over a 4100-token
    tail-ended sequence and a short one), with gates that stop decaying over tokens 2048-4095 on
    half the heads: their windows there fail the guard, so exact boundaries follow warm-up ones
    (the chain's reload path) and run back to back (its shared-memory path)."""
    for seed in range(2):
        inp = make_case(7000 + seed, [4100, 700], 2, 8, torch.bfloat16, "strong", True, seed == 1)
        inp["g"][:, 2048:4096, :4] = 0.0
        warmup = [2] * 6 + [-1, 3]
        check_cp_against_oracle(inp, False, warmup, length, f"forced L={length} seed={seed}")


def test_context_parallel_batch_invariance_is_bitwise():
    """With CP, a sequence's output and final state do not depend on what else is in the batch: the
    long one split alike alone, the short ones (one segment inside a CP call) alone where no CP
    kernel runs at all."""
    seqlens = [3000, 8192 + 70, 64, 5000]
    inp = make_case(21, seqlens, 2, 8, torch.bfloat16, "mixed", True, False)
    assert model_segments_of(inp, MIXED_2_8) > 1
    with torch.no_grad():
        o_all, s_all = ops.chunk_gated_delta_rule(
            inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], initial_state=inp["initial_state"],
            output_final_state=True, cu_seqlens=inp["cu_seqlens"], warmup=MIXED_2_8)
        for i in (1, 0, 2):
            one, rows = one_sequence_of(inp, i)
            o_one, s_one = ops.chunk_gated_delta_rule(
                *(one[n] for n in ("q", "k", "v", "g", "beta")), initial_state=one["initial_state"],
                output_final_state=True, cu_seqlens=one["cu_seqlens"], warmup=MIXED_2_8)
            assert torch.equal(o_all[:, rows], o_one) and torch.equal(s_all[i:i + 1], s_one), f"sequence {i}"


def test_context_parallel_replays_in_a_cuda_graph():
    """The CP launches (the prep with the job plan, state pass, chain, forward) captured after one
    eager call and replayed on new inputs give the eager result bitwise."""
    inp = make_case(23, [8192, 2000], 2, 8, torch.bfloat16, "mixed", True, False)
    assert model_segments_of(inp, MIXED_2_8) > 1
    names = ("q", "k", "v", "g", "beta")

    def call():
        return ops.chunk_gated_delta_rule(*(inp[n] for n in names), initial_state=inp["initial_state"],
                                          output_final_state=True, cu_seqlens=inp["cu_seqlens"], warmup=MIXED_2_8)

    assert_replay_on_new_inputs_equals_eager(call, inp, make_case(24, [8192, 2000], 2, 8, torch.bfloat16, "mixed",
                                                                  True, False))
