"""The backward's per-chunk gradient kernel (csrc/gdn_bwd_chunk.cuh via backward.chunk_kernels) on the H200.

1. The kernel against chunked_torch.per_chunk_gradients in float64 (the torch step 3 it replaces)
   on the same per-chunk inputs, the chains run in float64 too (chains_torch), the chains' results
   handed over scaled by the units chunked_torch gives the chain kernels, q, k, v, dO, beta and
   gamma as to_chunks' strided views (and once q and k as contiguous copies; q, k, v and dO once
   as 16-bit views, which must give the bits of their fp32 copies): relative L2 of each of
   dq, dk, dv, dbeta, dg below 2e-3, outputs NaN-poisoned first, three fresh draws per case: GVA
   heads, varlen with tails not a multiple of 64 and empty and one-token sequences, h0 and dht,
   zero, weak and strong decay, output gradients of a training step's size (3e-8) and large ones
   (3e3), q and k as raw bf16 inputs far from unit norm (no in-kernel l2norm) both large and tiny.
2. The op's gradients on CUDA (chains and step 3 as kernels; the torch step 3 refuses to run)
   against float64 autograd of the chunked float64 forward, within the issue's bar: relative L2
   of dq, dk, dv, dh0 below 8e-3, of dbeta, dg below 2e-2. Both state layouts, GVA, varlen, h0 and
   dht, in-kernel L2 norm, the decays, fp16 and bf16, tiny and large output gradients, chains split
   as the forward's CP splits (a warm-up table).
3. Where the library cannot be had, "auto" warns once and runs the torch step 3 (same gradients),
   "kernels" raises.
The lines printed (-s) give every error.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from gdn_inputs import gate_values, rel_l2  # noqa: E402
from test_gpu_backward import FLOOR, check_against_oracle, make_case  # noqa: E402
from test_gpu_backward_chain import op_backward  # noqa: E402

from flashqla_tune import ops  # noqa: E402,F401  (registers flashqla_tune::gdn_bwd)
from flashqla_tune.backward import chunk_kernels, chunked_torch  # noqa: E402
from flashqla_tune.oracle.chunked import decay_mask, gate_free_inverse  # noqa: E402

DEV = "cuda"
K = V = 128
KERNEL_BAR = 2e-3
OUTPUTS = ("dq", "dk", "dv", "dbeta", "dg")
LOG = []

# name: (seqlens, hqk, hv, decay, h0, dht, output gradient size, q/k: "unit" norm, or raw bf16 "large"/"tiny")
KERNEL_CASES = {
    "gva_varlen_tails_mixed": ([1, 17, 63, 64, 65, 0, 127, 700, 5, 129], 2, 8, "mixed", True, True, 1.0, "unit"),
    "strong_decay": ([1000], 1, 4, "strong", True, True, 1.0, "unit"),
    "weak_decay": ([1500, 333], 2, 4, "weak", True, True, 1.0, "unit"),
    "zero_decay_no_state": ([1200], 2, 4, "zero", False, False, 1.0, "unit"),
    "zero_decay_long": ([8192], 1, 2, "zero", True, True, 1.0, "unit"),
    "tiny_output_gradients": ([900, 333], 2, 8, "mixed", True, True, 3e-8, "unit"),
    "large_output_gradients": ([900, 333], 2, 8, "mixed", True, True, 3e3, "unit"),
    "raw_large_q": ([700, 77], 2, 4, "mixed", True, True, 1.0, "large"),
    "raw_tiny_q": ([700, 77], 2, 4, "mixed", True, True, 1.0, "tiny"),
}
QK_SIZE = {"large": 30.0, "tiny": 1e-6}


def per_chunk_case(seed, seqlens, hqk, hv, decay, h0, dht, size, qk):
    """Float64 per-chunk inputs of step 3 as chunked_torch builds them, the chains run in float64,
    and the kernel's inputs (fp32 but for the chains' results, scaled by the chain units per chunk
    and rounded to the operand dtype, as the chain kernels store them)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T, N = sum(seqlens), len(seqlens)
    f64 = torch.float64
    if qk == "unit":
        q = F.normalize(torch.randn(T, hqk, K, generator=gen, device=DEV, dtype=f64), dim=-1)
    else:  # a raw bf16 input: far from unit norm (k stays near it: the delta rule needs b |k|^2 < 2)
        q = (QK_SIZE[qk] * torch.randn(T, hqk, K, generator=gen, device=DEV, dtype=f64)).bfloat16().to(f64)
    k = F.normalize(torch.randn(T, hqk, K, generator=gen, device=DEV, dtype=f64), dim=-1)
    if qk != "unit":
        k = (0.9 * k).bfloat16().to(f64)
    v = torch.randn(T, hv, V, generator=gen, device=DEV, dtype=f64)
    g = gate_values(decay, (T, hv), gen, f64)
    beta = torch.rand(T, hv, generator=gen, device=DEV, dtype=f64)
    do = size * torch.randn(T, hv, V, generator=gen, device=DEV, dtype=f64)
    bounds = (0, *torch.tensor(seqlens).cumsum(0).tolist())
    grid = chunked_torch.chunk_grid(tuple(int(b) for b in bounds), torch.device(DEV))
    group = hv // hqk
    q_heads, k_heads = chunked_torch.to_chunks(q, grid), chunked_torch.to_chunks(k, grid)  # per q/k head
    qc, kc = q_heads.repeat_interleave(group, dim=1), k_heads.repeat_interleave(group, dim=1)
    vc, bc = chunked_torch.to_chunks(v, grid), chunked_torch.to_chunks(beta, grid)
    do_chunks = chunked_torch.to_chunks(do, grid)
    dOs = K ** -0.5 * do_chunks
    gamma = chunked_torch.to_chunks(g, grid).cumsum(-1)
    Gamma = decay_mask(gamma)
    A0 = gate_free_inverse(kc, bc)
    A = Gamma * A0
    Tm = A * bc[..., None, :]
    d = gamma.exp()[..., None]
    last = gamma[..., -1]
    Kdd, Kd = d * kc, (last[..., None] - gamma).exp()[..., None] * kc
    QK = qc @ kc.transpose(-1, -2)
    P = Gamma * QK
    h0_t = torch.randn(N, hv, K, V, generator=gen, device=DEV, dtype=f64) if h0 else None
    dht_t = size * torch.randn(N, hv, K, V, generator=gen, device=DEV, dtype=f64) if dht else None
    u, w = Tm @ vc, Tm @ Kdd
    h, Vn, dh_out, dVn, _ = chunked_torch.chains_torch(grid, u, w, Kd, last.exp()[..., None, None], d * qc, dOs,
                                                       P.transpose(-1, -2) @ dOs, h0_t, dht_t)
    want = chunked_torch.per_chunk_gradients(qc, kc, vc, bc, dOs, gamma, Gamma, A0, A, Tm, Kdd, QK, h, dh_out, Vn,
                                             dVn)
    # the kernel's dq and dk are per q/k head, summed over its v-heads
    want = tuple(x.view(x.shape[0], hqk, group, *x.shape[2:]).sum(2) if i < 2 else x for i, x in enumerate(want))
    f32 = lambda t: t.float().contiguous()  # noqa: E731
    _, unit_u = chunked_torch._chain_units(grid, chunked_torch.tile_amax(f32(u)), None if h0_t is None else f32(h0_t))
    _, unit_d = chunked_torch._chain_units(grid, chunked_torch.tile_amax(f32(dOs)),
                                          None if dht_t is None else f32(dht_t))
    NC = grid.num_chunks
    # q, k, v, dO, beta and gamma as the backward hands them over: to_chunks' views of token rows
    # (strides kept by .float()), which the kernel reads in place; dO without the scale, which the
    # kernel folds in (dout_scale)
    op = lambda t: t.to(chunk_kernels.spec_for(K, V).torch_dtype).contiguous()  # noqa: E731
    inputs = (q_heads.float(), k_heads.float(), vc.float(), do_chunks.float(), bc.float(), gamma.float(), f32(A0),
              op(h * unit_u), op(dh_out * unit_d), op(Vn * unit_u), op(dVn * unit_d),
              unit_u.view(NC, hv).contiguous(), unit_d.view(NC, hv).contiguous(), K ** -0.5)
    return want, inputs


def nan_like(*shape):
    return torch.full(shape, float("nan"), dtype=torch.float32, device=DEV)


# the library variants: the backward's (walking CTAs), and the others it could choose instead
VARIANTS = chunk_kernels.variants_for(K, V)
assert chunk_kernels.spec_for(K, V) in VARIANTS.values()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_float64_step3(name, variant):
    seqlens, hqk, hv = KERNEL_CASES[name][:3]
    for seed in range(3):
        want, inputs = per_chunk_case(100 * seed + 3, *KERNEL_CASES[name])
        NC = inputs[0].shape[0]
        out = (nan_like(NC, hqk, 64, K), nan_like(NC, hqk, 64, K), nan_like(NC, hv, 64, V), nan_like(NC, hv, 64),
               nan_like(NC, hv, 64))
        got = chunk_kernels.chunk_gradients(*inputs, out=out, spec=VARIANTS[variant])
        torch.cuda.synchronize()
        parts = []
        for what, g, w in zip(OUTPUTS, got, want):
            assert g is not None and torch.isfinite(g).all(), f"{name} seed={seed}: {what} has non-finite elements"
            err = rel_l2(g.double(), w)
            parts.append(f"{what}={err:.2e}")
            assert err < KERNEL_BAR, f"{name} seed={seed}: {what} relative L2 {err:.2e} >= {KERNEL_BAR}"
        line = f"chunk {variant} {name:24s} seed={seed} " + " ".join(parts)
        print(line)
        LOG.append(line)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_repeated_and_shared_qk_heads_agree(variant):
    """q and k per q/k head (each v-head reads its own) or repeated over the v-heads: the same bits,
    dq and dk summed over the v-heads in their order (the kernel's sum) from the repeated run's
    per-v-head ones; and the same bits again on a second run (no atomics)."""
    _, inputs = per_chunk_case(9, [300, 130], 2, 8, "mixed", True, True, 1.0, "unit")
    spec = VARIANTS[variant]
    shared = chunk_kernels.chunk_gradients(*inputs, spec=spec)
    again = chunk_kernels.chunk_gradients(*inputs, spec=spec)
    q, k = (x.repeat_interleave(4, dim=1).contiguous() for x in inputs[:2])
    repeated = list(chunk_kernels.chunk_gradients(q, k, *inputs[2:], spec=spec))
    torch.cuda.synchronize()
    for i in (0, 1):   # per v-head -> per q/k head, v-head by v-head
        heads = repeated[i].view(repeated[i].shape[0], 2, 4, *repeated[i].shape[2:])
        total = heads[:, :, 0]
        for j in range(1, 4):
            total = total + heads[:, :, j]
        repeated[i] = total
    for what, a, b, c in zip(OUTPUTS, shared, repeated, again):
        assert torch.equal(a, b), what
        assert torch.equal(a, c), what


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["qk", "vd", "both"])
def test_16_bit_inputs_give_the_bits_of_their_fp32_copies(which, dtype, variant):
    """q, k (which "qk") and v, dO ("vd") read in the call's 16-bit dtype, in place through the
    chunk views' strides: the same bits as the kernel gives on fp32 copies of the same values (the
    kernel widens them exactly, then scales and rounds as it does fp32 inputs)."""
    _, inputs = per_chunk_case(21, [3000, 64, 129], 2, 8, "mixed", True, True, 1.0, "unit")  # 400 tiles
    narrow = list(inputs)
    for i in {"qk": (0, 1), "vd": (2, 3), "both": (0, 1, 2, 3)}[which]:
        narrow[i] = inputs[i].to(dtype)              # strides kept: views of token rows
        assert narrow[i].stride() == inputs[i].stride()
    wide = [x.float() if i < 4 else x for i, x in enumerate(narrow)]
    got = chunk_kernels.chunk_gradients(*narrow, spec=VARIANTS[variant])
    want = chunk_kernels.chunk_gradients(*wide, spec=VARIANTS[variant])
    torch.cuda.synchronize()
    for what, a, b in zip(OUTPUTS, got, want):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"{which} {dtype}: {what}"


def test_walking_ctas_give_the_bits_of_one_cta_a_tile():
    """The walk variant (one CTA per SM, several tiles each, the next tile's inputs fetched ahead)
    computes each tile as the one-CTA-a-tile kernel does: the same bits."""
    _, inputs = per_chunk_case(24, [3000, 64, 129], 2, 8, "mixed", True, True, 1.0, "unit")
    narrow = [x.bfloat16() if i < 4 else x for i, x in enumerate(inputs)]
    got = chunk_kernels.chunk_gradients(*narrow, spec=VARIANTS["wg2-walk"])
    want = chunk_kernels.chunk_gradients(*narrow, spec=VARIANTS["wg2"])
    torch.cuda.synchronize()
    for what, a, b in zip(OUTPUTS, got, want):
        assert torch.isfinite(a).all() and torch.equal(a, b), what


def test_inputs_the_kernel_cannot_read_in_place_are_refused():
    _, inputs = per_chunk_case(22, [130], 1, 2, "mixed", True, True, 1.0, "unit")
    args = list(inputs)
    args[1] = inputs[1].bfloat16()                  # k's dtype is not q's
    with pytest.raises(ValueError, match="k: expected a torch.float32 tensor"):
        chunk_kernels.chunk_gradients(*args)
    args = list(inputs)
    wide = torch.zeros(*inputs[2].shape[:-1], V + 4, device=DEV)
    args[2] = wide[..., 4:]                         # columns start 16 bytes in: whole pieces, fine
    chunk_kernels.chunk_gradients(*args)
    args[2] = wide.bfloat16()[..., 4:]              # 8 bytes in: not a 16-byte piece
    args[3] = inputs[3].bfloat16()
    with pytest.raises(ValueError, match="v: the kernel reads its rows in 16-byte pieces"):
        chunk_kernels.chunk_gradients(*args)
    args[2] = inputs[2].double()
    with pytest.raises(ValueError, match="v: expected a torch.float32 or torch.float16 or torch.bfloat16 tensor"):
        chunk_kernels.chunk_gradients(*args)


# name: (seqlens, hqk, hv, dtype, decay, h0, dht, layout_vk, l2norm, output gradient size[, the
# forward call's warm-up table: the chains split the long sequences as the forward's CP does])
OP_CASES = {
    "gva_varlen_tails_bf16": ([1, 17, 63, 64, 65, 0, 127, 900, 5, 129], 2, 8, torch.bfloat16, "mixed", True, True,
                              False, False, 1.0),
    "gva_varlen_tails_fp16": ([1, 17, 63, 64, 65, 0, 127, 900, 5, 129], 2, 8, torch.float16, "mixed", True, True,
                              False, False, 1.0),
    "state_v_first": ([700, 1049], 2, 8, torch.bfloat16, "mixed", True, True, True, False, 1.0),
    "l2norm_in_kernel": ([777, 900], 4, 16, torch.bfloat16, "mixed", True, True, False, True, 1.0),
    "strong_decay": ([2000], 2, 8, torch.bfloat16, "strong", True, True, False, False, 1.0),
    "weak_decay": ([2000], 2, 8, torch.bfloat16, "weak", True, True, False, False, 1.0),
    "zero_decay_no_state": ([1500], 2, 8, torch.bfloat16, "zero", False, False, False, False, 1.0),
    "zero_decay_long": ([16384], 2, 4, torch.bfloat16, "zero", True, True, False, False, 1.0),
    "tiny_output_gradients": ([900, 333], 2, 8, torch.bfloat16, "mixed", True, True, False, False, 3e-8),
    "large_output_gradients": ([900, 333], 2, 8, torch.bfloat16, "mixed", True, True, False, False, 3e3),
    "split_chains": ([16384, 3000, 70], 2, 8, torch.bfloat16, "mixed", True, True, False, False, 1.0, [8] * 8),
}


def issue_bar(n, fla):
    return FLOOR[n]


def kernel_case(name, seed):
    seqlens, hqk, hv, dtype, decay, h0, dht, vk, l2norm, size, *warmup = OP_CASES[name]
    leaves, do, dfinal, cu = make_case(seed, seqlens, hqk, hv, dtype, decay, h0, dht, vk, l2norm)
    if size != 1.0:
        do, dfinal = (do.float() * size).to(do.dtype), None if dfinal is None else dfinal * size
    return leaves, do, dfinal, cu, vk, l2norm, (warmup or [None])[0]


def refuse_torch_step3(*args, **kwargs):
    raise AssertionError("the torch step 3 ran on the kernel path")


@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_gradients_with_the_chunk_kernel_match_float64(name, monkeypatch):
    for seed in range(3):
        leaves, do, dfinal, cu, vk, l2norm, warmup = kernel_case(name, 1000 * seed + 31)
        with monkeypatch.context() as m:
            m.setattr(chunked_torch, "per_chunk_gradients", refuse_torch_step3)
            grads = op_backward(leaves, do, dfinal, cu, vk, l2norm, warmup=warmup)
        line = f"op {name:24s} seed={seed} " + check_against_oracle(name, seed, grads, leaves, do, dfinal, cu, vk,
                                                                       l2norm, issue_bar)
        print(line)
        LOG.append(line)


def test_without_the_library_auto_runs_the_torch_step3(monkeypatch):
    name = "gva_varlen_tails_bf16"
    leaves, do, dfinal, cu, vk, l2norm, _ = kernel_case(name, 77)
    tries = []

    def unavailable(spec):
        tries.append(spec)
        raise chunk_kernels.ChunkKernelError("no nvcc here (test double)")

    monkeypatch.setattr(chunk_kernels.LIBRARIES, "get", unavailable)
    monkeypatch.setattr(chunked_torch, "_LIBRARY_FAILURES", {})
    with pytest.warns(RuntimeWarning, match="no nvcc here .* per-chunk gradients in torch"):
        without = op_backward(leaves, do, dfinal, cu, vk, l2norm)
    op_backward(leaves, do, dfinal, cu, vk, l2norm)  # remembered: no second try
    assert len(tries) == 1
    print(f"fallback {name} " + check_against_oracle(name, 77, without, leaves, do, dfinal, cu, vk, l2norm, issue_bar))
    with pytest.raises(chunk_kernels.ChunkKernelError, match="no nvcc"):
        chunked_torch._chunk_library_or_none("kernels", K, V)
