"""The vLLM and SGLang routes on the H200: each stack's GDN prefill call, made with the conventions
tests/fixtures/serving_call_sites.py records (stand-ins of the stacks from tests/serving_doubles.py;
neither stack is installed), runs on our kernels and is checked against the float64 oracle.

vLLM: q, k L2-normalised by the caller, initial states gathered from a v-first pool with the rows
of new requests zeroed, int32 offsets, FLA's chunk metadata, a NaN-poisoned core_attn_out.
SGLang: q, k unnormalised (normalised in the kernel), the whole bf16 v-first pool and one slot per
request, updated in place. Bar: o and the final states within rel L2 1e-2 of float64 (DESIGN.md's
cap), over three draws; the stacks' own kernels (the stand-ins' fallbacks) never run.

Ops: a v-first pack of the shipped model when `build_pack` takes `state_layout` (the pack's
calibration maps the call's decoder layer to its GDN layer), and always the op's default plan
behind a pack-shaped test double.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from gdn_inputs import gate_values, rel_l2  # noqa: E402
from serving_doubles import gdn_layer, install_sglang_stand_ins, install_vllm_stand_ins  # noqa: E402

from flashqla_tune import ops as op_module  # noqa: E402
from flashqla_tune.integrations import sglang as sglang_route  # noqa: E402
from flashqla_tune.integrations import vllm as vllm_route  # noqa: E402
from flashqla_tune.oracle import chunk_gated_delta_rule_chunked  # noqa: E402

DEV = "cuda"
HQK, HV, D = 2, 8, 128
SEQLENS = [777, 1, 64, 1200]  # a tail, one token, a full chunk, a long sequence
BAR = 1e-2


class DefaultPlanOps:
    """Pack-shaped test double over the pack-less op (its default v-first plan and guarded default
    window): the calibration map puts GDN layer l at decoder layer 2l + 1."""

    def __init__(self, layers=3):
        self.calibration = types.SimpleNamespace(
            layers=[types.SimpleNamespace(layer=i, decoder_layer=2 * i + 1) for i in range(layers)])
        spec = types.SimpleNamespace(state_layout="vk")
        self.plans = [types.SimpleNamespace(plan=types.SimpleNamespace(spec=spec))]
        self.layers_seen = []

    def chunk_gated_delta_rule(self, *args, layer=None, **kwargs):
        self.layers_seen.append(layer)
        return op_module.chunk_gated_delta_rule(*args, **kwargs)


@pytest.fixture(scope="module", params=["vk_pack", "default_plan"])
def serving_ops(request, tmp_path_factory):
    if request.param == "default_plan":
        return DefaultPlanOps()
    from flashqla_tune.pack_build import build_pack
    from flashqla_tune.packed_ops import load

    pytest.importorskip("transformers")  # the build calibrates the shipped model through its layers
    from flashqla_tune.calibrate.default_model import default_model_path

    out = tmp_path_factory.mktemp("pack") / "vk_pack"
    build_pack(default_model_path(), out, tune=False, progress=False, state_layout="vk")
    return load(out)


def draw(seed, normalised):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(SEQLENS)
    q = torch.randn(1, T, HQK, D, generator=gen, device=DEV)
    k = torch.randn(1, T, HQK, D, generator=gen, device=DEV)
    if normalised:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(1, T, HV, D, generator=gen, device=DEV)
    g = gate_values("mixed", (1, T, HV), gen, torch.float32)
    beta = torch.rand(1, T, HV, generator=gen, device=DEV)
    pool = torch.randn(11, HV, D, D, generator=gen, device=DEV)  # [slots, Hv, V, K]
    cu = torch.tensor([0] + torch.tensor(SEQLENS).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, pool, cu


def oracle(q, k, v, g, beta, h0, cu, l2norm):
    return chunk_gated_delta_rule_chunked(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                          scale=D ** -0.5, initial_state=h0.double(), output_final_state=True,
                                          use_qk_l2norm_in_kernel=l2norm, state_v_first=True,
                                          cu_seqlens=cu.long())


def decoder_layer_of(serving_ops):
    return serving_ops.calibration.layers[-1].decoder_layer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vllm_prefill_call_on_our_op_matches_the_oracle(serving_ops, monkeypatch, seed):
    fake = install_vllm_stand_ins(monkeypatch)
    vllm_route.install("/serving-pack", load=lambda pack, rank, size: serving_ops, tp=lambda: (0, 1))
    layer = gdn_layer(fake, f"model.layers.{decoder_layer_of(serving_ops)}.linear_attn")
    q, k, v, g, beta, pool, cu = draw(seed, normalised=True)
    slots = torch.tensor([7, 2, 9, 4], device=DEV)  # vLLM's prefill_state_indices
    initial_state = pool[slots]
    initial_state[torch.tensor([False, True, False, False], device=DEV)] = 0  # a new request
    out = torch.full((q.shape[1], HV, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    o, final = layer.chunk_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, output_final_state=True, cu_seqlens=cu,
        chunk_indices=torch.zeros(1, 2, dtype=torch.int32, device=DEV),
        chunk_offsets=torch.zeros(len(SEQLENS) + 1, dtype=torch.int32, device=DEV),
        use_qk_l2norm_in_kernel=False, core_attn_out=out)
    torch.cuda.synchronize()
    assert not fake.fallback_calls
    o_ref, f_ref = oracle(q, k, v, g, beta, initial_state, cu, l2norm=False)
    assert o.shape == (1, q.shape[1], HV, D) and final.shape == (len(SEQLENS), HV, D, D)
    err_o, err_buf, err_s = rel_l2(o, o_ref), rel_l2(out.unsqueeze(0), o_ref), rel_l2(final, f_ref)
    assert err_o < BAR and err_buf < BAR and err_s < BAR, f"o {err_o:.2e}, core_attn_out {err_buf:.2e}, " \
                                                          f"state {err_s:.2e}"
    if isinstance(serving_ops, DefaultPlanOps):
        assert serving_ops.layers_seen[-1] == len(serving_ops.calibration.layers) - 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sglang_extend_call_on_our_op_matches_the_oracle(serving_ops, monkeypatch, seed):
    fake = install_sglang_stand_ins(monkeypatch)
    sglang_route.install("/serving-pack", load=lambda pack, rank, size: serving_ops, tp=lambda: (0, 1))
    backend = fake.GDNAttnBackend()
    q, k, v, g, beta, pool, cu = draw(seed + 10, normalised=False)
    pool = pool.bfloat16()  # SGLang's default state dtype
    before = pool.clone()
    slots = torch.tensor([3, 0, 10, 6], device=DEV)
    batch = types.SimpleNamespace(q=q, k=k, v=v, g=g, beta=beta, pool=pool, cache_indices=slots,
                                  query_start_loc=cu, extra={})
    o = backend.forward_extend(types.SimpleNamespace(layer_id=decoder_layer_of(serving_ops)), batch, None, None,
                               None)
    torch.cuda.synchronize()
    assert not backend.kernel_dispatcher.extend_kernel.fallback.calls
    o_ref, f_ref = oracle(q, k, v, g, beta, before[slots], cu, l2norm=True)
    err_o, err_s = rel_l2(o, o_ref), rel_l2(pool[slots], f_ref)
    assert err_o < BAR and err_s < BAR, f"o {err_o:.2e}, pool state {err_s:.2e}"
    others = [s for s in range(pool.shape[0]) if s not in slots.tolist()]
    assert torch.equal(pool[others], before[others])
