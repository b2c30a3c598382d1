"""Model families as registered data (model_config's registry): every family parses and has a
calibration adapter, OLMo-Hybrid reads as transformers' OlmoHybridConfig derives it, shapes with no
kernels yet (OLMo-Hybrid's K=96/V=192, FLA's default K=256/V=512) are refused by `info` and `build`
from config.json alone, FLA's layout defaults to the v-first state its layer calls with, the
transformers route takes its families from the registry, and the OLMo-Hybrid adapter captures the
gate its layers hand their kernel, on a tiny checkpoint made with transformers' own classes."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from flashqla_tune import model_config
from flashqla_tune.calibrate.adapters import ADAPTERS, adapter_class
from flashqla_tune.cli import main
from flashqla_tune.model_config import (ConfigError, GDNFamily, families, family_named, parse_model_config,
                                        read_model_config, register_family, unregister_family)
from flashqla_tune.pack import read_manifest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures.calibrate_tiny import KNOWN_N_H, known_gate_params, write_corpus  # noqa: E402
from test_cli_build import doubles  # noqa: E402,F401  the kernel-cache double (a pytest fixture)

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
needs_olmo_hybrid = pytest.mark.skipif(importlib.util.find_spec("transformers.models.olmo_hybrid") is None,
                                       reason="this transformers has no OLMo-Hybrid")


def write_config(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def olmo_hybrid_config(**changes) -> dict:
    """config.json as transformers writes it for OlmoHybridConfig(**changes)."""
    from transformers import OlmoHybridConfig

    return json.loads(OlmoHybridConfig(**changes).to_json_string())


# --- the registry -------------------------------------------------------------------------

def test_every_registered_family_has_a_calibration_adapter_and_its_own_model_types():
    names = [f.name for f in families()]
    assert names == ["qwen3_next", "qwen3_5", "fla_gated_deltanet", "olmo_hybrid", "kimi_linear"]
    for family in families():
        assert family.name in ADAPTERS, family.name
        assert family_named(family.name) is family
        assert all(model_config.family_of(t) is family for t in family.model_types)
        adapter = adapter_class(family.name)
        if hasattr(adapter, "gate_proj"):       # the transformers-backed adapters name the projection too
            assert adapter.gate_proj == family.gate_projection, family.name
    types = [t for f in families() for t in f.model_types]
    assert len(types) == len(set(types)), "a model_type belongs to one family"
    with pytest.raises(ConfigError, match="model_type='llama' is not a GDN model .*olmo_hybrid"):
        parse_model_config({"model_type": "llama"})


def test_the_families_declare_how_their_layers_call_the_kernel():
    fla, olmo_family = family_named("fla_gated_deltanet"), family_named("olmo_hybrid")
    assert (fla.calls, fla.state_layout, fla.gate_in_kernel, fla.beta_sigmoid_in_kernel) == ("fla", "vk", True, True)
    assert (olmo_family.calls, olmo_family.state_layout, olmo_family.gate_in_kernel) == ("transformers", "kv", False)
    assert olmo_family.allow_neg_eigval == "linear_allow_neg_eigval"
    for name in ("qwen3_next", "qwen3_5"):
        f = family_named(name)
        assert (f.calls, f.state_layout, f.allow_neg_eigval) == ("transformers", "kv", None)
    assert "state_v_first=True" in fla.layer_call() and "use_gate_in_kernel=True" in fla.layer_call()
    assert "state [N,Hv,K,V]" in olmo_family.layer_call()


def toy_family(**changes) -> GDNFamily:
    """A test double family: a made-up model_type with its own field names."""
    fields = dict(name="toy_gdn", label="Toy", model_types=("toy_gdn",), num_qk_heads="qk_heads",
                  num_v_heads="v_heads", head_k_dim="dk", head_v_dim="dv", conv_kernel_size="conv",
                  num_layers="layers", hidden_size="width", layer_types="kinds", allow_neg_eigval="neg",
                  defaults={"conv": 4})
    fields.update(changes)
    return GDNFamily(**fields)


def test_a_registered_family_is_parsed_with_its_own_fields():
    register_family(toy_family())
    try:
        cfg = {"model_type": "toy_gdn", "qk_heads": 2, "v_heads": 8, "dk": 128, "dv": 128, "layers": 3,
               "width": 64, "kinds": ["linear_attention", "full_attention", "linear_attention"], "neg": True}
        m = parse_model_config(cfg)
        assert (m.family, m.gdn_layers, m.conv_kernel_size, m.hidden_size) == ("toy_gdn", (0, 2), 4, 64)
        assert (m.spec.num_qk_heads, m.spec.num_v_heads, m.spec.beta_max, m.spec.state_layout) == (2, 8, 2.0, "kv")
        with pytest.raises(ConfigError, match="Toy config has no 'v_heads'"):
            parse_model_config({k: v for k, v in cfg.items() if k != "v_heads"})
        with pytest.raises(ConfigError, match="Toy: kinds has 2 entries but layers=3"):
            parse_model_config({**cfg, "kinds": cfg["kinds"][:2]})
    finally:
        unregister_family("toy_gdn")
    with pytest.raises(ConfigError, match="model_type='toy_gdn' is not a GDN model"):
        parse_model_config(cfg)


def test_a_model_type_of_another_family_or_a_bad_record_is_refused():
    with pytest.raises(ValueError, match=r"\['qwen3_next'\] belong to family 'qwen3_next'"):
        register_family(toy_family(model_types=("toy_gdn", "qwen3_next")))
    assert model_config.family_of("toy_gdn") is None
    with pytest.raises(ValueError, match="a family named 'qwen3_next' is registered already"):
        register_family(toy_family(name="qwen3_next", model_types=("my_model",)))
    assert model_config.family_named("qwen3_next").model_types == ("qwen3_next",)
    with pytest.raises(ValueError, match="state_layout='vkv'"):
        toy_family(state_layout="vkv")
    with pytest.raises(ValueError, match=r"transformers_layers names model_type\(s\) \['other'\]"):
        toy_family(transformers_layers={"other": ("m", "C")})


# --- OLMo-Hybrid's config -------------------------------------------------------------------

@needs_olmo_hybrid
def test_olmo_hybrid_reads_as_transformers_writes_its_config(tmp_path):
    m = read_model_config(write_config(tmp_path / "olmo", olmo_hybrid_config()))
    s = m.spec
    assert (m.family, m.model_type, m.num_layers, m.num_gdn_layers) == ("olmo_hybrid", "olmo_hybrid", 32, 24)
    assert (s.num_qk_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim) == (30, 30, 96, 192)
    assert (s.beta_max, s.state_layout, s.qk_l2norm_in_kernel, m.conv_kernel_size) == (2.0, "kv", True, 4)
    assert all(i % 4 != 3 for i in m.gdn_layers)
    no_neg = read_model_config(write_config(tmp_path / "b", olmo_hybrid_config(linear_allow_neg_eigval=False)))
    assert no_neg.spec.beta_max == 1.0


@needs_olmo_hybrid
def test_olmo_hybrid_fields_left_out_take_the_defaults_transformers_derives():
    from transformers import OlmoHybridConfig

    raw = {"model_type": "olmo_hybrid", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3}
    want = OlmoHybridConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    m = parse_model_config(raw)
    assert (m.spec.num_qk_heads, m.spec.num_v_heads, m.spec.head_k_dim, m.spec.head_v_dim) == (
        want.linear_num_key_heads, want.linear_num_value_heads, want.linear_key_head_dim,
        want.linear_value_head_dim)
    assert m.gdn_layers == tuple(i for i, t in enumerate(want.layer_types) if t == "linear_attention")
    assert m.spec.beta_max == (2.0 if want.linear_allow_neg_eigval else 1.0)


# --- shapes with no kernels yet: refused by info and build before any work ----------------------

def fla_config(**changes) -> dict:
    cfg = json.loads((CONFIGS / "fla-gated-deltanet-1.3b" / "config.json").read_text())
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("command", ["info", "build"])
@pytest.mark.parametrize("make, named", [
    pytest.param(olmo_hybrid_config, "unsupported head dims K=96, V=192", marks=needs_olmo_hybrid),
    (lambda: {"model_type": "gated_deltanet", "num_hidden_layers": 2}, "unsupported head dims K=256, V=512"),
], ids=["olmo_hybrid", "fla_defaults"])
def test_shapes_without_kernels_are_refused_naming_the_values(command, make, named, tmp_path, capsys):
    ckpt = write_config(tmp_path / "ckpt", make())
    extra = ["--out", str(tmp_path / "pack"), "--no-tune"] if command == "build" else []
    assert main([command, str(ckpt), *extra]) == 2
    err = capsys.readouterr().err
    assert named in err and "are not built yet" in err, err
    assert not (tmp_path / "pack").exists()


# --- FLA's layout: the state layout its layer calls with ---------------------------------------

def fla_checkpoint_and_calibration(tmp_path: Path) -> tuple[Path, Path]:
    """An FLA gated_deltanet config with kernel-table dims (2 q/k heads, 8 v-heads, K = V = 128, 3
    GDN layers), stand-in weights, and the synthetic calibration of pack_doubles under its hash."""
    from pack_doubles import synthetic_calibration

    from flashqla_tune.calibration_artifact import save_calibration
    from flashqla_tune.content_hash import checkpoint_hash

    ckpt = write_config(tmp_path / "fla", {"model_type": "gated_deltanet", "num_hidden_layers": 3, "hidden_size": 64,
                                            "num_heads": 2, "num_v_heads": 8, "head_dim": 128, "expand_v": 1.0,
                                            "attn": None})
    (ckpt / "model.safetensors").write_bytes(b"stand-in weights: hashed, never loaded")
    cal = synthetic_calibration()
    cal.checkpoint_sha256, cal.checkpoint_path = checkpoint_hash(ckpt), str(ckpt)
    cal.family, cal.model_type = "fla_gated_deltanet", "gated_deltanet"
    cal.run = {"device": "cpu", "dtype": "torch.float32", "seconds": 1.0}
    cal.corpus = {"name": "synthetic", "sha256": "0" * 64, "num_sequences": 1, "seq_len": 4096, "num_tokens": 4096}
    return ckpt, save_calibration(cal, tmp_path / "made" / "calibration.json")


def test_info_shows_fla_layouts_v_first_state(tmp_path, capsys):
    ckpt, _ = fla_checkpoint_and_calibration(tmp_path)
    assert main(["info", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "state=vk" in out and "_vk_l2n" in out and "state_v_first=True" in out
    assert main(["info", "--json", str(ckpt)]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["spec"]["state_layout"] == "vk" and "use_gate_in_kernel=True" in model["layer_call"]
    assert main(["info", str(CONFIGS / "qwen3.5-9b")]) == 0
    assert "state=kv" in capsys.readouterr().out


def test_build_defaults_to_the_familys_state_layout_unless_told(tmp_path, doubles, capsys):  # noqa: F811
    ckpt, cal_file = fla_checkpoint_and_calibration(tmp_path)
    pack = tmp_path / "pack"
    base = ["build", str(ckpt), "--out", str(pack), "--no-tune", "--calibration", str(cal_file), "--no-progress"]
    assert main(base) == 0
    m = read_manifest(pack)
    assert m.spec.state_layout == "vk" and m.plans and all("_vk_" in p.plan.name for p in m.plans)
    capsys.readouterr()
    assert main(["info", str(pack)]) == 0
    assert "state=vk ([N,Hv,V,K], state_v_first=True)" in capsys.readouterr().out
    assert main([*base, "--state-layout", "kv"]) == 0
    m = read_manifest(pack)
    assert m.spec.state_layout == "kv" and all("_kv_" in p.plan.name for p in m.plans)
    capsys.readouterr()
    assert main(["info", str(pack)]) == 0
    assert "state=kv ([N,Hv,K,V])" in capsys.readouterr().out


# --- the transformers route ---------------------------------------------------------------------

def test_the_transformers_route_takes_its_families_from_the_registry():
    from flashqla_tune.integrations import transformers as route

    want = {t: layer for f in families() if f.calls == "transformers" for t, layer in f.transformers_layers.items()}
    assert {t: (f.modeling, f.layer_class) for t, f in route.FAMILIES.items()} == want
    assert route.FAMILIES["olmo_hybrid"].layer_class == "OlmoHybridGatedDeltaNet"
    assert route._fla_layout_types() == ("gated_deltanet",)


# --- the OLMo-Hybrid calibration adapter ----------------------------------------------------

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def make_olmo_hybrid(path: Path, seed=0, known_layer=None):
    """A tiny OLMo-Hybrid checkpoint made with transformers' classes (K=16, V=32: K != V), saved as
    transformers saves it (the checkpoint's own tensor names)."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    from flashqla_tune.calibrate.byte_tokenizer import build_byte_tokenizer

    torch.manual_seed(seed)
    cfg = OlmoHybridConfig(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=len(LAYER_TYPES),
                           num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
                           layer_types=list(LAYER_TYPES), eos_token_id=256, pad_token_id=256,
                           max_position_embeddings=8192,
                           rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    model = OlmoHybridForCausalLM(cfg).eval()
    if known_layer is not None:
        attn = model.model.layers[known_layer].linear_attn
        A_log, dt_bias = known_gate_params(attn.num_v_heads)
        with torch.no_grad():
            attn.a_proj.weight.zero_()
            attn.A_log.copy_(A_log)
            attn.dt_bias.copy_(dt_bias)
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return model


@needs_olmo_hybrid
def test_olmo_hybrid_layer_by_layer_gates_equal_the_whole_model_forwards(tmp_path, monkeypatch):
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid as modeling

    from flashqla_tune.calibrate import runner
    from flashqla_tune.calibrate.weights import WeightIndex
    from flashqla_tune.calibration_settings import CalibrationSettings

    model = make_olmo_hybrid(tmp_path / "ck", seed=3)
    ids = torch.randint(0, 256, (2, 160), generator=torch.Generator().manual_seed(0))
    reference, original = [], modeling.torch_chunk_gated_delta_rule

    def spy(*args, **kwargs):
        reference.append(kwargs["g"].detach().clone())
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", spy)
    with torch.no_grad():
        model(input_ids=ids)
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", original)

    captured, real = [], runner.GateAccumulator.add
    monkeypatch.setattr(runner.GateAccumulator, "add", lambda self, g: (captured.append(g.clone()), real(self, g)))
    mc = read_model_config(tmp_path / "ck")
    assert mc.family == "olmo_hybrid" and mc.gdn_layers == (0, 1, 3)
    adapter = adapter_class(mc.family)(tmp_path / "ck", mc, WeightIndex(tmp_path / "ck"), torch.device("cpu"),
                                       torch.float32)
    adapter.check()
    runner.run_layer_by_layer(adapter, ids, CalibrationSettings(), batch_size=2)
    assert len(captured) == len(reference) == 3
    for mine, ref in zip(captured, reference):
        assert torch.allclose(mine, ref, atol=1e-6, rtol=0), (mine - ref).abs().max()


@needs_olmo_hybrid
def test_olmo_hybrid_forced_decays_calibrate_to_known_windows(tmp_path):
    from flashqla_tune.calibrate.pipeline import calibrate_checkpoint

    make_olmo_hybrid(tmp_path / "ck", known_layer=1)
    corpus = write_corpus(tmp_path / "c.txt")
    cal = calibrate_checkpoint(tmp_path / "ck", corpus, out_dir=tmp_path / "out", seq_len=1024, max_sequences=6,
                               progress=False).calibration
    assert cal.family == "olmo_hybrid" and [layer.decoder_layer for layer in cal.layers] == [0, 1, 3]
    assert tuple(h.n_h for h in cal.layers[1].heads) == KNOWN_N_H
    assert cal.spec["head_k_dim"] == 16 and cal.spec["head_v_dim"] == 32 and cal.spec["beta_max"] == 2.0


@needs_olmo_hybrid
def test_a_missing_olmo_hybrid_gate_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from flashqla_tune.calibrate.weights import WeightIndex
    from flashqla_tune.calibration_settings import CalibrationError

    make_olmo_hybrid(tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    t = load_file(str(f))
    t.pop("model.layers.3.linear_attn.dt_bias")
    save_file(t, str(f))
    mc = read_model_config(tmp_path / "ck")
    adapter = adapter_class(mc.family)(tmp_path / "ck", mc, WeightIndex(tmp_path / "ck"), torch.device("cpu"),
                                       torch.float32)
    with pytest.raises(CalibrationError, match=r"model\.layers\.3\.linear_attn\.dt_bias"):
        adapter.check()


STAND_IN_CHILD = r'''
import json, sys
import torch
from transformers.models.olmo_hybrid import modeling_olmo_hybrid
from flashqla_tune.calibrate.adapters import torch_layer_math
from flashqla_tune.calibrate.pipeline import calibrate_checkpoint

torch.set_num_threads(1)
pins = sorted(torch_layer_math.dispatch_pins(modeling_olmo_hybrid))
cal = calibrate_checkpoint(sys.argv[1], sys.argv[2], **json.loads(sys.argv[3])).calibration
print(json.dumps({"pins": pins, "layers": cal.to_dict()["layers"]}))
'''


@needs_olmo_hybrid
def test_olmo_hybrid_calibrates_on_torch_code_where_fla_and_causal_conv1d_import(tmp_path):
    """With the kernel-package stand-ins of tests/fla_stand_in first on sys.path, transformers routes
    OLMo-Hybrid's chunk function and short convolution to them; the adapter's layers still run
    transformers' PyTorch code and give the statistics they give here, to the bit."""
    import os
    import subprocess

    from flashqla_tune.calibrate.pipeline import calibrate_checkpoint

    make_olmo_hybrid(tmp_path / "ck", known_layer=1)
    corpus = write_corpus(tmp_path / "c.txt", n_bytes=8_000)
    args = dict(seq_len=256, max_sequences=4, batch_size=2, device="cpu", dtype="float32", progress=False,
                write=False)
    env = dict(os.environ)
    stand_in = Path(__file__).resolve().parent / "fla_stand_in"
    env["PYTHONPATH"] = os.pathsep.join([str(stand_in), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    proc = subprocess.run([sys.executable, "-c", STAND_IN_CHILD, str(tmp_path / "ck"), str(corpus), json.dumps(args)],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.splitlines()[-1])
    assert {"torch_chunk_gated_delta_rule", "causal_conv1d_fn"} <= set(child["pins"]), child["pins"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = calibrate_checkpoint(tmp_path / "ck", corpus, **args).calibration.to_dict()["layers"]
    finally:
        torch.set_num_threads(threads)
    assert child["layers"] == here
