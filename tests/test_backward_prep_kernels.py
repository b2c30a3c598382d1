"""The Python side of the backward's prep kernel, on the CPU: the template's constants, the specs it
refuses, the launch's checks, and the backward taking its pieces from the kernel (a torch stand-in
here). Its build: tests/test_backward_kernel_builds.py; its results: tests/test_gpu_backward_prep.py.
"""
from __future__ import annotations


import pytest
import torch

from flashqla_tune.backward import prep_kernels
from flashqla_tune.backward.prep_kernels import PrepSpec


SPEC = PrepSpec()  # what the backward uses at K = V = 128


def test_template_only_fixes_constants():
    text = prep_kernels.render_source(PrepSpec(operand_dtype="bfloat16", head_v_dim=64))
    assert '#include "gdn_bwd_prep_host.cuh"' in text
    assert "fqt::BwdPrepConfig<cutlass::bfloat16_t, /*K=*/128, /*V=*/64,\n" in text
    assert "/*AddBlockV=*/64>" in text
    assert f"FQT_BWD_PREP_ABI_VERSION == {prep_kernels.ABI_VERSION}" in text


@pytest.mark.parametrize("bad, match", [
    (dict(operand_dtype="float32"), "operand_dtype"), (dict(head_k_dim=64), "head_k_dim"),
    (dict(head_v_dim=256), "head_v_dim"), (dict(head_v_dim=64, add_block_v=128), "add_block_v"),
    (dict(add_block_v=32), "add_block_v")])
def test_spec_refuses_what_the_kernel_does_not_instantiate(bad, match):
    with pytest.raises(ValueError, match=match):
        PrepSpec(**bad)


def test_spec_for_follows_the_chain_kernels():
    from flashqla_tune.backward import chain_kernels

    assert prep_kernels.spec_for(128, 128) == SPEC
    chain = chain_kernels.spec_for(128, 128)
    assert (SPEC.torch_dtype, SPEC.add_block_v) == (chain.torch_dtype, chain.block_v)
    with pytest.raises(ValueError, match="built for"):
        prep_kernels.spec_for(256, 256)


def _inputs(NC=3, Hqk=1, Hv=2, device="cpu"):
    f16 = torch.float16
    return dict(q=torch.zeros(NC, Hqk, 64, 128, dtype=f16, device=device),
                k=torch.zeros(NC, Hqk, 64, 128, dtype=f16, device=device),
                v=torch.zeros(NC, Hv, 64, 128, device=device), dout=torch.zeros(NC, Hv, 64, 128, device=device),
                g=torch.zeros(NC, Hv, 64, device=device), beta=torch.zeros(NC, Hv, 64, device=device))


def test_launch_refuses_tensors_it_cannot_take():
    """Checked on the host before any library is opened: CPU tensors, a wrong operand dtype, a
    value tensor whose rows are not whole 16-byte pieces."""
    x = _inputs()
    with pytest.raises(ValueError, match="q: expected a contiguous torch.float16 tensor .* on a CUDA device"):
        prep_kernels.backward_prep(**x)
    x["q"] = x["q"].bfloat16()
    with pytest.raises(ValueError, match="q: expected a contiguous torch.float16"):
        prep_kernels.backward_prep(**x)
    with pytest.raises(ValueError, match="multiple of q/k heads"):
        prep_kernels.backward_prep(**_inputs(Hqk=2, Hv=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_value_rows_must_be_whole_16_byte_pieces(dtype):
    v = torch.zeros(2, 3, 64, 136, dtype=dtype)[..., 1:129]
    with pytest.raises(ValueError, match="v: the kernel reads its rows in 16-byte pieces"):
        prep_kernels._check_rows("v", v, (2, 3, 64, 128), v.device)
    # a view of token rows ([chunks, 64, H, D] storage) is taken as it is, in the call's dtype
    view = torch.zeros(2, 64, 3, 128, dtype=dtype).transpose(1, 2)
    prep_kernels._check_rows("v", view, (2, 3, 64, 128), view.device)
    with pytest.raises(ValueError, match=f"dout: expected a tensor of shape .* of {torch.float64}"):
        prep_kernels._check_rows("dout", view, (2, 3, 64, 128), view.device, torch.float64)


def test_value_rows_of_another_dtype_are_refused():
    v = torch.zeros(2, 3, 64, 128, dtype=torch.float64)
    with pytest.raises(ValueError, match="v: the kernel reads float32, float16 or bfloat16 inputs, got torch.float64"):
        prep_kernels._check_rows("v", v, (2, 3, 64, 128), v.device)


# ---------------------------------------------------------------- the backward's wiring, on the CPU

def torch_backward_prep(q, k, v, dout, g, beta, dout_scale=1.0, gated_inverse=True, gate_free_inverse=True,
                        out=None, qd_scale=1.0):
    """A stand-in for prep_kernels.backward_prep on any device: the same outputs from the same
    inputs, computed as chunked_torch's torch pieces (fp32), the chain operands rounded to the
    operand dtype, u and P^T dO in the chain kernels' add tiles."""
    from flashqla_tune.backward import chain_kernels, chunked_torch

    from flashqla_tune.oracle.chunked import decay_mask, gate_free_inverse as inverse

    spec = prep_kernels.spec_for(q.shape[-1], v.shape[-1])
    for name, t in (("q", q), ("k", k)):   # what the kernel's TMA reads (check_tensor on the GPU)
        assert t.dtype == spec.torch_dtype and t.is_contiguous(), f"{name}: {t.dtype} strides {t.stride()}"
    group = v.shape[1] // q.shape[1]
    v, dout = v.float(), dout.float()   # the call's dtype, as the kernel reads them
    qc, kc = (x.float().repeat_interleave(group, dim=1) for x in (q, k))
    gamma = g.cumsum(-1)
    last = gamma[..., -1]
    Gamma = decay_mask(gamma)
    A0 = inverse(kc, beta)
    A = Gamma * A0
    Tm = A * beta[..., None, :]
    d, f = gamma.exp()[..., None], (last[..., None] - gamma).exp()[..., None]
    P = Gamma * (qc @ kc.transpose(-1, -2))
    op = q.dtype
    bv = prep_kernels.spec_for(q.shape[-1], v.shape[-1]).add_block_v
    return prep_kernels.PrepPieces(
        w=(Tm @ (d * kc)).to(op), kd=(f * kc).to(op), qd=(qd_scale * d * qc).to(op), u=chain_kernels.add_tiles(Tm @ v, bv),
        ptdo=chain_kernels.add_tiles(dout_scale * P.transpose(-1, -2) @ dout, bv),
        decay=last.exp(), gamma=gamma, a=A if gated_inverse else None, a0=A0 if gate_free_inverse else None,
        dout_amax=chunked_torch.tile_amax(dout), u_amax=chunked_torch.tile_amax(Tm @ v))


@pytest.mark.parametrize("name", ["varlen_tails_gva", "batched_vk_l2norm"])
def test_the_backward_takes_its_pieces_from_the_prep_kernel(name, monkeypatch):
    """With the chain kernels (their CPU stand-ins), chunked_torch takes the state-independent
    pieces from prep_kernels.backward_prep (here its torch stand-in) and gives the torch loops'
    gradients."""
    from test_backward_device_grid import CASES, NAMES, ChainKernelsDouble
    from test_backward_reference import draw

    from flashqla_tune.backward import chain_kernels, chunked_torch
    from gdn_inputs import rel_l2

    calls = []

    def prep_double(*args, **kwargs):
        calls.append(args[0].shape)
        return torch_backward_prep(*args, **kwargs)

    chains = ChainKernelsDouble()
    monkeypatch.setattr(chunked_torch, "uses_chain_kernels", lambda sequential, *a: sequential != "torch")
    monkeypatch.setattr(chunked_torch, "_chain_library_or_none", lambda *a: "library double")
    monkeypatch.setattr(chain_kernels, "chain_states", chains.chain_states)
    monkeypatch.setattr(chain_kernels, "chain_gradients", chains.chain_gradients)
    monkeypatch.setattr(prep_kernels.LIBRARIES, "get", lambda spec: "library double")
    monkeypatch.setattr(prep_kernels, "backward_prep", prep_double)
    monkeypatch.setattr(chunked_torch, "_chunk_library_or_none", lambda *a: None)  # step 3 in torch
    case = dict(CASES[name])
    case.pop("do_size", None)
    l2norm = case.get("normalised") is False
    inputs, do, dht = draw(7, K=128, V=128, dtype=torch.bfloat16, **case)
    cu = inputs.pop("cu_seqlens")
    args = dict(**inputs, do=do, dht=dht, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
    got = chunked_torch.chunk_gated_delta_rule_bwd_torch(**args)
    assert len(calls) == 1 and chains.calls == ["states", "gradients"]
    monkeypatch.undo()
    want = chunked_torch.chunk_gated_delta_rule_bwd_torch(**args, sequential="torch")
    for n in NAMES:
        a, b = getattr(got, n), getattr(want, n)
        if b is None:
            continue
        assert torch.isfinite(a).all(), (name, n)
        assert rel_l2(a.double(), b.double()) < 3e-3, (name, n, rel_l2(a.double(), b.double()))
