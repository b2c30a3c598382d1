"""The backward's chain kernels (csrc/gdn_bwd_chain.cuh via backward.chain_kernels) on the H200.

1. Each direction against the float64 torch loops of chunked_torch (the reference the kernels
   replace) on the same per-chunk inputs: S_c, Vn and the final state (kStates); dS_{c+1}, dVn and
   dh0 (kGradients). Relative L2 per output below 2e-3, outputs NaN-poisoned first, three fresh
   draws per case: GVA heads, varlen with tails not a multiple of 64 and empty and one-token
   sequences, h0 and dht, strong, weak and zero decay; u and P^T dO given in both of the layouts
   the kernels take, with and without per-chunk scales.
2. The op's full gradients on CUDA (whose backward runs the kernels for its two chains, no torch
   loop) against float64 autograd of the chunked float64 forward: relative L2 of each of
   dq, dk, dv, dg, dbeta, dh0 at most max(2 x FLA's error on the same inputs, 2e-3) and below
   1e-2; without FLA below 1e-2 alone (bf16 rounding of the returned dq, dk, dv is already
   about 1.7e-3 of relative L2, so the 2e-3 floor means something only beside FLA's error). Both
   state layouts, GVA, varlen, h0 and dht, in-kernel L2 norm, the three decays, fp16 and bf16.
   The op's backward is called as the custom op flashqla_tune::gdn_bwd, which autograd through
   ops.chunk_gated_delta_rule calls (the plumbing around it is CPU-tested); one test runs autograd
   through the op end to end and checks that no torch loop runs. The lines printed (-s) name the
   reference used.
"""
from __future__ import annotations

import math
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from gdn_inputs import float64_tokens, rel_l2  # noqa: E402
from test_gpu_backward import check_against_oracle, make_case, run  # noqa: E402
from test_gpu_forward import captured  # noqa: E402

from flashqla_tune import ops  # noqa: E402  (registers flashqla_tune::gdn_bwd)
from flashqla_tune.backward import chain_kernels, chain_segments, chunked_torch  # noqa: E402
from flashqla_tune.oracle.chunked import decay_mask, gate_free_inverse  # noqa: E402

DEV = "cuda"
K = V = 128
KERNEL_BAR = 2e-3
FLOOR, CEILING = 2e-3, 1e-2
LOG = []

# name: (seqlens, hqk, hv, decay, h0, dht)
CHAIN_CASES = {
    "gva_varlen_tails_mixed": ([1, 17, 63, 64, 65, 0, 127, 700, 5, 129], 2, 8, "mixed", True, True),
    "strong_decay": ([1000], 1, 4, "strong", True, True),
    "weak_decay": ([1500, 333], 2, 4, "weak", True, True),
    "zero_decay_no_state": ([1200], 2, 4, "zero", False, False),
    "one_sequence_many_heads": ([640], 4, 32, "mixed", False, True),
}


def chunk_inputs(seed, seqlens, hqk, hv, decay, h0, dht):
    """Per-chunk float64 inputs of the two chains, built as chunked_torch builds them."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(seqlens)
    f64 = torch.float64
    q, k, v, g, beta = float64_tokens(gen, T, hqk, hv, K, V, decay, DEV)
    do = torch.randn(T, hv, V, generator=gen, device=DEV, dtype=f64)
    bounds = (0, *torch.tensor(seqlens).cumsum(0).tolist())
    grid = chunked_torch.chunk_grid(tuple(int(b) for b in bounds), torch.device(DEV))
    group = hv // hqk
    qc = chunked_torch.to_chunks(q, grid).repeat_interleave(group, dim=1)
    kc = chunked_torch.to_chunks(k, grid).repeat_interleave(group, dim=1)
    vc, bc = chunked_torch.to_chunks(v, grid), chunked_torch.to_chunks(beta, grid)
    dOs = K ** -0.5 * chunked_torch.to_chunks(do, grid)
    gamma = chunked_torch.to_chunks(g, grid).cumsum(-1)
    Gamma = decay_mask(gamma)
    A0 = gate_free_inverse(kc, bc)
    Tm = Gamma * A0 * bc[..., None, :]
    d = gamma.exp()[..., None]
    last = gamma[..., -1]
    Kd = (last[..., None] - gamma).exp()[..., None] * kc
    P = Gamma * (qc @ kc.transpose(-1, -2))
    N = len(seqlens)
    return dict(grid=grid, w=Tm @ (d * kc), u=Tm @ vc, Kd=Kd, Qd=d * qc, dOs=dOs.contiguous(), bc=bc,
                PtdO=P.transpose(-1, -2) @ dOs, decay=last.exp(),
                h0=torch.randn(N, hv, K, V, generator=gen, device=DEV, dtype=f64) if h0 else None,
                dht=torch.randn(N, hv, K, V, generator=gen, device=DEV, dtype=f64) if dht else None)


def nan_like(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def nan_outputs(NC, Hv, N, op):
    """A chain's NaN-filled out buffers: every chunk's state and values in the operand dtype, the
    end state fp32."""
    return nan_like(NC, Hv, K, V, dtype=op), nan_like(NC, Hv, 64, V, dtype=op), nan_like(N, Hv, K, V)


@pytest.mark.parametrize("name", list(CHAIN_CASES))
def test_chain_kernels_match_float64_loops(name):
    for seed in range(3):
        x = chunk_inputs(100 * seed + 7, *CHAIN_CASES[name])
        grid = x["grid"]
        NC, Hv = x["w"].shape[:2]
        N = grid.num_seqs
        h, Vn, dh_out, dVn, dh0 = chunked_torch.chains_torch(
            grid, x["u"], x["w"], x["Kd"], x["decay"][..., None, None], x["Qd"], x["dOs"], x["PtdO"], x["h0"],
            x["dht"])
        # the final state of the reference: one more step from each sequence's last chunk
        op = chain_kernels.spec_for(K, V).torch_dtype
        w, kd = x["w"].to(op).contiguous(), x["Kd"].to(op).contiguous()
        f32 = lambda t: None if t is None else t.float().contiguous()  # noqa: E731
        decay = f32(x["decay"])
        out_f = nan_outputs(NC, Hv, N, op)
        whole = chain_segments.whole_sequences(grid.chunk_offsets)
        # odd seeds: the fp32 terms as the prep writes them (the add tiles), each chunk's divided by
        # a power of two that the kernels multiply back as they read (u_scale, ptdo_scale): exact
        u, ptdo, add_scale = f32(x["u"]), f32(x["PtdO"]), None
        if seed % 2:
            gen = torch.Generator(device=DEV).manual_seed(seed)
            add_scale = torch.exp2(torch.randint(-3, 4, (NC, Hv), generator=gen, device=DEV).float())
            u, ptdo = (chain_kernels.add_tiles(t / add_scale[..., None, None], chain_kernels.spec_for(K, V).block_v)
                       for t in (u, ptdo))
        hk, Vnk, final = chain_kernels.chain_states(w, kd, u, decay, whole, f32(x["h0"]), out=out_f, u_scale=add_scale)
        out_b = nan_outputs(NC, Hv, N, op)
        dhk, dVnk, dh0k = chain_kernels.chain_gradients(
            w, kd, x["Qd"].to(op).contiguous(), x["dOs"].to(op).contiguous(), ptdo, decay,
            whole, f32(x["dht"]), out=out_b, ptdo_scale=add_scale)
        torch.cuda.synchronize()
        # the reference's final state: S after each sequence's last chunk
        last = grid.chunk_offsets[1:] - 1
        S_end = x["decay"][..., None, None] * h + x["Kd"].transpose(-1, -2) @ Vn
        start = torch.zeros_like(dh0) if x["h0"] is None else x["h0"]
        empty = (grid.chunk_offsets[1:] == grid.chunk_offsets[:-1])
        final_ref = torch.where(empty[:, None, None, None], start, S_end[last.clamp(min=0)])
        pairs = {"S_c": (hk, h), "Vn": (Vnk, Vn), "final": (final, final_ref),
                 "dS_c+1": (dhk, dh_out), "dVn": (dVnk, dVn), "dh0": (dh0k, dh0)}
        parts = []
        for what, (got, want) in pairs.items():
            assert torch.isfinite(got).all(), f"{name} seed={seed}: {what} has non-finite (unwritten) elements"
            err = rel_l2(got.double(), want)
            parts.append(f"{what}={err:.2e}")
            assert err < KERNEL_BAR, f"{name} seed={seed}: {what} relative L2 {err:.2e} >= {KERNEL_BAR}"
        line = f"chain {name:26s} seed={seed} " + " ".join(parts)
        print(line)
        LOG.append(line)


# name: (seqlens, hqk, hv, decay, h0, dht, warm-up windows per v-head)
SPLIT_CASES = {
    "split_strong_decay": ([3000, 5000, 70, 0], 1, 4, "strong", True, True, [4, 8, 2, -1]),
    "split_mixed_decay": ([6000, 1100], 2, 4, "mixed", True, True, [8, 8, 8, 8]),
    "split_zero_decay_guard": ([4000, 2500], 1, 2, "zero", True, True, [8, 8]),
}
SPLIT_CHUNKS = 16      # every bucket's segment length in these cases
SPLIT_EPS = 1e-5


def split_run(x, warmup, refuse=()):
    """Both chains of chunk inputs x on the kernels, each sequence cut every SPLIT_CHUNKS chunks with
    the guarded windows `warmup`, outputs NaN-poisoned first; and the same on whole sequences.
    refuse: chunks whose guard input is made +inf, so that every window holding one is refused."""
    grid = x["grid"]
    NC, Hv = x["w"].shape[:2]
    N = grid.num_seqs
    op = chain_kernels.spec_for(K, V).torch_dtype
    f32 = lambda t: None if t is None else t.float().contiguous()  # noqa: E731
    w, kd, qd, dout = (x[n].to(op).contiguous() for n in ("w", "Kd", "Qd", "dOs"))
    counts = (grid.chunk_offsets[1:] - grid.chunk_offsets[:-1]).tolist()
    most = sum(max(1, -(-c // SPLIT_CHUNKS)) for c in counts) + 3   # three unused slots as well
    table = torch.full((32,), SPLIT_CHUNKS, dtype=torch.int32, device=DEV)
    split = chain_segments.split_sequences(grid.chunk_offsets, table, most,
                                           torch.tensor(warmup, dtype=torch.int32, device=DEV), math.log(SPLIT_EPS))
    key_norms = torch.ones(NC, Hv, 64, device=DEV)     # the inputs' keys are unit vectors
    guard = chain_segments.window_log_decay(x["decay"].log().float(), x["bc"].float(), key_norms)
    guard[list(refuse)] = float("inf")
    runs = {}
    for label, segments in (("split", split), ("whole", chain_segments.whole_sequences(grid.chunk_offsets))):
        out_f, out_b = nan_outputs(NC, Hv, N, op), nan_outputs(NC, Hv, N, op)
        states = chain_kernels.chain_states(w, kd, f32(x["u"]), f32(x["decay"]), segments, f32(x["h0"]), out=out_f,
                                            window_log_decay=guard)
        grads = chain_kernels.chain_gradients(w, kd, qd, dout, f32(x["PtdO"]), f32(x["decay"]), segments,
                                              f32(x["dht"]), out=out_b, window_log_decay=guard)
        runs[label] = (*states, *grads)
    torch.cuda.synchronize()
    return runs


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_chains_match_float64_loops(name):
    """Context parallelism in the chains: every segment's chunks against the exact float64 loops,
    within the kernels' bar (the warm-up drops at most eps of the state); where the gates do not
    decay, the guard refuses every window and the split run is bitwise the whole-sequence run; where
    they do, it is not (the windows were taken)."""
    *case, warmup = SPLIT_CASES[name]
    names = ("S_c", "Vn", "final", "dS_c+1", "dVn", "dh0")
    for seed in range(3):
        x = chunk_inputs(100 * seed + 31, *case)
        grid = x["grid"]
        h, Vn, dh_out, dVn, dh0 = chunked_torch.chains_torch(
            grid, x["u"], x["w"], x["Kd"], x["decay"][..., None, None], x["Qd"], x["dOs"], x["PtdO"], x["h0"],
            x["dht"])
        runs = split_run(x, warmup)
        split, whole = runs["split"], runs["whole"]
        parts = []
        for i, what in enumerate(names):
            assert torch.isfinite(split[i]).all(), f"{name} seed={seed}: {what} has unwritten elements"
            want = {"S_c": h, "Vn": Vn, "dS_c+1": dh_out, "dVn": dVn, "dh0": dh0}.get(what)
            if want is None:   # the final state: the whole-sequence kernel's, checked above against the loops
                want = whole[i].double()
            err = rel_l2(split[i].double(), want)
            parts.append(f"{what}={err:.2e}")
            assert err < KERNEL_BAR, f"{name} seed={seed}: {what} relative L2 {err:.2e} >= {KERNEL_BAR}"
        same = all(torch.equal(a, b) for a, b in zip(split, whole))
        if case[3] == "zero":
            assert same, f"{name}: the guard let a window through gates that do not decay"
        line = f"split {name:24s} seed={seed} " + " ".join(parts) + f" bitwise_whole={same}"
        print(line)
        LOG.append(line)


def test_exact_boundaries_between_warm_ones_are_walked_from_the_start():
    """One sequence of six segments whose boundaries mix taken and refused windows (the guard's
    input made +inf in chosen chunks): states' boundaries at chunks 32 and 48 refused (the walk from
    the start that reaches 32 goes on through 48), gradients' at 64 and 80 (the walk from the end
    goes on through both). Every chunk is written, all within the bar of the float64 loops, and the
    chunks walked from the sequence's start (end) are the whole-sequence run's bits."""
    x = chunk_inputs(41, [6000], 1, 2, "strong", True, True)
    grid = x["grid"]
    assert grid.chunk_offsets.tolist()[:2] == [0, 94]
    runs = split_run(x, [4, 4], refuse=(31, 47, 64, 80))
    split, whole = runs["split"], runs["whole"]
    h, Vn, dh_out, dVn, _ = chunked_torch.chains_torch(
        grid, x["u"], x["w"], x["Kd"], x["decay"][..., None, None], x["Qd"], x["dOs"], x["PtdO"], x["h0"], x["dht"])
    for i, (what, want) in enumerate((("S_c", h), ("Vn", Vn), (None, None), ("dS_c+1", dh_out), ("dVn", dVn))):
        assert torch.isfinite(split[i]).all(), f"{what or 'final'}: unwritten elements"
        if want is not None:
            err = rel_l2(split[i][:94].double(), want[:94])
            assert err < KERNEL_BAR, f"{what}: relative L2 {err:.2e} >= {KERNEL_BAR}"
    exact_states = torch.cat([torch.arange(0, 16), torch.arange(32, 64)])
    exact_grads = torch.arange(48, 94)
    for i in (0, 1):
        assert torch.equal(split[i][exact_states], whole[i][exact_states]), i
    for i in (3, 4):
        assert torch.equal(split[i][exact_grads], whole[i][exact_grads]), i


def test_a_window_reads_nothing_before_it():
    """NaN in the first chunk's u (states) and the last chunk's scale P^T dO (gradients) of a sequence
    cut every SPLIT_CHUNKS chunks: heads with a window keep every segment past the first (before the
    last) finite, since their walks start at the window; the head that chains exactly (-1) and a head
    whose gates do not decay (the guard refuses its windows) carry the NaN through every chunk."""
    x = chunk_inputs(5, [4000], 1, 4, "strong", True, True)
    x["decay"][:, 3] = 1.0                       # v-head 3: gates that do not decay
    x["u"][0] = float("nan")
    x["PtdO"][-1] = float("nan")
    split = split_run(x, [8, 2, -1, 8])["split"]
    states, grads = split[0], split[3]           # S_c and dS_{c+1}
    first_segment, last_segment = slice(0, SPLIT_CHUNKS + 1), slice(-SPLIT_CHUNKS, None)
    for hv, windowed in ((0, True), (1, True), (2, False), (3, False)):
        later, earlier = states[SPLIT_CHUNKS + 1:, hv], grads[:-SPLIT_CHUNKS - 1, hv]
        if windowed:
            assert torch.isfinite(later).all() and torch.isfinite(earlier).all(), f"v-head {hv} read before its window"
            assert torch.isnan(states[first_segment, hv][1:]).any() and torch.isnan(grads[last_segment, hv][:-1]).any()
        else:
            assert torch.isnan(later).all() and torch.isnan(earlier).all(), f"v-head {hv} took a window"


def test_cuda_backward_runs_no_torch_loop(monkeypatch):
    """On CUDA autograd through the op (its forward kernel, then its backward) takes the chain
    kernels; the torch loops are not called."""
    def refuse(*args, **kwargs):
        raise AssertionError("the torch loops ran on CUDA")

    monkeypatch.setattr(chunked_torch, "chains_torch", refuse)
    leaves, do, dfinal, cu = make_case(3, [200, 77], 2, 4, torch.bfloat16, "mixed", True, True, False, False)
    grads = run(ops.chunk_gated_delta_rule, leaves, do, dfinal, cu, False, False)
    assert all(torch.isfinite(t).all() for t in grads.values() if t is not None)


# name: (seqlens, hqk, hv, dtype, decay, h0, dht, layout_vk, l2norm)
OP_CASES = {
    "gva_varlen_tails_bf16": ([1, 17, 63, 64, 65, 0, 127, 900, 5, 129], 2, 8, torch.bfloat16, "mixed", True, True,
                              False, False),
    "gva_varlen_tails_fp16": ([1, 17, 63, 64, 65, 0, 127, 900, 5, 129], 2, 8, torch.float16, "mixed", True, True,
                              False, False),
    "state_v_first": ([700, 1049], 2, 8, torch.bfloat16, "mixed", True, True, True, False),
    "l2norm_in_kernel": ([777, 900], 4, 16, torch.bfloat16, "mixed", True, True, False, True),
    "strong_decay": ([2000], 2, 8, torch.bfloat16, "strong", True, True, False, False),
    "weak_decay": ([2000], 2, 8, torch.bfloat16, "weak", True, True, False, False),
    "zero_decay_no_state": ([1500], 2, 8, torch.bfloat16, "zero", False, False, False, False),
    # a long sequence that never decays: the state and its gradient grow over 256 chunks, the
    # headroom the fp16 operands of the chains need
    "zero_decay_long": ([16384], 2, 4, torch.bfloat16, "zero", True, True, False, False),
    # sequences of one length, a multiple of 64, as the forward's host knows them (batch rows): the
    # identity grid, every row read and written in place
    "uniform_sequences_vk": ([2048, 2048, 2048], 2, 8, torch.bfloat16, "mixed", True, True, True, False),
    "uniform_one_sequence_l2norm_fp16": ([4096], 4, 16, torch.float16, "mixed", True, True, False, True),
}


def host_sequence_tokens(seqlens) -> int:
    """What the forward's host would hand the backward for these lengths (batch rows or a cu_seqlens_cpu)."""
    bounds = [0, *torch.tensor(seqlens).cumsum(0).tolist()]
    return ops.uniform_sequence_tokens(bounds[-1], torch.tensor(bounds), bounds)


def op_backward(leaves, do, dfinal, cu, vk, l2norm, warmup=None, sequence_tokens=0):
    """The op's registered backward (flashqla_tune::gdn_bwd, what autograd through
    ops.chunk_gated_delta_rule calls; the autograd plumbing around it is CPU-tested), on
    NaN-free inputs, for a forward call with the default plan and the warm-up table `warmup`
    (None: exact chains) whose host knew every sequence to be sequence_tokens long (0: not known);
    the gradients by leaf name."""
    grads = torch.ops.flashqla_tune.gdn_bwd(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], cu, leaves["initial_state"], do, dfinal,
        128 ** -0.5, l2norm, vk, "", warmup, 1e-5, sequence_tokens)
    torch.cuda.synchronize()
    out = dict(zip(("q", "k", "v", "g", "beta", "initial_state"), grads))
    if leaves["initial_state"] is None:
        out["initial_state"] = None
    return out


# Output gradients of a training step's size (a mean over many tokens and a vocabulary): far below
# the 16-bit operands' normal range unless the backward brings them to unit magnitude first.
TINY_OUTPUT_GRADIENT = {"tiny_output_gradients": 3e-8, "large_output_gradients": 3e3}
OP_CASES.update({name: ([900, 333], 2, 8, torch.bfloat16, "mixed", True, True, False, False)
                 for name in TINY_OUTPUT_GRADIENT})


@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_gradients_with_chain_kernels_match_float64(name):
    seqlens, hqk, hv, dtype, decay, h0, dht, vk, l2norm = OP_CASES[name]
    for seed in range(3):
        leaves, do, dfinal, cu = make_case(1000 * seed + 23, seqlens, hqk, hv, dtype, decay, h0, dht, vk, l2norm)
        if name in TINY_OUTPUT_GRADIENT:
            size = TINY_OUTPUT_GRADIENT[name]
            do, dfinal = (do.float() * size).to(do.dtype), dfinal * size
        grads = op_backward(leaves, do, dfinal, cu, vk, l2norm, sequence_tokens=host_sequence_tokens(seqlens))
        line = f"op {name:24s} seed={seed} " + check_against_oracle(name, seed, grads, leaves, do, dfinal, cu, vk,
                                                                       l2norm, chain_op_bar)
        print(line)
        LOG.append(line)


def chain_op_bar(n, fla):
    return min(max(2 * fla, FLOOR), CEILING) if fla is not None else CEILING


# name: (make_case's shape, the forward call's warm-up table: None, whole chains; else the chains
# split as the forward's CP splits the long sequence)
CAPTURED_STEPS = {
    "short_whole_chains": (([300, 77, 64], 2, 4, torch.bfloat16, "mixed", True, True, False, False), None),
    "long_split_chains": (([16384, 3000, 70], 2, 8, torch.bfloat16, "mixed", True, True, False, False), [8] * 8),
}


@pytest.mark.parametrize("name", list(CAPTURED_STEPS))
def test_a_training_step_through_the_op_is_captured_in_a_cuda_graph(name):
    """Neither the forward nor the backward waits for the GPU or copies from the host (the
    backward's chunk grid and chain segments are built on the device): forward plus backward
    through the op, captured in one CUDA graph and replayed on fresh inputs copied into the captured
    ones, gives the eager gradients; the gradients are NaN-poisoned before the replay."""
    shape, warmup = CAPTURED_STEPS[name]
    leaves, do, dfinal, cu = make_case(5, *shape)
    static = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    static_do, static_dfinal = do.clone(), dfinal.clone()

    def step():
        for t in static.values():  # each run's backward writes fresh gradients (the captured one in the graph's pool)
            t.grad = None
        o, final = ops.chunk_gated_delta_rule(
            static["q"], static["k"], static["v"], static["g"], static["beta"], scale=128 ** -0.5,
            initial_state=static["initial_state"], output_final_state=True, cu_seqlens=cu, warmup=warmup)
        torch.autograd.backward([o, final], [static_do, static_dfinal])

    graph, _ = captured(step, warmups=2)  # warm-up: the plan and the chain library built and opened
    fresh, fresh_do, fresh_dfinal, _ = make_case(6, *shape)
    with torch.no_grad():
        for n, t in fresh.items():
            static[n].copy_(t)
            static[n].grad.fill_(float("nan"))
        static_do.copy_(fresh_do)
        static_dfinal.copy_(fresh_dfinal)
    graph.replay()
    torch.cuda.synchronize()
    eager = run(ops.chunk_gated_delta_rule, fresh, fresh_do, fresh_dfinal, cu, False, False, warmup=warmup)
    for n, t in static.items():
        assert torch.isfinite(t.grad).all(), f"the replay left the gradient of {n} unwritten"
        err = rel_l2(t.grad, eager[n])
        assert err <= 1e-6, f"d{n}: replay against eager relative L2 {err:.2e}"


# name: (seqlens, hqk, hv, dtype, decay, h0, dht, layout_vk, l2norm, warm-up table)
SPLIT_OP_CASES = {
    "split_default_window_mixed": ([16384, 3000, 70], 2, 8, torch.bfloat16, "mixed", True, True, False, False,
                                   [8] * 8),
    "split_calibrated_vk_l2norm_strong": ([12000], 4, 16, torch.bfloat16, "strong", True, True, True, True,
                                          [2, 4, 8, -1] * 4),
    "split_uniform_sequences": ([8192, 8192], 2, 8, torch.bfloat16, "mixed", True, True, False, False, [8] * 8),
}


@pytest.mark.parametrize("name", list(SPLIT_OP_CASES))
def test_op_gradients_with_split_chains_match_float64(name):
    """The op's backward with a forward call's warm-up table: its chains split the long sequences as the
    forward's CP does (checked: the tables cut them), guarded, and every gradient stays within the bar."""
    from flashqla_tune.backward.autograd import forward_tables

    *case, warmup = SPLIT_OP_CASES[name]
    seqlens, hqk, hv, dtype, decay, h0, dht, vk, l2norm = case
    for seed in range(3):
        leaves, do, dfinal, cu = make_case(1000 * seed + 29, *case)
        if seed == 0:
            tables = forward_tables(leaves["q"], leaves["v"], vk, "", warmup, 1e-5)
            assert tables is not None and tables.bound(sum(seqlens), len(seqlens)) > len(seqlens), name
        grads = op_backward(leaves, do, dfinal, cu, vk, l2norm, warmup=warmup,
                            sequence_tokens=host_sequence_tokens(seqlens))
        line = f"op {name:24s} seed={seed} " + check_against_oracle(name, seed, grads, leaves, do, dfinal, cu, vk,
                                                                       l2norm, chain_op_bar)
        print(line)
        LOG.append(line)


def test_batch_rows_take_the_identity_grid_and_give_the_varlen_gradients(monkeypatch):
    """Batch rows of a multiple of 64 tokens (cu_seqlens None): the backward reads and writes the
    token rows in place (no device grid is built) and gives the gradients of the same sequences
    passed as varlen offsets (the device grid, rows gathered), to fp32 rounding."""
    leaves, do, dfinal, cu = make_case(41, [1024, 1024], 2, 8, torch.bfloat16, "mixed", True, True, False, False)
    varlen = run(ops.chunk_gated_delta_rule, leaves, do, dfinal, cu, False, False)
    rows = {n: (t.detach() if n == "initial_state" else t.detach().reshape(2, 1024, *t.shape[2:])).clone()
            for n, t in leaves.items()}
    for t in rows.values():
        t.requires_grad_(True)
    monkeypatch.setattr(chunked_torch, "device_chunk_grid", lambda *a: pytest.fail("batch rows built the device grid"))
    o, final = ops.chunk_gated_delta_rule(rows["q"], rows["k"], rows["v"], rows["g"], rows["beta"], scale=128 ** -0.5,
                                          initial_state=rows["initial_state"], output_final_state=True)
    torch.autograd.backward([o, final], [do.view(2, 1024, *do.shape[2:]), dfinal])
    torch.cuda.synchronize()
    for n, t in rows.items():
        got = t.grad.reshape(varlen[n].shape)
        assert torch.isfinite(got).all(), f"d{n} has unwritten rows"
        err = rel_l2(got, varlen[n])
        assert err <= 1e-5, f"d{n}: batch rows against varlen relative L2 {err:.2e}"


def test_offsets_that_disagree_with_the_hosts_lengths_give_nan_gradients():
    """The host said two sequences of 1024 tokens (a cu_seqlens_cpu) while the device offsets cut
    them elsewhere: the backward's identity grid would mix the sequences, so every gradient comes
    out NaN instead of a wrong number."""
    leaves, do, dfinal, cu = make_case(43, [1000, 1048], 2, 8, torch.bfloat16, "mixed", True, True, False, False)
    grads = op_backward(leaves, do, dfinal, cu, False, False, sequence_tokens=1024)
    for n, t in grads.items():
        if t is not None:
            assert torch.isnan(t).all(), f"d{n} is not NaN everywhere"
