"""Adapters on tiny random checkpoints: known decays, parity with a whole-model forward, and
errors that name the problem."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.calibrate_tiny import KNOWN_N_H, make_fla, make_qwen3_next, make_qwen35, write_corpus
from flashqla_tune.calibrate.adapters import adapter_class
from flashqla_tune.calibrate.pipeline import calibrate_checkpoint
from flashqla_tune.calibrate.runner import run_layer_by_layer
from flashqla_tune.calibrate.weights import WeightIndex
from flashqla_tune.calibration_settings import CalibrationError, CalibrationSettings
from flashqla_tune.model_config import read_model_config

MAKERS = {"qwen3_5": make_qwen35, "qwen3_next": make_qwen3_next, "fla": make_fla}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "c.txt")


def run(ckpt, corpus, tmp_path, **kw):
    return calibrate_checkpoint(ckpt, corpus, out_dir=tmp_path / "out", seq_len=1024, max_sequences=6,
                                progress=False, **kw)


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_forced_decays_give_known_answers(family, corpus, tmp_path):
    # GDN layers are decoder layers 0, 1, 3 (Qwen) or 0, 2 (FLA); the known layer is GDN layer 1.
    known_decoder = 2 if family == "fla" else 1
    MAKERS[family](tmp_path / "ck", known_layer=known_decoder)
    cal = run(tmp_path / "ck", corpus, tmp_path).calibration
    layer = cal.layers[1]
    assert layer.decoder_layer == known_decoder
    assert tuple(h.n_h for h in layer.heads) == KNOWN_N_H
    assert [h.cls for h in layer.heads] == ["exact", "warmup", "warmup", "exact"]
    assert layer.heads[0].zero_decay_fraction == 1.0
    assert cal.family == {"fla": "fla_gated_deltanet"}.get(family, family)
    assert (tmp_path / "out" / "calibration.json").is_file() and (tmp_path / "out" / "calibration.png").is_file()


def whole_model_gates(model, modeling, ids):
    """The gate every GDN layer hands its kernel in one whole-model forward."""
    seen = []
    original = modeling.torch_chunk_gated_delta_rule

    def spy(*args, **kwargs):
        seen.append(kwargs["g"].detach().clone())
        return original(*args, **kwargs)

    modeling.torch_chunk_gated_delta_rule = spy
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        modeling.torch_chunk_gated_delta_rule = original
    return seen


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_layer_by_layer_equals_whole_model_forward(family, tmp_path, monkeypatch):
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_next import modeling_qwen3_next

    modeling = modeling_qwen3_5 if family == "qwen3_5" else modeling_qwen3_next
    model = MAKERS[family](tmp_path / "ck", seed=3)
    ids = torch.randint(0, 256, (3, 256), generator=torch.Generator().manual_seed(0))
    reference = whole_model_gates(model, modeling, ids)

    captured = []
    from flashqla_tune.calibrate import runner

    real = runner.GateAccumulator.add
    monkeypatch.setattr(runner.GateAccumulator, "add", lambda self, g: (captured.append(g.clone()), real(self, g)))
    mc = read_model_config(tmp_path / "ck")
    adapter = adapter_class(mc.family)(tmp_path / "ck", mc, WeightIndex(tmp_path / "ck"), torch.device("cpu"),
                                       torch.float32)
    adapter.check()
    run_layer_by_layer(adapter, ids, CalibrationSettings(), batch_size=2)
    per_layer = [torch.cat(captured[i:i + 2]) for i in range(0, len(captured), 2)]
    assert len(per_layer) == len(reference) == 3
    for mine, ref in zip(per_layer, reference):
        assert torch.allclose(mine, ref, atol=1e-6, rtol=0), (mine - ref).abs().max()


def test_fla_first_layer_gate_matches_direct_formula(tmp_path):
    t = make_fla(tmp_path / "ck")
    mc = read_model_config(tmp_path / "ck")
    adapter = adapter_class(mc.family)(tmp_path / "ck", mc, WeightIndex(tmp_path / "ck"), torch.device("cpu"),
                                       torch.float32)
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    _, g = adapter.load_layer(0)(adapter.embed(ids))
    x = t["model.embeddings.weight"][ids]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * t["model.layers.0.attn_norm.weight"]
    a = x @ t["model.layers.0.attn.a_proj.weight"].T
    want = -t["model.layers.0.attn.A_log"].exp() * torch.nn.functional.softplus(a + t["model.layers.0.attn.dt_bias"])
    assert torch.allclose(g, want, atol=1e-6)


def test_moe_checkpoint_experts_are_stacked(tmp_path, corpus):
    make_qwen3_next(tmp_path / "ck", num_experts=4, known_layer=1)
    cal = run(tmp_path / "ck", corpus, tmp_path).calibration
    assert tuple(h.n_h for h in cal.layers[1].heads) == KNOWN_N_H


def test_not_a_gdn_model(tmp_path, corpus):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(CalibrationError, match="model_type='llama' is not a GDN model"):
        run(tmp_path / "ck", corpus, tmp_path)
    assert not (tmp_path / "out").exists()


def test_no_gdn_layers_and_missing_config(tmp_path, corpus):
    make_qwen35(tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * 4
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CalibrationError, match="no GDN"):
        run(tmp_path / "ck", corpus, tmp_path)
    (tmp_path / "nothing-here").mkdir()
    with pytest.raises(CalibrationError, match="no config.json"):
        run(tmp_path / "nothing-here", corpus, tmp_path)
    assert not (tmp_path / "out").exists()


def rewrite_weights(ckpt, edit):
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    edit(t)
    save_file(t, str(f))


def test_missing_gate_tensor_is_named(tmp_path, corpus):
    make_qwen35(tmp_path / "ck")
    rewrite_weights(tmp_path / "ck", lambda t: t.pop("model.layers.3.linear_attn.A_log"))
    with pytest.raises(CalibrationError, match=r"no tensor 'model\.layers\.3\.linear_attn\.A_log'.*GDN layer 3"):
        run(tmp_path / "ck", corpus, tmp_path)
    assert not (tmp_path / "out").exists()


def test_missing_non_gate_tensor_is_named(tmp_path, corpus):
    make_qwen35(tmp_path / "ck")
    rewrite_weights(tmp_path / "ck", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CalibrationError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        run(tmp_path / "ck", corpus, tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["qwen3_5", "fla"])
def test_head_count_mismatch_is_named(family, tmp_path, corpus):
    MAKERS[family](tmp_path / "ck")
    key = "model.layers.0.linear_attn.dt_bias" if family == "qwen3_5" else "model.layers.0.attn.dt_bias"
    rewrite_weights(tmp_path / "ck", lambda t: t.__setitem__(key, torch.zeros(3)))
    with pytest.raises(CalibrationError, match=r"head count mismatch: '.*dt_bias' has shape \(3,\).*4 v-heads"):
        run(tmp_path / "ck", corpus, tmp_path)


def test_missing_tokenizer_and_empty_corpus(tmp_path, corpus):
    make_qwen35(tmp_path / "ck")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(CalibrationError, match="is empty"):
        run(tmp_path / "ck", empty, tmp_path)
    with pytest.raises(CalibrationError, match="does not exist"):
        run(tmp_path / "ck", tmp_path / "nope.txt", tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "ck" / f).unlink()
    with pytest.raises(CalibrationError, match="no tokenizer"):
        run(tmp_path / "ck", corpus, tmp_path)
    assert not (tmp_path / "out").exists()
