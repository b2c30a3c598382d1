"""Render a KernelPlan into one CUDA source file through a thin Jinja template.

The template only fixes constants and instantiates csrc/ templates; this module turns a plan
into the dict of C++ spellings the template receives (render_context) and writes the result
only when its text changed, so ninja stays idle on a rerun.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jinja2

from .abi import ABI_VERSION  # one number for the template, the loader and the cache key
from .package_data import csrc_dir, templates_dir  # also read from here by the tuner's study key and tests
from .plan import KernelPlan

TEMPLATE_NAME = "gdn_fwd.cu.j2"

_ELEMENT_TYPES = {"bfloat16": "cutlass::bfloat16_t", "float16": "cutlass::half_t"}


class RenderError(ValueError):
    """A template is missing, uses an undefined variable, or does not render."""


# The template embeds plan_json in a raw string literal R"fqtjson(...)fqtjson": the JSON goes in
# verbatim (quotes and all), so only that closing delimiter and line breaks must never occur.
RAW_DELIMITER = "fqtjson"


def plan_json(plan: KernelPlan) -> str:
    """The canonical JSON of a plan (one ASCII line), as fqt_plan_json() of its library returns it."""
    text = json.dumps(plan.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    if f"){RAW_DELIMITER}\"" in text or "\n" in text:
        raise RenderError(f"plan {plan.name} has JSON that cannot sit in a raw string literal: {text}")
    return text


def _cbool(value: bool) -> str:
    return "true" if value else "false"


def render_context(plan: KernelPlan) -> dict:
    """The exact dict the kernel template receives (the render contract)."""
    if not isinstance(plan, KernelPlan):
        raise RenderError(f"render_context needs a KernelPlan, got {type(plan).__name__}")
    s, t = plan.spec, plan.tiles
    return {
        "plan_name": plan.name,
        "plan_json": plan_json(plan),
        "abi_version": ABI_VERSION,
        "num_qk_heads": s.num_qk_heads,
        "num_v_heads": s.num_v_heads,
        "head_k_dim": s.head_k_dim,
        "head_v_dim": s.head_v_dim,
        "chunk_size": s.chunk_size,
        "element_type": _ELEMENT_TYPES[s.qkv_dtype],
        "state_v_first": _cbool(s.state_layout == "vk"),
        "qk_l2norm_in_kernel": _cbool(s.qk_l2norm_in_kernel),
        "gate_in_kernel": _cbool(s.gate_in_kernel),
        "beta_sigmoid_in_kernel": _cbool(s.beta_sigmoid_in_kernel),
        "allow_neg_eigval": _cbool(s.allow_neg_eigval),
        "block_v": t.block_v,
        "stages": t.stages,
        "producer_regs": t.producer_regs,
        "consumer_regs": t.consumer_regs,
        "ctas_per_sm": t.ctas_per_sm,
        "output_group": _cbool(bool(t.output_group)),
        "prep_threads": t.prep_threads,
    }


def write_if_changed(path: Path, text: str) -> bool:
    """Write text to path unless it already holds exactly that; True when written.

    An unchanged file keeps its mtime (ninja sees nothing to do); a changed one is replaced
    atomically so a concurrent reader never sees half a file.
    """
    path = Path(path)
    try:
        if path.read_text() == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


@dataclass(frozen=True)
class Renderer:
    """A template folder and the template in it that a plan renders through.

    Defaults to the shipped templates/gdn_fwd.cu.j2; tests point it at fixture templates.
    """
    template_dir: Path | None = None
    template_name: str = TEMPLATE_NAME

    @property
    def directory(self) -> Path:
        return Path(self.template_dir) if self.template_dir is not None else templates_dir()

    def _environment(self) -> jinja2.Environment:
        return jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(self.directory)),
            undefined=jinja2.StrictUndefined,
            autoescape=False,
            keep_trailing_newline=True,
            trim_blocks=True,
            lstrip_blocks=True,
        )

    def render(self, plan: KernelPlan) -> str:
        """The .cu text for a plan; raises RenderError naming the plan and the template."""
        context = render_context(plan)
        path = self.directory / self.template_name
        if not path.is_file():
            raise RenderError(f"cannot render plan {plan.name}: template {self.template_name} not found "
                              f"in {self.directory}")
        try:
            return self._environment().get_template(self.template_name).render(**context)
        except jinja2.UndefinedError as exc:
            raise RenderError(f"template {path} uses a variable the render context lacks while rendering "
                              f"plan {plan.name}: {exc.message}") from exc
        except jinja2.TemplateError as exc:
            raise RenderError(f"template {path} failed to render plan {plan.name}: {exc}") from exc

    def write(self, plan: KernelPlan, out_dir: Path) -> Path:
        """Render to out_dir/<plan.name>.cu, writing only when the text changed."""
        path = Path(out_dir) / f"{plan.name}.cu"
        write_if_changed(path, self.render(plan))
        return path


def render_plan(plan: KernelPlan, out_dir: Path, renderer: Renderer | None = None) -> Path:
    """Render a plan to out_dir/<plan.name>.cu with the shipped template (or `renderer`)."""
    return (renderer or Renderer()).write(plan, out_dir)


__all__ = ["ABI_VERSION", "RAW_DELIMITER", "RenderError", "Renderer", "TEMPLATE_NAME", "csrc_dir", "plan_json",
           "render_context", "render_plan", "templates_dir", "write_if_changed"]
