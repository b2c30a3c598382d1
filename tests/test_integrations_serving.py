"""The vLLM and SGLang routes on the CPU, against stand-ins of both stacks built from the call
sites recorded in tests/fixtures/serving_call_sites.py (installed into sys.modules only within
each test) and a pack test double whose op is the float64 oracle, so argument conversion,
state layout and write-back are checked by value."""
from __future__ import annotations

import importlib
import inspect
import logging
import subprocess
import sys
import tomllib
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from serving_doubles import (SITES, PackOpsDouble, gdn_layer, install_sglang_stand_ins, install_vllm_stand_ins,
                             loader_of)

from flashqla_tune.integrations import serving_calls
from flashqla_tune.integrations import sglang as sglang_route
from flashqla_tune.integrations import vllm as vllm_route
from flashqla_tune.oracle import recurrent_gated_delta_rule

ROOT = Path(__file__).resolve().parents[1]

HQK, HV, K, V = 2, 4, 16, 16


def inputs(seqlens, normalised, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(seqlens), len(seqlens)
    q = torch.randn(1, T, HQK, K, generator=gen, dtype=torch.float64)
    k = torch.randn(1, T, HQK, K, generator=gen, dtype=torch.float64)
    if normalised:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen, dtype=torch.float64)) / 8
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, g, beta, cu, N


def test_fixture_cites_sources_and_matches_the_routes():
    for site, keys in ((SITES.VLLM, ("op", "plugins")), (SITES.SGLANG, ("backend", "extend_kernel"))):
        for key in keys:
            assert len(site[key]["commit"]) == 40 and site[key]["path"]
    assert [n for n, _ in SITES.VLLM["op"]["parameters"]] == [n for n, _ in vllm_route.OP_FORWARD_PARAMETERS]
    assert dict(SITES.VLLM["op"]["parameters"]) == {
        n: (SITES.REQUIRED if d is inspect.Parameter.empty else d) for n, d in vllm_route.OP_FORWARD_PARAMETERS}
    assert SITES.VLLM["plugins"]["group"] == "vllm.general_plugins"
    assert {SITES.SGLANG["backend"]["extend_slot"], SITES.SGLANG["older_dispatcher"]["extend_slot"]} == \
        set(sglang_route.EXTEND_SLOTS)


# ---------------------------------------------------------------- vLLM

@pytest.fixture(params=["module", "class"], ids=["registry_global", "registry_on_class"])
def fake_vllm(monkeypatch, request):
    return install_vllm_stand_ins(monkeypatch, registry_on=request.param)


def vllm_call(seqlens=(70, 1, 130), seed=0):
    """The keyword arguments of vLLM's prefill call (fixture: call_site.arguments)."""
    q, k, v, g, beta, cu, N = inputs(list(seqlens), normalised=True, seed=seed)
    h0 = torch.randn(N, HV, V, K, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    h0[1] = 0  # a new request's row, zeroed by vLLM
    chunk_indices = torch.tensor([[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]], dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                chunk_indices=chunk_indices, chunk_offsets=torch.tensor([0, 2, 3, 6], dtype=torch.int32),
                use_qk_l2norm_in_kernel=False)


def test_vllm_entry_point_is_declared():
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert list(table.values()) == ["flashqla_tune.integrations.vllm:plugin"]
    module, func = table["flashqla_tune"].split(":")
    assert getattr(importlib.import_module(module), func) is vllm_route.plugin


def test_vllm_plugin_is_a_no_op_without_the_switch():
    # a fresh interpreter: the switch unset, the plugin imports nothing of vLLM (none is installed
    # here; an import attempt would raise) and registers nothing
    code = ("import os, sys; os.environ.pop('FLASHQLA_TUNE_PACK', None); "
            "from flashqla_tune.integrations.vllm import plugin; plugin(); "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang')]; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_vllm_plugin_leaves_the_registry_alone_without_the_switch(fake_vllm, monkeypatch):
    monkeypatch.delenv(serving_calls.ENV_VAR, raising=False)
    vllm_route.plugin()
    monkeypatch.setenv(serving_calls.ENV_VAR, "  ")
    vllm_route.plugin()
    assert fake_vllm.registry == {}
    assert type(fake_vllm.ChunkGatedDeltaRule()) is fake_vllm.ChunkGatedDeltaRule


def test_vllm_plugin_with_the_switch_registers_the_route_once(fake_vllm, monkeypatch):
    monkeypatch.setenv(serving_calls.ENV_VAR, "/packs/qwen-vk")
    vllm_route.plugin()
    vllm_route.plugin()  # vLLM may load plugins more than once in a process
    cls = fake_vllm.registry[vllm_route.OP_CLASS_NAME]
    assert cls.flashqla_tune_route and cls.pack_source.pack == "/packs/qwen-vk"
    op = fake_vllm.ChunkGatedDeltaRule()
    assert isinstance(op, cls) and isinstance(op, fake_vllm.ChunkGatedDeltaRule)


def test_vllm_refuses_to_sit_beside_another_replacement(fake_vllm):
    class Other(fake_vllm.ChunkGatedDeltaRule):
        pass

    fake_vllm.CustomOp.register_oot(Other, name=vllm_route.OP_CLASS_NAME)
    with pytest.raises(RuntimeError, match="already replaced"):
        vllm_route.install("/p", load=loader_of(PackOpsDouble()), tp=lambda: (0, 1))


def test_vllm_prefill_call_runs_on_the_pack_with_its_layer_and_v_first_states(fake_vllm):
    pack = PackOpsDouble()
    load = loader_of(pack)
    vllm_route.install("/packs/qwen-vk", load=load, tp=lambda: (1, 2))
    gdn_layer(fake_vllm, "model.layers.1.linear_attn")
    layer = gdn_layer(fake_vllm, "model.layers.5.linear_attn")
    call = vllm_call()
    o, final = layer.chunk_gated_delta_rule(**call)
    assert load.seen == [("/packs/qwen-vk", 1, 2)] and not fake_vllm.fallback_calls
    got = pack.calls[0]
    assert got["layer"] == 2  # decoder layer 5 is the pack's GDN layer 2
    assert got["state_v_first"] is True and got["use_qk_l2norm_in_kernel"] is False
    assert got["initial_state"] is call["initial_state"] and got["cu_seqlens"] is call["cu_seqlens"]
    assert "chunk_indices" not in got and "chunk_offsets" not in got
    o_ref, f_ref = recurrent_gated_delta_rule(call["q"], call["k"], call["v"], call["g"], call["beta"],
                                              initial_state=call["initial_state"], output_final_state=True,
                                              state_v_first=True, cu_seqlens=call["cu_seqlens"])
    assert o.shape == (1, 201, HV, V) and final.shape == (3, HV, V, K)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(final.double(), f_ref, rtol=1e-6, atol=1e-6)
    layer.chunk_gated_delta_rule(**call)
    assert len(load.seen) == 1 and pack.calls[1]["layer"] == 2  # loaded once, the layer found once


def test_vllm_positional_call_binds_in_vllms_order(fake_vllm):
    pack = PackOpsDouble()
    vllm_route.install("/p", load=loader_of(pack), tp=lambda: (0, 1))
    layer = gdn_layer(fake_vllm, "language_model.model.layers.3.linear_attn")
    c = vllm_call()
    layer.chunk_gated_delta_rule(c["q"], c["k"], c["v"], c["g"], c["beta"], c["initial_state"], False,
                                 c["cu_seqlens"])
    got = pack.calls[0]
    assert got["layer"] == 1 and got["output_final_state"] is False and got["cu_seqlens"] is c["cu_seqlens"]
    assert got["use_qk_l2norm_in_kernel"] is True  # the op's default in vLLM


def test_vllm_core_attn_out_receives_the_output(fake_vllm):
    vllm_route.install("/p", load=loader_of(PackOpsDouble()), tp=lambda: (0, 1))
    layer = gdn_layer(fake_vllm, "model.layers.1.linear_attn")
    call = vllm_call()
    buffer = torch.full((201 + 7, HV, V), float("nan"), dtype=torch.float64)  # vLLM's buffer may be longer
    o, _ = layer.chunk_gated_delta_rule(**call, core_attn_out=buffer)
    torch.testing.assert_close(buffer[:201], o.squeeze(0))
    assert torch.isnan(buffer[201:]).all()


@pytest.mark.parametrize("extra, named", [
    ({"head_first": True}, "head_first=True"),
    ({"return_intermediate_states": True}, "return_intermediate_states=True"),
    ({"cu_seqlens_cpu": [0, 3]}, "'cu_seqlens_cpu'"),
])
def test_vllm_keywords_beyond_the_op_are_refused_by_name(fake_vllm, extra, named):
    # vLLM's own backends take none of them either, so the refusal is an error, not a fallback
    pack = PackOpsDouble()
    vllm_route.install("/p", load=loader_of(pack), tp=lambda: (0, 1))
    layer = gdn_layer(fake_vllm, "model.layers.1.linear_attn")
    with pytest.raises(TypeError, match=named):
        layer.chunk_gated_delta_rule(**vllm_call(), **extra)
    assert not pack.calls and not fake_vllm.fallback_calls


def test_vllm_honoured_defaults_of_flas_keywords_pass(fake_vllm):
    pack = PackOpsDouble()
    vllm_route.install("/p", load=loader_of(pack), tp=lambda: (0, 1))
    layer = gdn_layer(fake_vllm, "model.layers.1.linear_attn")
    layer.chunk_gated_delta_rule(**vllm_call(), head_first=False, return_intermediate_states=False, scale=0.5)
    assert pack.calls[0]["scale"] == 0.5 and not fake_vllm.fallback_calls


def test_vllm_op_refusal_and_a_layer_the_pack_lacks_fall_back(fake_vllm, caplog):
    pack = PackOpsDouble(refuse="pack has no kernel for Hqk=2/Hv=4")
    vllm_route.install("/p", load=loader_of(pack), tp=lambda: (0, 1))
    layer = gdn_layer(fake_vllm, "model.layers.1.linear_attn")
    call = vllm_call()
    with caplog.at_level(logging.WARNING, logger="flashqla_tune.integrations"):
        assert layer.chunk_gated_delta_rule(**call) == ("flashinfer-output", "flashinfer-state")
        assert fake_vllm.fallback_calls[0]["initial_state"] is call["initial_state"]  # the same call, unchanged
        pack.calls.clear()
        fake_vllm.fallback_calls.clear()
        assert layer.chunk_gated_delta_rule(**vllm_call())[0] == "flashinfer-output"
    assert len([r for r in caplog.records if "no kernel" in r.getMessage()]) == 1  # logged once for two calls
    not_gdn = gdn_layer(fake_vllm, "model.layers.2.linear_attn")  # decoder layer 2 is no GDN layer
    assert not_gdn.chunk_gated_delta_rule(**vllm_call())[0] == "flashinfer-output"
    assert len(pack.calls) == 1 and len(fake_vllm.fallback_calls) == 2
    assert fake_vllm.registry[vllm_route.OP_CLASS_NAME].refusals.counts[
        "pack has no kernel for Hqk=2/Hv=4"] == 2
    reasons = list(fake_vllm.registry[vllm_route.OP_CLASS_NAME].refusals.counts)
    assert any("no kernel" in r for r in reasons) and any("decoder layer 2 is not a GDN layer" in r for r in reasons)


def test_vllm_op_outside_a_forward_uses_the_model_wide_table(fake_vllm):
    pack = PackOpsDouble()
    vllm_route.install("/p", load=loader_of(pack), tp=lambda: (0, 1))
    op = fake_vllm.ChunkGatedDeltaRule()  # no layer holds it in the forward context
    op(**vllm_call())
    assert pack.calls[0]["layer"] is None


def test_vllm_pack_without_v_first_plans_is_a_configuration_error(fake_vllm):
    pack = PackOpsDouble(layouts=("kv",))
    load = loader_of(pack)
    vllm_route.install("/packs/kv-only", load=load, tp=lambda: (0, 1))
    layer = gdn_layer(fake_vllm, "model.layers.1.linear_attn")
    for _ in range(2):
        with pytest.raises(serving_calls.PackMismatch, match="--state-layout vk"):
            layer.chunk_gated_delta_rule(**vllm_call())
    assert len(load.seen) == 1 and not pack.calls and not fake_vllm.fallback_calls


def test_decoder_layer_names():
    name = serving_calls.decoder_layer_from_name
    assert name("model.layers.12.linear_attn") == 12
    assert name("language_model.model.layers.3.linear_attn") == 3
    assert name("model.layers.1.mlp.experts.layers.7") == 7
    assert name("model.layer_norm") is None and name(None) is None and name("blocks.3.attn") is None


# ---------------------------------------------------------------- SGLang

@pytest.fixture
def fake_sglang(monkeypatch):
    return install_sglang_stand_ins(monkeypatch)


def sglang_batch(seqlens=(90, 1, 64), slots=9, cache_indices=(6, 0, 3), pool_dtype=torch.float32, extra=None):
    q, k, v, g, beta, cu, N = inputs(list(seqlens), normalised=False, seed=3)
    pool = torch.randn(slots, HV, V, K, generator=torch.Generator().manual_seed(4)).to(pool_dtype)
    return types.SimpleNamespace(q=q, k=k, v=v, g=g.float(), beta=beta.float(), pool=pool,
                                 cache_indices=torch.tensor(cache_indices), query_start_loc=cu, extra=extra or {})


def test_sglang_extend_runs_on_the_pack_and_updates_the_pool_in_place(fake_sglang):
    pack = PackOpsDouble()
    load = loader_of(pack)
    sglang_route.install("/packs/qwen-vk", load=load, tp=lambda: (0, 1))
    backend = fake_sglang.GDNAttnBackend()
    batch = sglang_batch(pool_dtype=torch.bfloat16)
    before = batch.pool.clone()
    o = backend.forward_extend(types.SimpleNamespace(layer_id=3), batch, None, None, None)
    got = pack.calls[0]
    assert got["layer"] == 1 and got["state_v_first"] is True and got["use_qk_l2norm_in_kernel"] is True
    assert got["output_final_state"] is True and got["cu_seqlens"] is batch.query_start_loc
    assert batch.returned == (None, None)  # the pool already holds the final states; no per-chunk states
    h0 = before[batch.cache_indices]
    o_ref, f_ref = recurrent_gated_delta_rule(batch.q, batch.k, batch.v, batch.g, batch.beta, initial_state=h0,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True,
                                              state_v_first=True, cu_seqlens=batch.query_start_loc)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(batch.pool[batch.cache_indices], f_ref.to(torch.bfloat16))
    untouched = [s for s in range(9) if s not in (6, 0, 3)]
    assert torch.equal(batch.pool[untouched], before[untouched])
    assert backend.kernel_dispatcher.extend_kernel.layer_id is None  # reset after the call
    assert load.seen == [("/packs/qwen-vk", 0, 1)]


def test_sglang_padding_slots_read_zeros_and_write_nothing(fake_sglang):
    # -1 is SGLang's PAD_SLOT_ID; as a plain index it is the pool's last slot, another request's state
    pack = PackOpsDouble()
    sglang_route.install("/p", load=loader_of(pack), tp=lambda: (0, 1))
    batch = sglang_batch(seqlens=(90, 0, 64), cache_indices=(6, -1, 3))
    before = batch.pool.clone()
    fake_sglang.GDNAttnBackend().forward_extend(types.SimpleNamespace(layer_id=1), batch, None, None, None)
    h0 = pack.calls[0]["initial_state"]
    assert torch.equal(h0[1], torch.zeros_like(h0[1])) and torch.equal(h0[0], before[6])
    _, f_ref = recurrent_gated_delta_rule(batch.q, batch.k, batch.v, batch.g, batch.beta, initial_state=h0,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          state_v_first=True, cu_seqlens=batch.query_start_loc)
    torch.testing.assert_close(batch.pool[[6, 3]], f_ref[[0, 2]].float())
    untouched = [s for s in range(9) if s not in (6, 3)]
    assert torch.equal(batch.pool[untouched], before[untouched])  # slot 8 (index -1) included


def test_sglang_state_gather_and_scatter_never_read_the_device_on_the_host():
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                HostReads.seen += 1
            return func(*args, **(kwargs or {}))

    pool, idx = torch.randn(5, 2, 8, 8), torch.tensor([3, -1, 0])
    with HostReads():
        sglang_route.scatter_states(pool, idx, sglang_route.gather_states(pool, idx))
    assert HostReads.seen == 0


def test_sglang_a_batch_of_padding_alone_leaves_the_pool():
    pool = torch.randn(5, 2, 8, 8)
    before = pool.clone()
    sglang_route.scatter_states(pool, torch.tensor([-1, -1]), torch.randn(2, 2, 8, 8))
    sglang_route.scatter_states(pool, torch.tensor([], dtype=torch.int64), torch.randn(0, 2, 8, 8))
    assert torch.equal(pool, before)
    assert torch.equal(sglang_route.gather_states(pool, torch.tensor([-1, 2]))[1], pool[2])


def test_sglang_decode_and_the_older_dispatcher_slot(fake_sglang):
    pack = PackOpsDouble()
    sglang_route.install("/p", load=loader_of(pack), tp=lambda: (0, 1))
    backend = fake_sglang.GDNAttnBackend(slot="_extend_kernel")
    triton = backend.kernel_dispatcher._extend_kernel
    backend.forward_extend(types.SimpleNamespace(layer_id=1), sglang_batch(), None, None, None)
    assert pack.calls[0]["layer"] == 0 and not triton.calls
    route = backend.kernel_dispatcher._extend_kernel
    assert route.fallback is triton and route.supports_packed_decode is True  # other attributes: SGLang's
    assert backend.kernel_dispatcher.decode() == "triton-decode" and backend.kernel_dispatcher.decode_kernel is triton


def test_sglang_inplace_update_false_leaves_the_pool(fake_sglang):
    sglang_route.install("/p", load=loader_of(PackOpsDouble()), tp=lambda: (0, 1))
    batch = sglang_batch(extra={"inplace_update": False})
    before = batch.pool.clone()
    fake_sglang.GDNAttnBackend().forward_extend(types.SimpleNamespace(layer_id=1), batch, None, None, None)
    assert torch.equal(batch.pool, before)


def test_sglang_refusals_go_to_sglangs_kernel_by_name(fake_sglang):
    pack = PackOpsDouble()
    refusals = sglang_route.install("/p", load=loader_of(pack), tp=lambda: (0, 1))
    backend = fake_sglang.GDNAttnBackend()
    triton = backend.kernel_dispatcher.extend_kernel
    boundary = {"boundary_state": torch.zeros(3, HV, V, K)}
    assert backend.forward_extend(types.SimpleNamespace(layer_id=1), sglang_batch(extra=boundary),
                                  None, None, None) == "triton-output"
    assert backend.forward_extend(types.SimpleNamespace(layer_id=2), sglang_batch(), None, None, None) \
        == "triton-output"  # decoder layer 2 is no GDN layer of the pack's model
    assert not pack.calls and [c[1] for c in triton.calls] == [boundary, {}]
    assert any("boundary_state=a tensor (3, 4, 16, 16)" in r for r in refusals.counts)
    assert any("decoder layer 2" in r for r in refusals.counts)
    for batch, named in ((sglang_batch(cache_indices=(0, 1)), "cache_indices has 2 slots"),
                         (sglang_batch(), "query_start_loc=None")):
        cu = None if named.startswith("query") else batch.query_start_loc
        with pytest.raises(serving_calls.UnsupportedCall, match=named):
            sglang_route.convert_extend(batch.q, batch.k, batch.v, batch.g, batch.beta, ssm_states=batch.pool,
                                        cache_indices=batch.cache_indices, query_start_loc=cu)
    kv_pool = torch.zeros(9, HV, K + 1, V)
    with pytest.raises(serving_calls.UnsupportedCall, match="v-first pool"):
        b = sglang_batch()
        sglang_route.convert_extend(b.q, b.k, b.v, b.g, b.beta, ssm_states=kv_pool, cache_indices=b.cache_indices,
                                    query_start_loc=b.query_start_loc)


def test_sglang_install_is_idempotent_and_uninstall_restores(fake_sglang, monkeypatch):
    first = sglang_route.install("/p", load=loader_of(PackOpsDouble()), tp=lambda: (0, 1))
    assert sglang_route.install("/q", load=loader_of(PackOpsDouble()), tp=lambda: (0, 1)) is first
    sglang_route.uninstall()
    assert fake_sglang.GDNAttnBackend.forward_extend is fake_sglang.original
    monkeypatch.delenv(serving_calls.ENV_VAR, raising=False)
    assert sglang_route.install_from_env() is False
    assert fake_sglang.GDNAttnBackend.forward_extend is fake_sglang.original


def test_sglang_gates_without_a_batch_dimension_get_it_back():
    b = sglang_batch()
    call, inplace = sglang_route.convert_extend(b.q, b.k, b.v, b.g[0], b.beta[0], ssm_states=b.pool,
                                                cache_indices=b.cache_indices, query_start_loc=b.query_start_loc)
    assert call["g"].shape == b.g.shape and call["beta"].shape == b.beta.shape and inplace is True


def test_sglang_launcher_installs_the_route_and_runs_launch_server(fake_sglang, monkeypatch, tmp_path):
    # a stand-in sglang.launch_server that records the arguments it was started with
    package = tmp_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(
        "import sys\nif __name__ == '__main__':\n    LAUNCHED.append(list(sys.argv))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    launched = []
    monkeypatch.setattr("builtins.LAUNCHED", launched, raising=False)
    monkeypatch.setenv(serving_calls.ENV_VAR, "/packs/qwen-vk")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    try:
        sglang_route.main(["--model-path", "Qwen/Qwen3-Next"])
    finally:
        for name in ("sglang", "sglang.launch_server"):
            sys.modules.pop(name, None)
    assert launched == [["sglang.launch_server", "--model-path", "Qwen/Qwen3-Next"]]
    assert fake_sglang.GDNAttnBackend.forward_extend.flashqla_tune_route
    monkeypatch.delenv(serving_calls.ENV_VAR)
    with pytest.raises(SystemExit, match="FLASHQLA_TUNE_PACK"):
        sglang_route.main([])


def test_sglang_spawned_processes_install_the_route(fake_sglang, monkeypatch):
    # multiprocessing's spawn imports the launcher's main module again as __mp_main__
    import runpy

    monkeypatch.setenv(serving_calls.ENV_VAR, "/packs/qwen-vk")
    with warnings.catch_warnings():  # runpy notes that the module is imported already (it is, by this test)
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module("flashqla_tune.integrations.sglang", run_name="__mp_main__")
    assert fake_sglang.GDNAttnBackend.forward_extend.flashqla_tune_route
