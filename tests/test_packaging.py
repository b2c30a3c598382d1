"""A regular (non-editable) install carries templates/, csrc/ and calibrate/ and runs the CLI.

The wheel test builds the wheel, installs it into a fresh virtual environment (CPU torch
first, as a fresh machine would) and runs `flashqla-tune info` from outside the source tree.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_packages_list_matches_the_source_tree():
    """pyproject lists packages by hand (three live outside flashqla_tune/): none may be missing."""
    tool = _pyproject()["tool"]["setuptools"]
    listed = set(tool["packages"])
    mapping = tool["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts or "data" in rel.parts:
                continue
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    for pkg, folder in mapping.items():
        if not (ROOT / folder / "__init__.py").exists():
            found.add(pkg)  # a data-only folder (templates/, csrc/) installed as package data
    missing = found - listed
    assert not missing, f"packages in the source tree but not in pyproject.toml: {sorted(missing)}"


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_info(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
                   check=True, cwd=tmp_path)
    wheel = next(wheels.glob("flashqla_tune-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # CPU torch first: otherwise pip resolves torch>=2.8 to a multi-GB CUDA build.
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + [str(wheel)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(venv / "bin" / "flashqla-tune"), "info", str(ROOT / "tests/fixtures/configs/qwen3-next-80b-a3b")],
                         check=True, capture_output=True, text=True, cwd=tmp_path, env=env).stdout
    assert "cutlass" in out and "36 GDN of 48 layers" in out, out
    check = (
        "import flashqla_tune, flashqla_tune.calibrate, pathlib;"
        "from flashqla_tune.render import templates_dir, csrc_dir;"
        "assert 'site-packages' in flashqla_tune.__file__, flashqla_tune.__file__;"
        "assert (templates_dir() / 'gdn_fwd.cu.j2').is_file();"
        "assert (csrc_dir() / 'gdn_fwd_mainloop.cuh').is_file() and (csrc_dir() / 'gdn_abi.h').is_file();"
        "assert (csrc_dir() / 'gdn_torch_host.cpp').is_file();"  # the C++ host path builds from the wheel
        "assert 'site-packages' in str(templates_dir()), templates_dir();"
        "print('ok')"
    )
    res = subprocess.run([str(venv / "bin" / "python"), "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
