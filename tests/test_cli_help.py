"""The command line's first contact: --version, and --help of the command and of every subcommand
answering in a fresh interpreter without importing torch, the compiler or the calibration; an
unsupported checkpoint refused by `info` and `build` from its config.json alone, before torch."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashqla_tune import __version__
from flashqla_tune.cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = Path(__file__).parent / "fixtures" / "configs"
HEAVY = ("torch", "jinja2", "transformers", "numpy", "flashqla_tune.cache", "flashqla_tune.calibrate")

# Runs the command in this fresh interpreter, timing it from before the package's import, and
# reports its exit status, output, seconds and which heavy modules it imported.
RUN = r"""
import contextlib, io, json, sys, time
start = time.perf_counter()
from flashqla_tune.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        rc = main(json.loads(sys.argv[1]))
    except SystemExit as exc:
        rc = exc.code
seconds = time.perf_counter() - start
heavy = json.loads(sys.argv[2])
print(json.dumps({"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "seconds": seconds,
                  "imported": sorted(m for m in sys.modules for h in heavy if m == h or m.startswith(h + "."))}))
"""


def fresh(argv, tries: int = 3):
    """The command in a fresh interpreter; its time is the fastest of up to `tries` runs (a loaded
    machine's scheduling is not the command's time), stopping at the first under a second."""
    best = None
    for _ in range(tries):
        proc = subprocess.run([sys.executable, "-c", RUN, json.dumps(argv), json.dumps(HEAVY)], capture_output=True,
                              text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr
        res = json.loads(proc.stdout.splitlines()[-1])
        best = res if best is None or res["seconds"] < best["seconds"] else best
        if best["seconds"] < 1.0:
            break
    return best


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in SUBCOMMANDS),
                                  ["cache", "ls", "--help"], ["--version"]])
def test_help_imports_no_torch_and_answers_in_under_a_second(argv):
    res = fresh(argv)
    assert res["rc"] == 0 and ("usage: flashqla-tune" in res["out"] or res["out"].startswith("flashqla-tune ")), res
    assert not res["imported"], f"{' '.join(argv)} imported {res['imported'][:5]}"
    assert res["seconds"] < 1.0, f"{' '.join(argv)} took {res['seconds']:.2f} s"


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"flashqla-tune {__version__}"


def test_every_subcommand_is_listed_with_its_help():
    out = fresh(["--help"])["out"]
    assert all(name in out for name in SUBCOMMANDS)
    build = fresh(["build", "--help"])["out"]
    for flag in ("--eps", "--quantile", "--max-window", "--device", "--offload", "--dtype", "--state-layout",
                 "--calibration", "--json", "--no-progress", "--batch-size"):
        assert flag in build, flag


def tiny_checkpoint(folder: Path, **changes) -> Path:
    """A config.json-only Qwen3-Next checkpoint: 2 q/k heads, 8 v-heads, 3 GDN layers of 4."""
    cfg = {"model_type": "qwen3_next", "num_hidden_layers": 4, "hidden_size": 64,
           "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_num_key_heads": 2,
           "linear_num_value_heads": 8, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
    cfg.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("command", ["info", "build"])
@pytest.mark.parametrize("changes, named", [({"linear_key_head_dim": 64}, "unsupported head dims K=64, V=128"),
                                            ({"model_type": "llama"}, "model_type='llama' is not a GDN model")])
def test_an_unsupported_checkpoint_is_refused_from_its_config_before_any_work(tmp_path, command, changes, named):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", **changes)
    argv = [command, str(ckpt)] + (["--out", str(tmp_path / "pack"), "--no-tune"] if command == "build" else [])
    res = fresh(argv)
    assert res["rc"] == 2 and named in res["err"], res
    assert not res["imported"], f"refusing imported {res['imported'][:5]}"
    assert res["seconds"] < 1.0 and not (tmp_path / "pack").exists()
