"""The transformers route (flashqla_tune.integrations.transformers.use_pack) on the CPU: the shipped
model (transformers' own Qwen3.5 code) routed onto a pack whose op is a named test double
(OraclePackDouble: the op's host checks, then the float64 oracle), with the shipped calibration
and the shipped checkpoint's hash. What is checked: which GDN-layer index each decoder layer's call
gets, that the arguments arrive in the op's layouts (the routed model matches transformers' own
PyTorch path), decode staying on transformers' path, restore, and the refusals."""
from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashqla_tune  # noqa: E402
from flashqla_tune import ops  # noqa: E402
from flashqla_tune.calibrate import load_calibration  # noqa: E402
from flashqla_tune.calibrate.default_model import default_model_path  # noqa: E402
from flashqla_tune.integrations import transformers as route_mod  # noqa: E402
from flashqla_tune.integrations.transformers import (FAMILIES, PackRoute, RouteError,  # noqa: E402
                                                     register_family, use_pack)
from flashqla_tune.oracle import chunk_gated_delta_rule_chunked  # noqa: E402
from flashqla_tune.pack import (BINARIES, CALIBRATION, UNTUNED_TARGET, Manifest, PackError, PackPlan,  # noqa: E402
                                read_manifest, sha256_file, write_manifest)
from flashqla_tune.pack_build import plan_heads  # noqa: E402
from flashqla_tune.plan import default_plan  # noqa: E402
from flashqla_tune.spec import GDNSpec  # noqa: E402

from pack_doubles import FakeLibraryOpener, make_pack  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHIPPED_CALIBRATION = REPO / "docs" / "results" / "default-model" / "calibration.json"
MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    # the checkpoint hash remembers file digests in the cache: keep them out of the user's
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def modeling():
    import importlib

    return importlib.import_module(MODELING)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.bfloat16).eval()


def write_pack(folder: Path, calibration_file: Path) -> Path:
    """A pack folder of FakeBinary bytes around a real calibration artifact, with its checkpoint hash."""
    cal = load_calibration(calibration_file)
    spec = GDNSpec.from_dict(cal.spec)
    (folder / BINARIES).mkdir(parents=True)
    shutil.copy(calibration_file, folder / CALIBRATION)
    plans = []
    for h in plan_heads(spec, (1,)):
        plan = default_plan(h.spec)
        rel = f"{BINARIES}/{plan.name}.so"
        (folder / rel).write_bytes(b"FakeBinary " + plan.name.encode())
        plans.append(PackPlan(h.tp_size, h.form, plan, rel, sha256_file(folder / rel)))
    write_manifest(folder, Manifest(spec=spec, checkpoint_sha256=cal.checkpoint_sha256,
                                    checkpoint_path=cal.checkpoint_path,
                                    calibration_sha256=sha256_file(folder / CALIBRATION),
                                    num_gdn_layers=len(cal.layers), tp_sizes=(1,),
                                    gpu={"target": UNTUNED_TARGET, "name": None, "arch": "sm_90a"},
                                    toolchain={"nvcc": "13.0", "cutlass": "4.2.0", "torch": torch.__version__},
                                    plans=tuple(plans)))
    return folder


class OraclePackDouble:
    """Test double of a loaded pack (flashqla_tune.load's PackOps) for the CPU: the real manifest
    and calibration of a pack folder, and a chunk_gated_delta_rule with the pack op's signature that
    runs the op's host checks (options, shapes and dtypes; not the device) and then the float64
    oracle (its chunked form), recording each call."""

    def __init__(self, folder: Path):
        self.pack = folder
        self.manifest = read_manifest(folder)
        self.calibration = load_calibration(folder / CALIBRATION, checkpoint_sha256=self.manifest.checkpoint_sha256)
        self.calls: list[dict] = []

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                               allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               chunk_indices=None, cp_context=None, *, layer=None, **kwargs):
        ops.check_options(use_beta_sigmoid_in_kernel, allow_neg_eigval, chunk_indices, cp_context, kwargs)
        ops.check_shapes_and_types(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first)
        self.calls.append({"layer": layer, "q": q, "k": k, "v": v, "g": g, "beta": beta, "scale": scale,
                           "initial_state": initial_state, "output_final_state": output_final_state,
                           "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "cu_seqlens": cu_seqlens})
        o, final = chunk_gated_delta_rule_chunked(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                  scale, None if initial_state is None else initial_state.double(),
                                                  output_final_state, use_qk_l2norm_in_kernel, state_v_first,
                                                  cu_seqlens)
        self.calls[-1].update(o=o.to(q.dtype), final_state=None if final is None else final.float())
        return self.calls[-1]["o"], self.calls[-1]["final_state"]

    def __repr__(self) -> str:
        return f"OraclePackDouble({self.pack})"


@pytest.fixture
def shipped_pack(tmp_path):
    return OraclePackDouble(write_pack(tmp_path / "pack", SHIPPED_CALIBRATION))


def tokens(batch=2, length=70, seed=0):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gdn_modules(model, modeling):
    return [m for m in model.modules() if isinstance(m, modeling.Qwen3_5GatedDeltaNet)]


def test_the_shipped_calibration_puts_decoder_layer_4_at_gdn_layer_3():
    data = json.loads(SHIPPED_CALIBRATION.read_text())
    assert {d["decoder_layer"]: d["layer"] for d in data["layers"]}[4] == 3
    config = json.loads((default_model_path() / "config.json").read_text())
    assert config["layer_types"][3] == "full_attention"   # why decoder layer 4 is the fourth GDN layer


def test_each_decoder_layer_calls_with_its_own_gdn_layer(model, modeling, shipped_pack):
    """Every routed call carries the gate of the decoder layer the calibration maps its layer= to."""
    gates, hooks = {}, []
    for m in gdn_modules(model, modeling):
        def capture(_proj, _inputs, a, gdn=m):   # the gate as the layer computes it (transformers' formula)
            gates[gdn.layer_idx] = -gdn.A_log.float().exp() * torch.nn.functional.softplus(a.float() + gdn.dt_bias)
        hooks.append(m.in_proj_a.register_forward_hook(capture))
    try:
        with use_pack(model, shipped_pack) as route, torch.no_grad():
            assert route.layers == {0: 0, 1: 1, 2: 2, 4: 3, 5: 4}
            model(tokens())
    finally:
        for h in hooks:
            h.remove()
    assert [c["layer"] for c in shipped_pack.calls] == [0, 1, 2, 3, 4]
    for call in shipped_pack.calls:
        decoder = {v: k for k, v in route.layers.items()}[call["layer"]]
        assert torch.equal(call["g"], gates[decoder]), f"GDN layer {call['layer']} got another layer's gate"
    assert route.calls == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}


def test_the_call_arrives_in_the_op_layouts_and_matches_transformers_path(model, modeling, shipped_pack):
    ids = tokens()
    torch_path = inspect.unwrap(modeling.torch_chunk_gated_delta_rule)
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits.float()
        with use_pack(model, shipped_pack):
            routed = model(ids, use_cache=False).logits.float()
    hqk, hv = model.config.linear_num_key_heads, model.config.linear_num_value_heads
    for call in shipped_pack.calls:
        B, T = ids.shape
        assert call["q"].shape == call["k"].shape == (B, T, hqk, 128)   # q/k unrepeated
        assert call["v"].shape == (B, T, hv, 128) and call["q"].dtype == torch.bfloat16
        assert call["g"].shape == call["beta"].shape == (B, T, hv) and call["g"].dtype == torch.float32
        assert call["use_qk_l2norm_in_kernel"] is True and call["scale"] is None
        assert call["initial_state"] is None and call["cu_seqlens"] is None
        assert call["output_final_state"] is False   # no cache kept
        # the op's answer for these arguments is transformers' own answer for them
        o_ref, _ = torch_path(call["q"], call["k"], call["v"], g=call["g"], beta=call["beta"],
                              use_qk_l2norm_in_kernel=True)
        assert rel_l2(call["o"], o_ref) < 1e-2
    assert rel_l2(routed, reference) < 2e-2
    assert (routed.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9


def test_decode_stays_on_transformers_recurrent_path(model, modeling, shipped_pack):
    ids = tokens(batch=1, length=40, seed=3)
    torch_path = inspect.unwrap(modeling.torch_chunk_gated_delta_rule)
    with torch.no_grad(), use_pack(model, shipped_pack) as route:
        prefill = model(ids, use_cache=True)
        assert [c["layer"] for c in shipped_pack.calls] == [0, 1, 2, 3, 4]
        cache = prefill.past_key_values
        for call in shipped_pack.calls:
            decoder = {v: k for k, v in route.layers.items()}[call["layer"]]
            assert call["output_final_state"] is True
            # the cache holds the pack's final state, the one transformers' own path computes
            assert torch.equal(cache.get_recurrent_state(decoder, state_idx=0), call["final_state"])
            _, s_ref = torch_path(call["q"], call["k"], call["v"], g=call["g"], beta=call["beta"],
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
            assert call["final_state"].shape == s_ref.shape and rel_l2(call["final_state"], s_ref) < 1e-4
        model(prefill.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)   # one decode step
    assert len(shipped_pack.calls) == 5 and route.calls == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}
    # and generation under the route picks the tokens transformers' own path picks
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False)
        with use_pack(model, shipped_pack):
            got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected) and len(shipped_pack.calls) == 10


@pytest.fixture
def conv_keeping_no_sequences_apart(modeling, monkeypatch):
    """Stand-in for the causal_conv1d package, whose absence makes transformers refuse seq_idx in the
    conv before the GDN call: transformers' PyTorch conv with seq_idx dropped (the test is about
    what reaches the GDN call, not about the conv)."""
    conv = modeling.causal_conv1d_fn

    def stand_in(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        return conv(x, weight, bias, activation=activation)

    monkeypatch.setattr(modeling, "causal_conv1d_fn", stand_in)


def test_packed_sequences_pass_cu_seqlens_and_drop_the_model_plumbing(model, shipped_pack, monkeypatch,
                                                                       conv_keeping_no_sequences_apart):
    ids = tokens(batch=1, length=70, seed=4)
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    received = []
    real = shipped_pack.chunk_gated_delta_rule
    monkeypatch.setattr(shipped_pack, "chunk_gated_delta_rule",
                        lambda *a, **kw: received.append(sorted(kw)) or real(*a, **kw))
    with torch.no_grad(), use_pack(model, shipped_pack):
        model(ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=40, max_length_k=40,
              seq_idx=torch.zeros(1, 70, dtype=torch.int32), frobnicate=1)
    assert len(shipped_pack.calls) == 5
    assert all(c["cu_seqlens"] is cu for c in shipped_pack.calls)
    # what reached the op: its own names only (seq_idx is carried by cu_seqlens; the rest is plumbing)
    assert received[0] == ["beta", "cu_seqlens", "g", "initial_state", "k", "layer", "output_final_state",
                           "q", "use_qk_l2norm_in_kernel", "v"]


def test_close_restores_transformers_functions_and_forwards(model, modeling, shipped_pack):
    original = modeling.torch_chunk_gated_delta_rule
    modules = gdn_modules(model, modeling)
    route = use_pack(model, shipped_pack)
    assert modeling.torch_chunk_gated_delta_rule is not original
    assert all("forward" in m.__dict__ for m in modules)
    route.close()
    assert modeling.torch_chunk_gated_delta_rule is original
    assert all("forward" not in m.__dict__ for m in modules)
    assert not route.is_open
    route.close()   # twice is harmless
    with torch.no_grad():
        model(tokens(batch=1, length=20))
    assert shipped_pack.calls == []


def test_two_routed_models_share_the_dispatcher_until_the_last_closes(model, modeling, shipped_pack, tmp_path):
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.bfloat16).eval()
    second = OraclePackDouble(write_pack(tmp_path / "pack2", SHIPPED_CALIBRATION))
    original = modeling.torch_chunk_gated_delta_rule
    first = use_pack(model, shipped_pack)
    try:
        with torch.no_grad():
            other(tokens(batch=1, length=20))   # an unrouted model of the family runs transformers' path
        assert shipped_pack.calls == []
        with use_pack(other, second), torch.no_grad():
            other(tokens(batch=1, length=20))
            assert len(second.calls) == 5 and shipped_pack.calls == []
        assert modeling.torch_chunk_gated_delta_rule is not original   # the first route is still open
        with torch.no_grad():
            model(tokens(batch=1, length=20))
        assert len(shipped_pack.calls) == 5
    finally:
        first.close()
    assert modeling.torch_chunk_gated_delta_rule is original


def test_a_model_is_routed_once_at_a_time(model, shipped_pack):
    with use_pack(model, shipped_pack):
        with pytest.raises(RouteError, match="routed already"):
            use_pack(model, shipped_pack)
    use_pack(model, shipped_pack).close()   # open again once closed


@pytest.mark.parametrize("kwargs, error, name", [
    ({"chunk_size": 32}, ops.UnsupportedError, "chunk_size=32"),
    ({"allow_neg_eigval": True}, ops.UnsupportedError, "allow_neg_eigval"),  # without the sigmoid, as FLA
    ({"head_first": True}, TypeError, "head_first"),
    ({"seq_idx": torch.zeros(1, 20, dtype=torch.int32)}, ops.UnsupportedError, "seq_idx"),
], ids=["chunk_size", "op_option", "fla_removed_option", "seq_idx_alone"])
def test_unsupported_arguments_are_refused_by_name(model, shipped_pack, kwargs, error, name,
                                                  conv_keeping_no_sequences_apart):
    with use_pack(model, shipped_pack), torch.no_grad():
        with pytest.raises(error, match=name) as info:
            model(tokens(batch=1, length=20), **kwargs)
    assert shipped_pack.calls == []
    if error is ops.UnsupportedError and name.startswith("allow_neg"):
        assert any("GDN layer 0, decoder layer 0" in note for note in getattr(info.value, "__notes__", []))


@pytest.mark.filterwarnings("ignore:pack .* carries no prebuilt C\\+\\+ host extension:RuntimeWarning")
def test_a_real_loaded_pack_receives_the_call_with_its_layer(model, tmp_path):
    """flashqla_tune.load's PackOps (FakeBinary libraries): the route reaches its op, which refuses
    CPU tensors; the refusal says which layer called."""
    folder = write_pack(tmp_path / "pack", SHIPPED_CALIBRATION)
    pack_ops = flashqla_tune.load(folder, gpu=None, open_library=FakeLibraryOpener())
    seen = []
    real = pack_ops.chunk_gated_delta_rule

    def spy(*args, **kwargs):   # records layer= and runs the pack's own op
        seen.append(kwargs["layer"])
        return real(*args, **kwargs)

    pack_ops.chunk_gated_delta_rule = spy
    with use_pack(model, pack_ops), torch.no_grad():
        with pytest.raises(ValueError, match="CUDA") as info:
            model(tokens(batch=1, length=20))
    assert seen == [0]
    assert any("GDN layer 0" in n for n in getattr(info.value, "__notes__", []))


def test_a_pack_for_another_checkpoint_is_refused(model, tmp_path):
    other = OraclePackDouble(make_pack(tmp_path / "other", tp_sizes=(1,)))   # checkpoint sha "abab..."
    with pytest.raises(PackError, match="built for checkpoint abababab"):
        use_pack(model, other)
    assert not any("forward" in m.linear_attn.__dict__ for m in model.modules() if hasattr(m, "linear_attn"))


def test_a_model_without_a_checkpoint_folder_must_name_one(shipped_pack):
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig.from_dict(json.loads((default_model_path() / "config.json").read_text()))
    fresh = AutoModelForCausalLM.from_config(config)   # weights made here: no folder to hash
    with pytest.raises(PackError, match="pass checkpoint=FOLDER"):
        use_pack(fresh, shipped_pack)
    with use_pack(fresh, shipped_pack, checkpoint=default_model_path()) as route:
        assert route.layers[4] == 3


def test_a_pack_for_other_gdn_layers_is_refused(model, tmp_path):
    data = json.loads(SHIPPED_CALIBRATION.read_text())
    data["layers"][3]["decoder_layer"] = 3    # as if the full-attention layer were a GDN layer
    changed = tmp_path / "calibration.json"
    changed.write_text(json.dumps(data))
    with pytest.raises(RouteError, match=r"decoder layers \[0, 1, 2, 4, 5\].*\[0, 1, 2, 3, 5\]"):
        use_pack(model, OraclePackDouble(write_pack(tmp_path / "pack", changed)))


def test_unregistered_and_fla_layout_families_are_refused(shipped_pack):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(RouteError, match="model_type='llama'.*registered: .*qwen3_5.*qwen3_next"):
        use_pack(llama, shipped_pack)

    class FLALayoutModel(torch.nn.Module):
        config = type("Config", (), {"model_type": "gated_deltanet"})()

    with pytest.raises(RouteError, match="register_fla_backend"):
        use_pack(FLALayoutModel(), shipped_pack)


def test_register_family_lets_a_new_model_type_route(model, shipped_pack, monkeypatch):
    monkeypatch.setitem(FAMILIES, "qwen3_5_text", FAMILIES["qwen3_5_text"])   # restored after the test
    monkeypatch.delitem(FAMILIES, "qwen3_5_text")
    with pytest.raises(RouteError, match="qwen3_5_text"):
        use_pack(model, shipped_pack)
    register_family("qwen3_5_text", MODELING, "Qwen3_5GatedDeltaNet")
    route = use_pack(model, shipped_pack)
    assert isinstance(route, PackRoute) and route.family.layer_class == "Qwen3_5GatedDeltaNet"
    route.close()


def test_the_registered_families_exist_in_this_transformers():
    import importlib

    for model_type, family in FAMILIES.items():
        module = importlib.import_module(family.modeling)
        assert isinstance(getattr(module, family.layer_class), type), model_type
        source = inspect.getsource(getattr(module, family.layer_class).forward)
        assert f"{family.function}(" in source, f"{model_type}: its layer no longer calls {family.function}"
        assert route_mod.CHUNK_FUNCTION == family.function


def test_a_qwen3_next_model_routes_each_layer_to_its_calibration(tmp_path):
    """A fresh Qwen3-Next checkpoint made with transformers' classes (decoder layer 1 full attention,
    so decoder layers 2 and 3 are GDN layers 1 and 2), and a calibration of its own hash."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from flashqla_tune.calibrate import Calibration, CalibrationSettings, calibrate_gates, save_calibration
    from flashqla_tune.content_hash import checkpoint_hash

    config = Qwen3NextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                             layer_types=["linear_attention", "full_attention", "linear_attention",
                                          "linear_attention"],
                             num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=1,
                             linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                             num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    checkpoint = tmp_path / "qwen3_next"
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(checkpoint)
    settings = CalibrationSettings()
    layers = [calibrate_gates(-torch.full((4096, 2), 0.05 * (i + 1), dtype=torch.float64), settings, layer=i,
                              decoder_layer=d) for i, d in enumerate((0, 2, 3))]
    spec = GDNSpec(1, 2, qk_l2norm_in_kernel=True, beta_max=1.0)
    artifact = tmp_path / "calibration.json"
    save_calibration(Calibration(checkpoint_sha256=checkpoint_hash(checkpoint), checkpoint_path=str(checkpoint),
                                 family="qwen3_next", model_type="qwen3_next", spec=spec.to_dict(),
                                 corpus={"name": "synthetic"}, settings=settings, layers=layers), artifact)
    pack = OraclePackDouble(write_pack(tmp_path / "pack", artifact))
    model = Qwen3NextForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    ids = tokens(batch=1, length=70, seed=5) % 64
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits.float()
        with use_pack(model, pack) as route:
            routed = model(ids, use_cache=False).logits.float()
    assert route.layers == {0: 0, 2: 1, 3: 2}
    assert [c["layer"] for c in pack.calls] == [0, 1, 2]
    assert pack.calls[0]["q"].shape == (1, 70, 1, 128) and pack.calls[0]["v"].shape == (1, 70, 2, 128)
    assert rel_l2(routed, reference) < 2e-2


def test_a_gdn_function_without_named_arguments_is_refused_before_anything_is_patched():
    """A GDN function that takes (*args, **kwargs) with no PyTorch function behind it to name the
    arguments: the route cannot bind a call, so it refuses by name and leaves the module as it was."""
    import types

    def hub_wrapper(*args, **kwargs):
        raise AssertionError("never called")

    module = types.SimpleNamespace(torch_chunk_gated_delta_rule=hub_wrapper)
    family = route_mod.Family("stand_in_modeling", "StandInGatedDeltaNet", "torch_chunk_gated_delta_rule")
    with pytest.raises(RouteError, match=r"takes \(\*args, \*\*kwargs\), not the named arguments \['query', 'key'.*"
                                         r"calls its GDN function another way"):
        route_mod._install(family, module)
    assert module.torch_chunk_gated_delta_rule is hub_wrapper
    assert ("stand_in_modeling", "torch_chunk_gated_delta_rule") not in route_mod._PATCHES
