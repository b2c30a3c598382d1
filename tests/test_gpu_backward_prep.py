"""The backward's prep kernel (csrc/gdn_bwd_prep.cuh via backward.prep_kernels) on the H200.

1. Every output against the torch pieces of chunked_torch (the code the kernel replaces) computed
   in float64 on the same inputs: w, Kd, D Q (16-bit), u, scale P^T dO (fp32, written in the chain
   kernels' add tiles), A = Gamma * A0 and A0 (fp32) below 2e-3 relative L2, gamma and e^{gamma_C} below 1e-5. Outputs NaN-poisoned first;
   three fresh draws per case; the chunk grid built on the device (device_chunk_grid, as the
   backward builds it), so tails not a multiple of 64, empty and one-token sequences and the
   grid's spare chunks (zero inputs: A = A0 = I, the rest zero, e^0 = 1) are all covered; GVA;
   strong, weak and zero decay; beta drawn with zeros among it (every fifth token, one head
   entirely). The inputs are what chunked_torch hands the kernel: q and k in the chunk layout in
   the operand dtype, v and dO as to_chunks' fp32 views (not contiguous; the kernel folds
   the op's scale into P^T dO), g and beta contiguous; the reference takes the float64 values before any rounding.
   v and dO once as 16-bit views, which must give the bits of their fp32 copies.
2. A tiny and a large dO (a training step's output gradient, a large loss scale): P^T dO keeps its
   relative accuracy (the kernel scales dO's tile by a power of two before rounding it).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from gdn_inputs import float64_tokens, rel_l2  # noqa: E402

from flashqla_tune.backward import chain_kernels, chunked_torch, prep_kernels  # noqa: E402
from flashqla_tune.oracle.chunked import decay_mask, gate_free_inverse  # noqa: E402

DEV = "cuda"
K = V = 128
KERNEL_BAR = 2e-3   # 16-bit operands (and outputs), fp32 accumulation
GATE_BAR = 1e-5     # fp32 scans and exponentials
BLOCK_V = prep_kernels.spec_for(K, V).add_block_v   # the add tiles' width
LOG = []

# name: (seqlens, hqk, hv, decay)
CASES = {
    "gva_varlen_tails_mixed": ([1, 17, 63, 64, 65, 0, 127, 700, 5, 129], 2, 8, "mixed"),
    "strong_decay": ([1000], 1, 4, "strong"),
    "weak_decay": ([1500, 333], 2, 4, "weak"),
    "zero_decay": ([1200], 2, 4, "zero"),
    "one_sequence_many_heads": ([640], 4, 32, "mixed"),
    "no_gva": ([300, 77], 4, 4, "mixed"),
}


def reference_pieces(qc, kc, vc, dOs, gc, bc, group, dout_scale=K ** -0.5):
    """chunked_torch's state-independent pieces (its code, in the inputs' float64; D Q times the
    mantissa of the op's scale, as the backward has the kernel write it for the chains), and the
    tiles' largest |dO| (without the scale) and |u|."""
    qc, kc = qc.repeat_interleave(group, dim=1), kc.repeat_interleave(group, dim=1)
    gamma = gc.cumsum(-1)
    gamma_last = gamma[..., -1]
    Gamma = decay_mask(gamma)
    A0 = gate_free_inverse(kc, bc)
    A = Gamma * A0
    Tm = A * bc[..., None, :]
    d = gamma.exp()[..., None]
    f = (gamma_last[..., None] - gamma).exp()[..., None]
    P = Gamma * (qc @ kc.transpose(-1, -2))
    u = Tm @ vc
    return dict(w=Tm @ (d * kc), kd=f * kc, qd=chunked_torch.split_scale(dout_scale)[0] * d * qc, u=u, ptdo=P.transpose(-1, -2) @ dOs,
                decay=gamma_last.exp(), gamma=gamma, a=A, a0=A0, dout_amax=dOs.abs().amax(dim=(2, 3)) / dout_scale,
                u_amax=u.abs().amax(dim=(2, 3)))


def draw(seed, seqlens, hqk, hv, decay, do_size=1.0):
    """float64 token inputs, the device-built chunk grid, and both the kernel's and the reference's
    chunk-layout inputs."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(seqlens)
    f64 = torch.float64
    q, k, v, g, beta = float64_tokens(gen, T, hqk, hv, K, V, decay, DEV)
    beta[::5] = 0.0
    beta[:, -1] = 0.0
    do = do_size * torch.randn(T, hv, V, generator=gen, device=DEV, dtype=f64)
    offsets = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int64, device=DEV)
    grid = chunked_torch.device_chunk_grid(offsets, T)
    to_c = lambda x: chunked_torch.to_chunks(x, grid)  # noqa: E731
    scale = K ** -0.5
    op = prep_kernels.spec_for(K, V).torch_dtype
    ref_in = dict(qc=to_c(q), kc=to_c(k), vc=to_c(v), dOs=scale * to_c(do), gc=to_c(g), bc=to_c(beta))
    # as chunked_torch builds them: fp32 token rows, chunked; q, k rounded to the operand dtype
    f32 = {n: x.float() for n, x in dict(q=q, k=k, v=v, do=do, g=g, beta=beta).items()}
    kernel_in = dict(q=to_c(f32["q"]).to(op, memory_format=torch.contiguous_format),
                     k=to_c(f32["k"]).to(op, memory_format=torch.contiguous_format),
                     v=to_c(f32["v"]), dout=to_c(f32["do"]), dout_scale=scale,
                     qd_scale=chunked_torch.split_scale(scale)[0],
                     g=to_c(f32["g"]).contiguous(), beta=to_c(f32["beta"]).contiguous())
    return grid, ref_in, kernel_in


def poisoned(NC, Hv, op):
    nan = lambda *s, dt=torch.float32: torch.full(s, float("nan"), dtype=dt, device=DEV)  # noqa: E731
    return prep_kernels.PrepPieces(
        w=nan(NC, Hv, 64, K, dt=op), kd=nan(NC, Hv, 64, K, dt=op), qd=nan(NC, Hv, 64, K, dt=op),
        u=nan(NC, Hv, V // BLOCK_V, 64, BLOCK_V), ptdo=nan(NC, Hv, V // BLOCK_V, 64, BLOCK_V), decay=nan(NC, Hv), gamma=nan(NC, Hv, 64),
        a=nan(NC, Hv, 64, 64), a0=nan(NC, Hv, 64, 64), dout_amax=nan(NC, Hv), u_amax=nan(NC, Hv))


def compare(name, seed, got, want, only=None) -> str:
    parts = []
    for what, ref in want.items():
        if only is not None and what not in only:
            continue
        out = getattr(got, what)
        if what in ("u", "ptdo"):   # the add tiles, back to [chunks, Hv, 64, V]
            out = chain_kernels.from_add_tiles(out)
        assert torch.isfinite(out).all(), f"{name} seed={seed}: {what} has non-finite (unwritten) elements"
        err = rel_l2(out.double(), ref)
        bar = GATE_BAR if what in ("gamma", "decay", "dout_amax") else KERNEL_BAR
        parts.append(f"{what}={err:.2e}")
        assert err < bar, f"{name} seed={seed}: {what} relative L2 {err:.2e} >= {bar}"
    return " ".join(parts)


@pytest.mark.parametrize("name", list(CASES))
def test_prep_kernel_matches_float64_torch_pieces(name):
    seqlens, hqk, hv, decay = CASES[name]
    op = prep_kernels.spec_for(K, V).torch_dtype
    for seed in range(3):
        grid, ref_in, kernel_in = draw(100 * seed + 11, seqlens, hqk, hv, decay)
        NC = grid.num_chunks
        got = prep_kernels.backward_prep(**kernel_in, out=poisoned(NC, hv, op))
        torch.cuda.synchronize()
        want = reference_pieces(**ref_in, group=hv // hqk)
        line = f"prep {name:26s} seed={seed} " + compare(name, seed, got, want)
        # the grid's spare chunks (no sequence: zero inputs) come out as the torch pieces give them
        spare = torch.arange(NC, device=DEV) >= grid.chunk_offsets[-1]
        eye = torch.eye(64, device=DEV)
        assert torch.allclose(got.a[spare], eye.expand_as(got.a[spare]), rtol=0, atol=1e-6), name
        assert torch.equal(got.a0[spare], eye.expand_as(got.a0[spare])), name
        assert (got.decay[spare] == 1).all() and (got.gamma[spare] == 0).all(), name
        assert all((t[spare] == 0).all() for t in (got.w, got.kd, got.qd, got.u, got.ptdo, got.dout_amax, got.u_amax)), name
        # u's largest magnitude is the stored u's, exactly (the chains' unit for u is taken from it)
        assert torch.equal(got.u_amax, chunked_torch.tile_amax(got.u)), name
        print(line)
        LOG.append(line)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_values_give_the_bits_of_their_fp32_copies(dtype):
    """v and dO in the call's 16-bit dtype, read in place through the chunk views' strides: the
    same bits as on fp32 copies of the same values."""
    op = prep_kernels.spec_for(K, V).torch_dtype
    grid, _, kernel_in = draw(23, [300, 64, 129], 2, 8, "mixed")
    narrow = dict(kernel_in, v=kernel_in["v"].to(dtype), dout=kernel_in["dout"].to(dtype))
    wide = dict(kernel_in, v=narrow["v"].float(), dout=narrow["dout"].float())
    assert narrow["v"].stride() == kernel_in["v"].stride()   # views of token rows, not copies
    got = prep_kernels.backward_prep(**narrow, out=poisoned(grid.num_chunks, 8, op))
    want = prep_kernels.backward_prep(**wide, out=poisoned(grid.num_chunks, 8, op))
    torch.cuda.synchronize()
    for what in ("w", "kd", "qd", "u", "ptdo", "decay", "gamma", "a", "a0", "dout_amax", "u_amax"):
        a, b = getattr(got, what), getattr(want, what)
        assert torch.isfinite(a).all() and torch.equal(a, b), f"{dtype}: {what}"


def test_a_nan_in_v_or_do_reaches_its_tiles_terms():
    """The chains' unit for dO comes from dout_amax, which does not see a NaN; the NaN itself
    reaches u and P^T dO of its tile (so the chains' results for that sequence are non-finite,
    never scaled to look finite)."""
    op = prep_kernels.spec_for(K, V).torch_dtype
    grid, _, kernel_in = draw(29, [300], 1, 2, "mixed")
    v, dout = kernel_in["v"].clone(), kernel_in["dout"].clone()
    v[2, 0, 5, 7] = float("nan")
    dout[3, 0, 9, 100] = float("nan")
    got = prep_kernels.backward_prep(**dict(kernel_in, v=v, dout=dout), out=poisoned(grid.num_chunks, 2, op))
    torch.cuda.synchronize()
    u, ptdo = chain_kernels.from_add_tiles(got.u), chain_kernels.from_add_tiles(got.ptdo)
    assert torch.isnan(u[2, 0]).any() and torch.isnan(ptdo[3, 0]).any()
    assert torch.isfinite(got.dout_amax).all() and torch.isfinite(got.u_amax).all()


@pytest.mark.parametrize("do_size", [3e-9, 3e4])
def test_output_gradient_magnitude_does_not_decide_accuracy(do_size):
    op = prep_kernels.spec_for(K, V).torch_dtype
    grid, ref_in, kernel_in = draw(5, [700, 129], 2, 4, "mixed", do_size=do_size)
    got = prep_kernels.backward_prep(**kernel_in, out=poisoned(grid.num_chunks, 4, op))
    torch.cuda.synchronize()
    want = reference_pieces(**ref_in, group=2)
    line = f"prep do_size={do_size:.0e} " + compare("do_size", 0, got, want, only=("ptdo",))
    print(line)
    LOG.append(line)


def test_inverses_are_written_only_when_asked_for():
    grid, _, kernel_in = draw(7, [200], 1, 2, "mixed")
    got = prep_kernels.backward_prep(**kernel_in, gated_inverse=False, gate_free_inverse=False)
    torch.cuda.synchronize()
    assert got.a is None and got.a0 is None and torch.isfinite(got.u).all()


@pytest.mark.parametrize("l2norm", [False, True])
def test_the_backward_with_the_prep_kernel_gives_the_torch_pieces_gradients(l2norm, monkeypatch):
    """chunked_torch on CUDA takes its state-independent pieces from the prep kernel (one call) and
    gives the gradients it gives with the torch pieces (the chain kernels in both): relative L2 of
    each gradient below 3e-3."""
    from test_gpu_backward import make_case

    leaves, do, dfinal, cu = make_case(31, [1, 63, 700, 0, 129], 2, 8, torch.bfloat16, "mixed", True, True, False,
                                       l2norm)
    args = dict(q=leaves["q"], k=leaves["k"], v=leaves["v"], g=leaves["g"], beta=leaves["beta"], do=do, dht=dfinal,
                scale=K ** -0.5, initial_state=leaves["initial_state"], use_qk_l2norm_in_kernel=l2norm,
                cu_seqlens=cu, sequential="kernels")
    calls = []
    launch = prep_kernels.backward_prep

    def counted(*a, **kw):
        calls.append(1)
        return launch(*a, **kw)

    monkeypatch.setattr(prep_kernels, "backward_prep", counted)
    got = chunked_torch.chunk_gated_delta_rule_bwd_torch(**args)
    assert len(calls) == 1
    monkeypatch.setattr(chunked_torch, "_prep_library_or_none", lambda *a: None)   # the torch pieces
    want = chunked_torch.chunk_gated_delta_rule_bwd_torch(**args)
    torch.cuda.synchronize()
    parts = []
    for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
        a, b = getattr(got, n), getattr(want, n)
        assert torch.isfinite(a).all(), n
        err = rel_l2(a.double(), b.double())
        parts.append(f"{n}={err:.2e}")
        assert err < 3e-3, (n, err)
    line = f"prep op l2norm={l2norm} " + " ".join(parts)
    print(line)
    LOG.append(line)
