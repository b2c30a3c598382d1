"""KDA as a family of its own (docs/kda.md): Kimi-Linear configs parse as a per-key-gate family,
`info` and `build` refuse them before any work because no KDA kernel is built, the calibration's
KDA statistic (each token's least-negative channel gate) and its artifact version, and the
Kimi-Linear adapter capturing the gate per key channel from the model's own layer code on a tiny
checkpoint made with transformers' classes."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from flashqla_tune.calibrate.adapters import ADAPTERS, adapter_class
from flashqla_tune.calibrate.statistics import GateAccumulator, calibrate_gates, least_decay_gates
from flashqla_tune.calibration_artifact import (KDA_SCHEMA_VERSION, MAX_KEY_CHANNEL, SCHEMA_VERSION, Calibration,
                                                load_calibration, save_calibration)
from flashqla_tune.calibration_settings import CalibrationError, CalibrationSettings
from flashqla_tune.cli import main
from flashqla_tune.model_config import GDNFamily, family_named, parse_model_config, read_model_config
from flashqla_tune.spec import GDNSpec
from flashqla_tune.supported_shapes import UnsupportedShapeError, check_spec, spec_problem

needs_kimi_linear = pytest.mark.skipif(importlib.util.find_spec("transformers.models.kimi_linear") is None,
                                       reason="this transformers has no Kimi-Linear")

# config.json as Moonshot's Kimi-Linear checkpoints write it: the KDA fields nested, layers 1-indexed
MOONSHOT_STYLE = {
    "model_type": "kimi_linear", "hidden_size": 2304, "num_hidden_layers": 8, "torch_dtype": "bfloat16",
    "linear_attn_config": {"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
                           "full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7]},
}


def write_config(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# --- the family record ---------------------------------------------------------------------

def test_a_moonshot_style_config_parses_as_a_per_key_gate_family():
    m = parse_model_config(MOONSHOT_STYLE)
    assert (m.family, m.model_type, m.num_layers) == ("kimi_linear", "kimi_linear", 8)
    assert m.gdn_layers == (0, 1, 2, 4, 5, 6)
    s = m.spec
    assert (s.gate_kind, s.num_qk_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim) == ("per_key", 32, 32, 128, 128)
    assert (s.state_layout, s.beta_max, s.qk_l2norm_in_kernel) == ("kv", 1.0, True)
    assert m.conv_kernel_size == 4 and m.hidden_size == 2304
    assert "KDA" in family_named("kimi_linear").layer_call()


def test_the_nested_fields_win_over_the_top_level_ones_as_kimilinearconfig_reads_them():
    cfg = {**MOONSHOT_STYLE, "linear_num_heads": 7, "linear_head_dim": 64}
    assert parse_model_config(cfg).spec.num_v_heads == 32
    bad = {**MOONSHOT_STYLE, "linear_attn_config": {**MOONSHOT_STYLE["linear_attn_config"], "kda_layers": [0, 1]}}
    with pytest.raises(ValueError, match="kda_layers holds 0; its entries are decoder layers 1..8"):
        parse_model_config(bad)


@needs_kimi_linear
def test_a_config_written_by_transformers_parses_with_its_defaults():
    from transformers import KimiLinearConfig

    cfg = json.loads(KimiLinearConfig(num_hidden_layers=9).to_json_string())
    m = parse_model_config(cfg)
    default_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(9)]
    assert m.gdn_layers == tuple(i for i, t in enumerate(default_types) if t == "linear_attention")
    assert (m.spec.num_v_heads, m.spec.head_k_dim, m.spec.gate_kind) == (32, 128, "per_key")
    # fields a config.json leaves out take KimiLinearConfig's defaults
    bare = parse_model_config({"model_type": "kimi_linear"})
    assert (bare.num_layers, bare.hidden_size, bare.spec.num_v_heads) == (27, 2304, 32)


def test_the_scalar_gate_stays_the_default_and_a_bad_gate_kind_is_refused():
    assert all(family_named(n).gate_kind == "scalar" for n in ("qwen3_next", "qwen3_5", "fla_gated_deltanet",
                                                                "olmo_hybrid"))
    with pytest.raises(ValueError, match="gate_kind='vector' is not one of"):
        GDNFamily(name="toy", label="Toy", model_types=("toy",), num_qk_heads="a", num_v_heads="b",
                  head_k_dim="c", head_v_dim="d", conv_kernel_size="e", gate_kind="vector")


# --- refused before any work: no KDA kernel exists -------------------------------------------

def test_the_shape_table_names_a_per_key_gate_as_kda():
    spec = GDNSpec(num_qk_heads=32, num_v_heads=32, head_k_dim=128, head_v_dim=128, gate_kind="per_key")
    assert "KDA kernels are not built yet" in spec_problem(spec)
    with pytest.raises(UnsupportedShapeError, match="here: gate_kind='per_key' is KDA's gate"):
        check_spec(spec, "here")
    odd = GDNSpec(num_qk_heads=4, num_v_heads=4, head_k_dim=96, head_v_dim=96, gate_kind="per_key")
    assert "KDA" in spec_problem(odd)          # the gate is named first, whatever the dims
    assert spec_problem(GDNSpec(num_qk_heads=32, num_v_heads=32, head_k_dim=128, head_v_dim=128)) is None


@pytest.mark.parametrize("command", ["info", "build"])
def test_info_and_build_refuse_a_kimi_linear_checkpoint_naming_kda(command, tmp_path, capsys):
    ckpt = write_config(tmp_path / "ckpt", MOONSHOT_STYLE)
    extra = ["--out", str(tmp_path / "pack"), "--no-tune"] if command == "build" else []
    assert main([command, str(ckpt), *extra]) == 2
    err = capsys.readouterr().err
    assert "family kimi_linear (model_type 'kimi_linear') is a KDA model, 6 KDA of 8 layers" in err, err
    assert "the KDA kernels are not built yet" in err, err
    assert not (tmp_path / "pack").exists()


# --- the statistic and the artifact ----------------------------------------------------------

def test_the_kda_statistic_is_each_tokens_least_negative_channel():
    g = -torch.rand(2, 130, 3, 4, generator=torch.Generator().manual_seed(0))
    seqs = least_decay_gates(g)
    assert len(seqs) == 2 and torch.equal(seqs[1], g[1].max(-1).values)
    assert torch.equal(least_decay_gates([g[0, :70]])[0], g[0, :70].max(-1).values)
    with pytest.raises(CalibrationError, match=r"\[T, Hv, K\]"):
        least_decay_gates(g[0, :, :, 0])
    with pytest.raises(CalibrationError, match="NaN or inf"):
        least_decay_gates(torch.full((64, 1, 2), float("-inf")))


def test_one_open_channel_makes_a_head_exact_however_the_others_decay():
    """Per head: head 0 decays hard on every channel; head 1 too, but one channel at a time is
    open (the others at -3), so every per-channel sum is very negative while each token's least
    decay is 0."""
    T, K = 64 * 8, 4
    g = torch.full((T, 2, K), -3.0)
    for t in range(T):
        g[t, 1, t % K] = 0.0
    assert (g[:64, 1].sum(0) < math.log(1e-5)).all()
    layer = calibrate_gates(g, per_key=True)
    assert layer.heads[0].n_h == 1 and layer.heads[1].n_h is None
    assert layer.heads[0].chunk_log_decay_quantiles[-1] == pytest.approx(-3.0 * 64)
    assert layer.heads[1].chunk_log_decay_quantiles[-1] == 0.0
    acc = GateAccumulator(2, CalibrationSettings(), per_key=True)
    acc.add(g[None])
    assert acc.finish() == layer


def kda_calibration(tmp_path: Path | None = None) -> Calibration:
    g = -torch.rand(1, 1024, 4, 8, generator=torch.Generator().manual_seed(1))
    spec = GDNSpec(num_qk_heads=4, num_v_heads=4, head_k_dim=8, head_v_dim=8, gate_kind="per_key").to_dict()
    return Calibration(checkpoint_sha256="ef" * 32, checkpoint_path="/kimi", family="kimi_linear",
                       model_type="kimi_linear", spec=spec, settings=CalibrationSettings(),
                       corpus={"name": "c.txt", "sha256": "cd" * 32, "num_sequences": 1, "seq_len": 1024,
                               "num_tokens": 1024},
                       layers=[calibrate_gates(g, layer=0, per_key=True)])


def test_a_kda_artifact_is_version_2_naming_its_statistic_and_round_trips(tmp_path):
    cal = kda_calibration()
    assert cal.schema_version == KDA_SCHEMA_VERSION and cal.gate_statistic == MAX_KEY_CHANNEL
    path = save_calibration(cal, tmp_path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 2 and data["gate_statistic"] == "max_key_channel"
    back = load_calibration(path)
    assert back.layers == cal.layers and back.schema_version == 2 and back.gate_statistic == MAX_KEY_CHANNEL


def test_a_scalar_gate_artifact_is_written_as_before(tmp_path):
    cal = kda_calibration()
    cal.spec = GDNSpec(num_qk_heads=4, num_v_heads=4, head_k_dim=8, head_v_dim=8).to_dict()
    cal.schema_version = None
    cal.__post_init__()
    data = json.loads(save_calibration(cal, tmp_path).read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 1 and "gate_statistic" not in data
    assert list(data)[:4] == ["schema", "schema_version", "tool_version", "checkpoint"]
    assert load_calibration(tmp_path).gate_statistic is None


def test_an_artifact_whose_version_disagrees_with_its_gate_is_refused(tmp_path):
    path = save_calibration(kda_calibration(), tmp_path)
    data = json.loads(path.read_text())
    for change, named in (({"schema_version": 1}, "schema_version is 1 but checkpoint.spec has gate_kind='per_key'"),
                          ({"gate_statistic": "per_channel_sum"}, "gate_statistic is 'per_channel_sum'"),
                          ({"schema_version": 3}, "schema version 3")):
        path.write_text(json.dumps({**data, **change}))
        with pytest.raises(CalibrationError, match=named):
            load_calibration(path)


# --- the Kimi-Linear adapter -----------------------------------------------------------------

KIMI_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def make_kimi_linear(path: Path, seed=0):
    """A tiny Kimi-Linear checkpoint made with transformers' classes (2 heads, K = V = 8, MLA and
    MoE layers shrunk), saved as transformers saves it: the checkpoint's own tensor names."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from flashqla_tune.calibrate.byte_tokenizer import build_byte_tokenizer

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(vocab_size=257, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=len(KIMI_LAYER_TYPES), num_attention_heads=2, num_key_value_heads=2,
                           kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                           num_local_experts=4, num_experts_per_tok=2, linear_head_dim=8, linear_num_heads=2,
                           layer_types=list(KIMI_LAYER_TYPES), mlp_layer_types=["dense", "sparse", "sparse", "dense"],
                           pad_token_id=256, bos_token_id=256, eos_token_id=256)
    model = KimiLinearForCausalLM(cfg).eval()
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return model


@needs_kimi_linear
def test_the_adapter_captures_the_gate_per_key_channel_that_the_whole_model_hands_its_kernel(tmp_path, monkeypatch):
    from transformers.models.kimi_linear import modeling_kimi_linear as modeling

    from flashqla_tune.calibrate.weights import WeightIndex

    assert "kimi_linear" in ADAPTERS
    model = make_kimi_linear(tmp_path / "ck", seed=3)
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(0))
    reference, original = [], modeling.chunk_kimi_delta_attention

    def spy(*args, **kwargs):
        reference.append(kwargs["g"].detach().clone())
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling, "chunk_kimi_delta_attention", spy)
    with torch.no_grad():
        model(input_ids=ids)
    monkeypatch.setattr(modeling, "chunk_kimi_delta_attention", original)
    assert len(reference) == 3

    mc = read_model_config(tmp_path / "ck")
    assert mc.family == "kimi_linear" and mc.gdn_layers == (0, 2, 3) and mc.spec.gate_kind == "per_key"
    adapter = adapter_class(mc.family)(tmp_path / "ck", mc, WeightIndex(tmp_path / "ck"), torch.device("cpu"),
                                       torch.float32)
    assert adapter.gate_proj == family_named("kimi_linear").gate_projection
    adapter.check()
    hidden, captured, stats = adapter.embed(ids), [], []
    for index in range(mc.num_layers):
        hidden, g = adapter.load_layer(index)(hidden)
        if g is not None:
            captured.append(g)
            stats.append(calibrate_gates(g, layer=len(stats), decoder_layer=index, per_key=True))
    assert len(captured) == 3
    for mine, ref in zip(captured, reference):
        assert mine.shape == (2, 150, 2, 8)
        assert torch.allclose(mine, ref, atol=1e-6, rtol=0), (mine - ref).abs().max()
    # the recorded statistic is that of each token's least-negative channel
    want = captured[0].max(-1).values[:, :128].double().reshape(2, 2, 64, 2).sum(2)   # [seq, full chunk, head]
    got = stats[0].heads[0].chunk_log_decay_quantiles
    assert got[0] == pytest.approx(float(want[..., 0].min())) and got[-1] == pytest.approx(float(want[..., 0].max()))


@needs_kimi_linear
def test_the_adapter_names_a_missing_or_misshaped_gate_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from flashqla_tune.calibrate.weights import WeightIndex

    make_kimi_linear(tmp_path / "ck")
    shard = tmp_path / "ck" / "model.safetensors"
    tensors = load_file(shard)
    mc = read_model_config(tmp_path / "ck")

    def adapter():
        return adapter_class("kimi_linear")(tmp_path / "ck", mc, WeightIndex(tmp_path / "ck"), torch.device("cpu"),
                                            torch.float32)

    save_file({**tensors, "model.layers.2.self_attn.A_log": torch.zeros(1, 1, 3, 1)}, shard)
    with pytest.raises(CalibrationError, match=r"model.layers.2.self_attn.A_log.*\(1, 1, 3, 1\).*2 heads"):
        adapter().check()
    save_file({k: v for k, v in tensors.items() if k != "model.layers.3.self_attn.f_b_proj.weight"}, shard)
    with pytest.raises(CalibrationError, match=r"no tensor 'model.layers.3.self_attn.f_b_proj.weight'"):
        adapter().check()


@needs_kimi_linear
def test_calibrate_runs_end_to_end_on_a_kimi_linear_checkpoint(tmp_path):
    from flashqla_tune.calibrate.pipeline import calibrate_checkpoint

    make_kimi_linear(tmp_path / "ckpt")
    result = calibrate_checkpoint(tmp_path / "ckpt", out_dir=tmp_path / "out", seq_len=256, max_sequences=4,
                                  batch_size=2, device="cpu", progress=False)
    data = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert data["schema_version"] == 2 and data["gate_statistic"] == "max_key_channel"
    assert result.calibration.spec["gate_kind"] == "per_key"
    assert len(data["layers"]) == sum(t == "linear_attention" for t in KIMI_LAYER_TYPES)
