"""The calibrate command end to end on the embedded default model, and its argument errors."""
import json

import pytest

from flashqla_tune.calibrate.default_model import default_model_path
from flashqla_tune.cli import main
from flashqla_tune.model_config import read_model_config

pytestmark = pytest.mark.skipif(not (default_model_path() / "model.safetensors").is_file(),
                                reason="the embedded default model is not in this tree")


def test_default_model_meets_its_contract():
    mc = read_model_config(default_model_path())
    assert mc.family == "qwen3_5" and mc.num_gdn_layers >= 4
    assert mc.spec.head_k_dim == mc.spec.head_v_dim == 128 and mc.spec.num_v_heads >= 8
    size = sum(f.stat().st_size for f in default_model_path().glob("*.safetensors"))
    assert size <= 8 * 2**20


def test_cli_calibrates_the_shipped_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    # a smaller slice of the shipped corpus than the default keeps the suite fast
    rc = main(["calibrate", "--out", str(tmp_path / "out"), "--max-sequences", "8", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "5 GDN layers x 8 v-heads" in out and "layer 0:" in out and "artifact" in out
    data = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert data["corpus"]["name"] == "shipped:corpus.txt" and data["corpus"]["num_tokens"] == 8 * 2048
    assert len(data["layers"]) == 5 and all(len(layer["heads"]) == 8 for layer in data["layers"])
    assert (tmp_path / "out" / "calibration.png").stat().st_size > 10_000
    assert "| layer | decoder layer |" in (tmp_path / "out" / "calibration.md").read_text()


@pytest.mark.parametrize("args, word", [(["--eps", "2"], "eps"), (["--quantile", "1"], "quantile"),
                                        (["--max-window", "0"], "max window")])
def test_cli_rejects_bad_settings(args, word, tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "out"), *args]) == 2
    assert word in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
