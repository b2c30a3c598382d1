"""The supported-shape table: what it accepts and refuses (naming the value), and that the plan,
the op's host checks and `info` all read this one table, so widening it is one edit."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from flashqla_tune import ops, supported_shapes
from flashqla_tune.cli import main
from flashqla_tune.model_config import read_model_config
from flashqla_tune.plan import KernelPlan, PlanError, default_plan
from flashqla_tune.spec import GDNSpec
from flashqla_tune.supported_shapes import (SUPPORTED, UnsupportedShapeError, check_model, check_spec,
                                            spec_problem)

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.iterdir() if p.name.startswith("qwen")))
def test_the_shipped_qwen_configs_are_supported(name):
    check_model(read_model_config(CONFIGS / name))


def test_fla_gated_deltanet_with_256_wide_heads_is_refused_by_value():
    model = read_model_config(CONFIGS / "fla-gated-deltanet-1.3b")
    with pytest.raises(UnsupportedShapeError, match=r"fla-gated-deltanet-1.3b: unsupported head dims K=256, V=512"):
        check_model(model, str(CONFIGS / "fla-gated-deltanet-1.3b"))


@pytest.mark.parametrize("spec, match", [
    (GDNSpec(2, 8, head_k_dim=64), "K=64, V=128"),
    (GDNSpec(2, 8, head_v_dim=256), "K=128, V=256"),
    (GDNSpec(2, 8, chunk_size=32), "chunk_size=32"),
    (GDNSpec(2, 8, gate_kind="per_key"), "gate_kind='per_key'"),
])
def test_specs_outside_the_table_are_refused_naming_the_value(spec, match):
    assert match in spec_problem(spec)
    with pytest.raises(UnsupportedShapeError, match=match):
        check_spec(spec)


def test_supported_specs_pass_in_both_dtypes_and_layouts():
    for dtype in SUPPORTED.qkv_dtypes:
        for layout in SUPPORTED.state_layouts:
            assert spec_problem(GDNSpec(4, 16, qkv_dtype=dtype, state_layout=layout)) is None


def test_the_head_count_rule():
    assert supported_shapes.heads_problem(2, 8) is None
    assert "Hv=3 must be a multiple of q/k heads Hqk=2" in supported_shapes.heads_problem(2, 3)


def test_a_model_without_gdn_layers_is_refused(tmp_path):
    cfg = json.loads((CONFIGS / "qwen3.5-0.8b" / "config.json").read_text())
    text = cfg["text_config"]
    text["layer_types"] = ["full_attention"] * text["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedShapeError, match="no GDN"):
        check_model(read_model_config(tmp_path))


def test_widening_the_table_is_one_edit(monkeypatch, tmp_path, capsys):
    """With K = 64 added to SUPPORTED alone, the plan, the op's host checks and `info` accept it."""
    spec = GDNSpec(2, 8, head_k_dim=64)
    with pytest.raises(PlanError, match="K=64"):
        default_plan(spec)
    monkeypatch.setattr(supported_shapes, "SUPPORTED", dataclasses.replace(SUPPORTED, head_k_dims=(64, 128)))
    assert isinstance(KernelPlan(spec), KernelPlan)
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    v, g = torch.zeros(1, 8, 8, 128, dtype=torch.bfloat16), torch.zeros(1, 8, 8)
    assert ops.check_shapes_and_types(q, q, v, g, g, None, None, None, False) == (1, 8, 2, 8, 1)
    cfg = json.loads((CONFIGS / "qwen3.5-0.8b" / "config.json").read_text())
    cfg["text_config"]["linear_key_head_dim"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(tmp_path)]) == 0
    assert "K=64 V=128" in capsys.readouterr().out
