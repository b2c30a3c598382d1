"""Rendering a KernelPlan through a thin Jinja template (no compiler needed)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flashqla_tune.plan import KernelPlan, PlanError, TileParams, default_plan
from flashqla_tune.render import (ABI_VERSION, RenderError, Renderer, plan_json, render_context, render_plan, templates_dir,
                                  write_if_changed)
from flashqla_tune.spec import GDNSpec

FIXTURE_TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
CONTRACT_KEYS = {"plan_name", "plan_json", "abi_version", "num_qk_heads", "num_v_heads", "head_k_dim", "head_v_dim",
                 "chunk_size", "element_type", "state_v_first", "qk_l2norm_in_kernel", "block_v", "stages",
                 "producer_regs", "consumer_regs", "ctas_per_sm", "output_group",
                 "prep_threads", "gate_in_kernel", "beta_sigmoid_in_kernel", "allow_neg_eigval"}


def fixture_renderer() -> Renderer:
    return Renderer(FIXTURE_TEMPLATES)


def test_context_has_exactly_the_contract_keys():
    plan = default_plan(GDNSpec(4, 16))
    ctx = render_context(plan)
    assert set(ctx) == CONTRACT_KEYS
    assert ctx["plan_name"] == plan.name
    assert ctx["abi_version"] == ABI_VERSION == 4
    assert (ctx["num_qk_heads"], ctx["num_v_heads"], ctx["head_k_dim"], ctx["head_v_dim"], ctx["chunk_size"]) == \
        (4, 16, 128, 128, 64)
    assert (ctx["block_v"], ctx["stages"], ctx["producer_regs"], ctx["consumer_regs"]) == (64, 3, 40, 232)
    assert ctx["ctas_per_sm"] == 1 and ctx["output_group"] == "false"
    assert ctx["element_type"] == "cutlass::bfloat16_t"
    assert ctx["state_v_first"] == "false" and ctx["qk_l2norm_in_kernel"] == "false"
    assert (ctx["gate_in_kernel"], ctx["beta_sigmoid_in_kernel"], ctx["allow_neg_eigval"]) == ("false",) * 3
    assert json.loads(ctx["plan_json"]) == plan.to_dict()


def test_context_spells_dtype_layout_and_norm():
    spec = GDNSpec(2, 8, qkv_dtype="float16", state_layout="vk", qk_l2norm_in_kernel=True)
    ctx = render_context(KernelPlan(spec, TileParams(block_v=128, stages=1, producer_regs=24, consumer_regs=240)))
    assert ctx["element_type"] == "cutlass::half_t"
    assert ctx["state_v_first"] == "true" and ctx["qk_l2norm_in_kernel"] == "true"
    assert (ctx["block_v"], ctx["stages"], ctx["producer_regs"], ctx["consumer_regs"]) == (128, 1, 24, 240)


def test_plan_json_is_one_ascii_line_for_a_raw_literal():
    text = plan_json(default_plan(GDNSpec(16, 64)))
    assert text.isascii() and "\n" not in text and ')fqtjson"' not in text


def test_render_names_file_after_plan_and_fixes_constants(tmp_path):
    plan = default_plan(GDNSpec(2, 8, qkv_dtype="float16"))
    path = render_plan(plan, tmp_path, fixture_renderer())
    assert path == tmp_path / f"{plan.name}.cu"
    text = path.read_text()
    assert f"Plan {plan.name}." in text
    assert "using Element = cutlass::half_t;" in text
    assert "constexpr int kNumVHeads = 8;" in text
    assert "{{" not in text and "{%" not in text


def test_distinct_plans_get_distinct_stable_names():
    a = default_plan(GDNSpec(2, 8))
    b = KernelPlan(GDNSpec(2, 8), TileParams(block_v=128))
    c = default_plan(GDNSpec(2, 8, state_layout="vk"))
    assert len({a.name, b.name, c.name}) == 3
    assert a.name == default_plan(GDNSpec(2, 8)).name


def test_strict_undefined_names_the_variable(tmp_path):
    (tmp_path / "bad.cu.j2").write_text("int x = {{ block_v }} + {{ no_such_constant }};\n")
    with pytest.raises(RenderError, match="no_such_constant"):
        Renderer(tmp_path, "bad.cu.j2").render(default_plan(GDNSpec(2, 8)))


def test_missing_template_is_refused_clearly(tmp_path):
    plan = default_plan(GDNSpec(2, 8))
    with pytest.raises(RenderError, match=rf"cannot render plan {plan.name}: template gdn_fwd.cu.j2 not found"):
        Renderer(tmp_path).render(plan)


def test_invalid_plan_is_refused_before_rendering():
    with pytest.raises(PlanError, match="block_v=48"):
        KernelPlan(GDNSpec(2, 8), TileParams(block_v=48))
    with pytest.raises(PlanError, match="head dims"):
        KernelPlan(GDNSpec(2, 8, head_k_dim=64))
    with pytest.raises(RenderError, match="needs a KernelPlan"):
        render_context(GDNSpec(2, 8))


def test_unchanged_file_is_not_rewritten(tmp_path):
    plan = default_plan(GDNSpec(2, 8))
    path = render_plan(plan, tmp_path, fixture_renderer())
    old = 1_000_000_000
    os.utime(path, ns=(old, old))
    render_plan(plan, tmp_path, fixture_renderer())
    assert path.stat().st_mtime_ns == old
    assert write_if_changed(path, path.read_text()) is False
    assert write_if_changed(path, path.read_text() + "// changed\n") is True
    assert path.stat().st_mtime_ns != old
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_shipped_template_renders_every_contract_case():
    # The production template must use only the contract's keys (StrictUndefined catches others).
    if not (templates_dir() / "gdn_fwd.cu.j2").is_file():
        pytest.skip("templates/gdn_fwd.cu.j2 has not landed yet")
    for spec in (GDNSpec(2, 8), GDNSpec(16, 16, qkv_dtype="float16", state_layout="vk", qk_l2norm_in_kernel=True)):
        plan = default_plan(spec)
        text = Renderer().render(plan)
        assert plan.name in text and plan_json(plan) in text
