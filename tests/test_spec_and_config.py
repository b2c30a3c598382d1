"""GDNSpec validation, KernelPlan validation, and reading config.json layouts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashqla_tune.model_config import ConfigError, parse_model_config, read_model_config
from flashqla_tune.plan import KernelPlan, PlanError, TileParams, default_plan
from flashqla_tune.spec import GDNSpec, SpecError

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


@pytest.mark.parametrize("field, value, match", [
    ("num_qk_heads", 0, "num_qk_heads must be a positive int, got 0"),
    ("num_v_heads", 10, "num_v_heads=10 is not a multiple of num_qk_heads=4"),
    ("head_k_dim", 1.5, "head_k_dim must be a positive int, got 1.5"),
    ("chunk_size", 48, "chunk_size must be 16, 32 or 64, got 48"),
    ("gate_kind", "vector", "gate_kind must be one of"),
    ("qkv_dtype", "float32", "qkv_dtype must be one of"),
    ("gate_dtype", "bfloat16", "gate_dtype must be 'float32'"),
    ("state_layout", "kvk", "state_layout must be one of"),
    ("beta_max", 3.0, "beta_max must be in \\(0, 2\\], got 3.0"),
    ("qk_l2norm_in_kernel", 1, "qk_l2norm_in_kernel must be a bool"),
])
def test_spec_errors_name_field_and_value(field, value, match):
    kw = dict(num_qk_heads=4, num_v_heads=8)
    kw[field] = value
    with pytest.raises(SpecError, match=match):
        GDNSpec(**kw)


def test_spec_name_and_round_trip():
    spec = GDNSpec(16, 48, qkv_dtype="float16", state_layout="vk", qk_l2norm_in_kernel=True)
    assert spec.name == "gdn_qk16_v48_k128_v128_c64_scalar_fp16_vk_l2n"
    assert spec.group_size == 3
    assert GDNSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match="unknown GDNSpec field"):
        GDNSpec.from_dict({**spec.to_dict(), "heads": 3})


@pytest.mark.parametrize("tiles, match", [
    (TileParams(block_v=48), "block_v=48"),
    (TileParams(stages=4), "stages=4"),
    (TileParams(producer_regs=30), "producer_regs=30 must be a multiple of 8"),
    (TileParams(consumer_regs=264), "consumer_regs=264 must be a multiple of 8 in \\[24, 248\\]"),
    # ptxas caps a kernel at 255 registers; a 256-register setmaxnreg is an illegal instruction
    (TileParams(producer_regs=256, consumer_regs=256), "producer_regs=256 must be a multiple of 8 in \\[24, 248\\]"),
    (TileParams(producer_regs=240, consumer_regs=224), "producer_regs=240 is above consumer_regs=224"),
    (TileParams(block_v=32), "block_v=32 must be 64 or 128"),
    (TileParams(consumer_regs=160), "consumer_regs=160 is below 168"),
    (TileParams(ctas_per_sm=3), "ctas_per_sm=3 must be 1 or 2"),
    (TileParams(ctas_per_sm=2, stages=1), "need 34816 registers per CTA; ctas_per_sm=2 leaves 32768"),
    (TileParams(block_v=128, consumer_regs=248), "need 68608 registers per CTA; ctas_per_sm=1 leaves 64512"),
    # three warp groups launch with 168 registers each: the pool is 64512, so 32 + 2 x 240 would hang
    (TileParams(block_v=128, producer_regs=32, consumer_regs=240), "need 65536 registers per CTA; ctas_per_sm=1 leaves 64512"),
    (TileParams(block_v=128, producer_regs=176, consumer_regs=176), "producer_regs=176 exceeds the 168 registers"),
    (TileParams(block_v=128, output_group=1), "output_group=1 pairs the output warp group with one chain"),
    (TileParams(output_group=2), "output_group=2 must be 0 or 1"),
    (TileParams(prep_threads=64), "prep_threads=64 must be 128 or 256"),
    (TileParams(block_v=128, stages=3), "need 234496 B of shared memory per CTA; 1 CTA\\(s\\) per SM allow 232448 B"),
    (TileParams(stages=2, producer_regs=24, ctas_per_sm=2), "2 CTA\\(s\\) per SM allow 115712 B"),
])
def test_plan_rejects_bad_tiles(tiles, match):
    with pytest.raises(PlanError, match=match):
        KernelPlan(GDNSpec(2, 8), tiles)


@pytest.mark.parametrize("spec, match", [
    (GDNSpec(2, 8, head_k_dim=64), "K=64"),
    (GDNSpec(2, 8, chunk_size=32), "chunk_size=32"),
    (GDNSpec(2, 8, gate_kind="per_key"), "per_key"),
])
def test_plan_refuses_unsupported_specs(spec, match):
    with pytest.raises(PlanError, match=match):
        default_plan(spec)


def test_default_plan_shares_binaries_across_runtime_only_fields():
    a = default_plan(GDNSpec(2, 8, qk_l2norm_in_kernel=True, beta_max=1.0))
    b = default_plan(GDNSpec(2, 8))
    assert a == b and a.name == "gdn_qk2_v8_k128_v128_c64_scalar_bf16_kv__bv64_st3_r40x232"
    assert KernelPlan.from_dict(a.to_dict()) == a


# (fixture, family, layers, gdn layers, Hqk, Hv, K, V) from the published configurations
EXPECTED = [
    ("qwen3-next-80b-a3b", "qwen3_next", 48, 36, 16, 32, 128, 128),
    ("qwen3.5-0.8b", "qwen3_5", 24, 18, 16, 16, 128, 128),
    ("qwen3.5-2b", "qwen3_5", 24, 18, 16, 16, 128, 128),
    ("qwen3.5-4b", "qwen3_5", 32, 24, 16, 32, 128, 128),
    ("qwen3.5-9b", "qwen3_5", 32, 24, 16, 32, 128, 128),
    ("qwen3.5-27b", "qwen3_5", 64, 48, 16, 48, 128, 128),
    ("qwen3.5-35b-a3b", "qwen3_5", 40, 30, 16, 32, 128, 128),
    ("qwen3.5-122b-a10b", "qwen3_5", 48, 36, 16, 64, 128, 128),
    ("qwen3.5-397b-a17b", "qwen3_5", 60, 45, 16, 64, 128, 128),
    ("fla-gated-deltanet-1.3b", "fla_gated_deltanet", 21, 18, 6, 6, 256, 512),
]


@pytest.mark.parametrize("name, family, layers, gdn, hqk, hv, k, v", EXPECTED)
def test_configs_parse(name, family, layers, gdn, hqk, hv, k, v):
    cfg = read_model_config(CONFIGS / name)
    assert (cfg.family, cfg.num_layers, cfg.num_gdn_layers) == (family, layers, gdn)
    s = cfg.spec
    assert (s.num_qk_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim) == (hqk, hv, k, v)
    if family != "fla_gated_deltanet":
        assert all((i + 1) % 4 for i in cfg.gdn_layers), "every fourth layer is full attention"


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="model_type='llama' is not a GDN model"):
        read_model_config(CONFIGS / "not-gdn-llama")
    with pytest.raises(ConfigError, match="no config.json"):
        read_model_config(tmp_path)
    cfg = json.loads((CONFIGS / "qwen3-next-80b-a3b" / "config.json").read_text())
    del cfg["linear_num_value_heads"]
    with pytest.raises(ConfigError, match="has no 'linear_num_value_heads'"):
        parse_model_config(cfg)
    cfg = json.loads((CONFIGS / "qwen3.5-0.8b" / "config.json").read_text())
    cfg["text_config"]["layer_types"] = cfg["text_config"]["layer_types"][:-1]
    with pytest.raises(ConfigError, match="layer_types has 23 entries but num_hidden_layers=24"):
        parse_model_config(cfg)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        read_model_config(tmp_path)
