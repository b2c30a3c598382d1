"""Who may import whom, checked in fresh interpreters (an import made by an earlier test cannot
hide one) and, for calibrate/, in the source itself.

- Opening a kernel pack and calling its op (flashqla_tune.load) imports no compiler module: no
  jinja2, render, build, cache or tuner, and not torch's extension builder.
- calibrate/ imports no runtime or compiler module, only the leaves both sides share.
- The runtime imports nothing of calibrate/ (the artifact and the settings it reads are leaves).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from pack_doubles import make_pack  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CALIBRATE = ROOT / "calibrate"

# Modules of flashqla_tune both sides may import: they import nothing but each other (and the
# package root, which imports only spec).
LEAVES = {"calibration_artifact", "calibration_settings", "environment", "files", "hub_dispatch", "model_config",
          "oracle", "package_data", "spec", "supported_shapes", "content_hash"}
COMPILER = ("flashqla_tune.build", "flashqla_tune.render", "flashqla_tune.cache", "flashqla_tune.tune",
            "flashqla_tune.pack_build", "jinja2", "torch.utils.cpp_extension")
RUNTIME = ("flashqla_tune.ops", "flashqla_tune.packed_ops", "flashqla_tune.runtime", "flashqla_tune.host_path",
           "flashqla_tune.loader", "flashqla_tune.fla_backend", "flashqla_tune.warmup_tables",
           "flashqla_tune.cp_cost_model", "flashqla_tune.segment_policy", "flashqla_tune.pack",
           "flashqla_tune.pack_signing", "flashqla_tune.integrations.transformers", "flashqla_tune.integrations.vllm",
           "flashqla_tune.integrations.sglang", "flashqla_tune.integrations.serving_calls")

# Imports each module in turn and reports, per module, which watched modules it pulled in first.
PROBE = r"""
import importlib, json, sys
modules, watched = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def seen():
    return {m for m in sys.modules for w in watched if m == w or m.startswith(w + ".")}
before, pulled = seen(), {}
for name in modules:
    importlib.import_module(name)
    now = seen()
    pulled[name] = sorted(now - before)
    before = now
print(json.dumps(pulled))
"""


def probe(modules, watched, code=PROBE, *args):
    out = subprocess.run([sys.executable, "-c", code, json.dumps(list(modules)), json.dumps(list(watched)), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return {name: found for name, found in json.loads(out.stdout.splitlines()[-1]).items() if found}


def calibrate_modules() -> list[str]:
    names = []
    for path in sorted(CALIBRATE.rglob("*.py")):
        rel = path.relative_to(CALIBRATE).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        names.append(".".join(("flashqla_tune", "calibrate", *parts)))
    return names


def test_the_runtime_modules_import_no_compiler_and_nothing_of_calibrate():
    pulled = probe(["flashqla_tune", *RUNTIME], [*COMPILER, "flashqla_tune.calibrate"])
    assert not pulled, f"runtime modules pulled in {pulled}"


LOAD_A_PACK = r"""
import json, sys
import flashqla_tune
watched = json.loads(sys.argv[2])
ops = flashqla_tune.load(sys.argv[3], 0, 1, gpu=None, open_library=lambda so, plan: ("library double", plan.name))
assert ops.warmup_table().numel() == 8 and ops.num_layers == 3
import torch
q, v = torch.zeros(1, 5, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 5, 8, 128, dtype=torch.bfloat16)
g = torch.zeros(1, 5, 8)
try:  # an eager call runs the op's host side up to the device check (CPU tensors here)
    ops.chunk_gated_delta_rule(q, q, v, g, g, layer=1)
except ValueError as exc:
    assert "CUDA device" in str(exc), exc
else:
    raise AssertionError("a call on CPU tensors went through")
print(json.dumps({"flashqla_tune.load": sorted(m for m in sys.modules for w in watched
                                               if m == w or m.startswith(w + "."))}))
"""


def test_loading_a_pack_imports_no_compiler(tmp_path):
    pack = make_pack(tmp_path / "pack")  # written here: the doubles themselves use the compiler side
    pulled = probe([], [*COMPILER, "flashqla_tune.calibrate"], LOAD_A_PACK, str(pack))
    assert not pulled, f"flashqla_tune.load pulled in {pulled}"


def test_calibrate_imports_no_runtime_or_compiler_module():
    modules = calibrate_modules()
    assert "flashqla_tune.calibrate.pipeline" in modules and "flashqla_tune.calibrate.adapters.base" in modules
    for optional in ("flashqla_tune.calibrate.adapters.qwen3_5", "flashqla_tune.calibrate.adapters.qwen3_next"):
        model = optional.rsplit(".", 1)[1]
        if importlib.util.find_spec(f"transformers.models.{model}") is None:
            modules.remove(optional)  # this transformers has no such model: the adapter cannot import
    ours = [m for m in COMPILER if m.startswith("flashqla_tune.")]  # transformers itself imports jinja2
    pulled = probe(modules, [*ours, *RUNTIME, "flashqla_tune.pack", "flashqla_tune.plan", "flashqla_tune.measure",
                             "flashqla_tune.bench", "flashqla_tune.sass"])
    assert not pulled, f"calibrate modules pulled in {pulled}"


def _package_imports(path: Path, package: tuple[str, ...]):
    """(line, absolute module name) of every import of a flashqla_tune module in a source file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join((*base, node.module)) if node.module else ".".join(base)
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "flashqla_tune" or name.startswith("flashqla_tune."):
                yield node.lineno, name


def _leaf_or_inside(name: str, inside: str) -> bool:
    parts = name.split(".")
    return name.startswith(inside + ".") or name == inside or (len(parts) >= 2 and parts[1] in LEAVES)


def test_calibrate_sources_import_only_leaves_outside_calibrate():
    bad = []
    for path in sorted(CALIBRATE.rglob("*.py")):
        rel = path.relative_to(CALIBRATE)
        package = ("flashqla_tune", "calibrate", *rel.parts[:-1])
        for line, name in _package_imports(path, package):
            if not _leaf_or_inside(name, "flashqla_tune.calibrate"):
                bad.append(f"calibrate/{rel}:{line} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_the_leaves_import_only_leaves(leaf):
    root = ROOT / "flashqla_tune"
    paths = sorted((root / leaf).rglob("*.py")) if (root / leaf).is_dir() else [root / f"{leaf}.py"]
    bad = []
    for path in paths:
        package = ("flashqla_tune", *path.relative_to(root).parts[:-1])
        for line, name in _package_imports(path, package):
            root_package = name in ("flashqla_tune", "flashqla_tune.__version__")  # it imports only spec
            if not root_package and not _leaf_or_inside(name, f"flashqla_tune.{leaf}"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "\n".join(bad)
