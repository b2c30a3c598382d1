"""`flashqla-tune build` flags without nvcc: a finished calibration reused (--calibration, checked
against the checkpoint), the kernel form (--dtype, --state-layout), --json, progress lines, and
`info PACK` and `cache ls` on what comes out. The kernel cache is a named test double here;
tests/test_pack_build.py builds for real."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from flashqla_tune import cache as kernel_cache
from flashqla_tune import loader, pack_build
from flashqla_tune.content_hash import checkpoint_hash
from flashqla_tune.calibration_artifact import save_calibration
from flashqla_tune.cli import main
from flashqla_tune.files import sha256_file
from flashqla_tune.pack import read_manifest

sys.path.insert(0, str(Path(__file__).parent))
from pack_doubles import synthetic_calibration  # noqa: E402
from test_cli_help import tiny_checkpoint  # noqa: E402


class KernelCacheDouble:
    """Stands in for flashqla_tune.cache in pack_build: every plan "builds" into a FakeBinary file,
    instantly; it records which plans were asked for in each get_kernels call."""

    def __init__(self, root: Path):
        self.root = root
        self.entries: dict = {}
        self.calls: list[list[str]] = []

    def lookup(self, plan, *args, **kwargs):
        return self.entries.get(plan)

    def get_kernels(self, plans, renderer=None, jobs=None, force=False):
        self.calls.append([p.name for p in plans])
        out = []
        for plan in plans:
            if plan not in self.entries:
                folder = self.root / plan.name
                folder.mkdir(parents=True)
                (folder / "k.so").write_bytes(b"FakeBinary " + plan.name.encode())
                self.entries[plan] = kernel_cache.CacheEntry(
                    plan, "0" * 64, folder, {"so": "k.so", "build_seconds": 0.5, "resources": {}}, built=True)
                out.append(self.entries[plan])
            else:
                e = self.entries[plan]
                out.append(kernel_cache.CacheEntry(e.plan, e.key, e.path, e.manifest, built=False))
        return out


def no_host_extension(folder):
    raise RuntimeError("no host compiler in this test")


@pytest.fixture
def doubles(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    double = KernelCacheDouble(tmp_path / "kernels")
    monkeypatch.setattr(pack_build, "cache", double)
    monkeypatch.setattr(pack_build, "toolchain", lambda: {"nvcc": "test double", "cutlass": "-", "torch": "-"})
    monkeypatch.setattr(pack_build, "_host_extension", lambda staging, build_host, log: None)
    return double


def checkpoint_and_calibration(tmp_path: Path) -> tuple[Path, Path]:
    """A config.json + stand-in weights checkpoint (hashable, never run) and a finished calibration
    made for it (the synthetic tables of pack_doubles under this checkpoint's hash)."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "model.safetensors").write_bytes(b"stand-in weights: hashed, never loaded")
    cal = synthetic_calibration()
    cal.checkpoint_sha256, cal.checkpoint_path = checkpoint_hash(ckpt), str(ckpt)
    cal.run = {"device": "cpu", "dtype": "torch.float32", "seconds": 1.0}
    cal.corpus = {"name": "synthetic", "sha256": "0" * 64, "num_sequences": 1, "seq_len": 4096, "num_tokens": 4096}
    return ckpt, save_calibration(cal, tmp_path / "made" / "calibration.json")


def test_build_reuses_a_finished_calibration_and_info_describes_the_pack(tmp_path, doubles, capsys):
    ckpt, cal_file = checkpoint_and_calibration(tmp_path)
    pack = tmp_path / "pack"
    argv = ["build", str(ckpt), "--out", str(pack), "--no-tune", "--tp", "1,2", "--calibration", str(cal_file)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert f"calibration from {cal_file}" in err and "not calibrating" in err
    assert "compile: 4 plan(s) to build" in err and "compile [4/4] " in err   # progress lines
    m = read_manifest(pack)
    assert (pack / "calibration.json").read_bytes() == cal_file.read_bytes()
    assert m.calibration_sha256 == sha256_file(cal_file) and m.build["calibration_sha256"] == m.calibration_sha256
    assert (pack / "calibration.md").is_file() and sorted(p.tp_size for p in m.plans) == [1, 1, 2, 2]
    assert "untuned sm_90a pack" in out

    # The same build again: reused; --json reports it.
    assert main([*argv, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["reused"] and "up to date" in rep["reason"] and rep["manifest"]["build"] == m.build

    # info PACK: plans, head forms, TP degrees, calibration summary, the GPU it is for.
    assert main(["info", str(pack)]) == 0
    text = capsys.readouterr().out
    assert "untuned sm_90a" in text and "any sm_90 GPU" in text and "TP degrees 1, 2" in text
    assert "qk_repeated" in text and "native" in text and "layer 1: " in text and "model-wide table" in text
    assert all(p.plan.name in text for p in m.plans) and "DAMAGED" not in text
    assert main(["info", "--json", str(pack)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["problems"] == [] and info["calibration"]["settings"]["eps"] == 1e-5
    assert info["manifest"]["tp_sizes"] == [1, 2] and len(info["manifest"]["plans"]) == 4

    # A damaged binary: described, flagged, exit 1.
    next((pack / "binaries").iterdir()).write_bytes(b"x")
    assert main(["info", str(pack)]) == 1
    assert "DAMAGED: " in capsys.readouterr().out


def test_state_layout_and_dtype_change_the_pack_spec(tmp_path, doubles, capsys):
    ckpt, cal_file = checkpoint_and_calibration(tmp_path)
    pack = tmp_path / "pack"
    base = ["build", str(ckpt), "--out", str(pack), "--no-tune", "--calibration", str(cal_file), "--no-progress"]
    assert main(base) == 0
    assert read_manifest(pack).spec.state_layout == "kv"
    capsys.readouterr()
    assert main([*base, "--state-layout", "vk", "--dtype", "float16", "--json"]) == 0
    out, err = capsys.readouterr()
    rep = json.loads(out)   # --json: stdout is the report alone
    assert not rep["reused"] and "spec changed" in rep["reason"]
    assert "compile:" not in err and "compile [" not in err   # --no-progress
    m = read_manifest(pack)
    assert m.spec.state_layout == "vk" and m.spec.qkv_dtype == "float16"
    assert m.plans and all("_fp16_vk__" in p.plan.name for p in m.plans)


@pytest.mark.parametrize("break_it, named", [
    (lambda f, other: f.write_text("{not json"), "damaged calibration artifact"),
    (lambda f, other: f.write_text(f.read_text().replace(other, "cd" * 32)), "cdcdcdcdcdcdcdcd"),
])
def test_a_calibration_of_another_checkpoint_or_a_corrupt_one_is_refused(tmp_path, doubles, capsys, break_it, named):
    ckpt, cal_file = checkpoint_and_calibration(tmp_path)
    sha = checkpoint_hash(ckpt)
    break_it(cal_file, sha)
    assert main(["build", str(ckpt), "--out", str(tmp_path / "pack"), "--no-tune", "--calibration", str(cal_file)]) == 2
    err = capsys.readouterr().err
    assert named in err and not (tmp_path / "pack").exists() and doubles.calls == []
    if named.startswith("cd"):
        assert sha[:16] in err   # both hashes named


def test_calibration_flags_are_refused_with_a_finished_calibration(tmp_path, doubles, capsys):
    ckpt, cal_file = checkpoint_and_calibration(tmp_path)
    assert main(["build", str(ckpt), "--out", str(tmp_path / "p"), "--no-tune", "--calibration", str(cal_file),
                 "--eps", "1e-4", "--offload"]) == 2
    assert "--eps, --offload: no effect with --calibration" in capsys.readouterr().err
    assert main(["build", str(ckpt), "--out", str(tmp_path / "p"), "--no-tune", "--calibration",
                 str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err
    assert main(["build", str(ckpt), "--out", str(tmp_path / "p"), "--no-tune", "--eps", "2"]) == 2
    assert "eps must be in (0, 1), got 2.0" in capsys.readouterr().err
    assert doubles.calls == []


def test_calibration_flags_reach_the_calibration(tmp_path, doubles, monkeypatch, capsys):
    """Without --calibration, build calibrates with calibrate's flags (the pipeline is a recorder here)."""
    import flashqla_tune.calibrate.pipeline as pipeline
    from flashqla_tune.calibrate.pipeline import CalibrationResult

    ckpt, cal_file = checkpoint_and_calibration(tmp_path)
    from flashqla_tune.calibration_artifact import load_calibration
    seen = {}

    def calibrate_double(checkpoint, corpus, settings, out_dir=None, **kw):
        seen.update(kw, corpus=corpus, settings=settings)
        cal = load_calibration(cal_file)
        save_calibration(cal, out_dir)
        return CalibrationResult(cal, None, None, None)

    monkeypatch.setattr(pipeline, "calibrate_checkpoint", calibrate_double)
    assert main(["build", str(ckpt), "--out", str(tmp_path / "p"), "--no-tune", "--eps", "1e-4", "--quantile", "0.99",
                 "--max-window", "8", "--device", "cpu", "--offload", "--batch-size", "2", "--seq-len", "256",
                 "--no-progress"]) == 0
    s = seen["settings"]
    assert (s.eps, s.quantile, s.max_window) == (1e-4, 0.99, 8)
    assert seen["device"] == "cpu" and seen["offload"] and seen["batch_size"] == 2 and seen["seq_len"] == 256
    assert not seen["progress"] and "compile [" not in capsys.readouterr().err
    assert read_manifest(tmp_path / "p").build["settings"]["eps"] == 1e-4


def test_cache_ls_flags_spills_only_above_the_budget(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "check_elf", lambda path: None)  # the entries' libraries are byte doubles
    root = kernel_cache.kernels_dir()
    for name, spill, key in (("small", 64, "5" * 64), ("large", 65, "1" * 64), ("none", 0, "0" * 64)):
        folder = root / f"plan_{name}-{key[:16]}"
        folder.mkdir(parents=True)
        (folder / "k.so").write_bytes(name.encode())
        resources = {"kern": {"entry": True, "registers": 168, "spill_stores": spill, "spill_loads": 0}}
        (folder / "manifest.json").write_text(json.dumps({
            "key_format": kernel_cache.KEY_FORMAT, "key": key, "so": "k.so", "so_sha256": sha256_file(folder / "k.so"),
            "plan_name": f"plan_{name}", "resources": resources, "build_seconds": 1.0, "created": "now"}))
    assert main(["cache", "ls"]) == 0
    lines = {line.split()[0].split("-")[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "SPILLS 65 B" in lines["plan_large"]
    assert "SPILLS" not in lines["plan_small"] and "64 B spilled" in lines["plan_small"]
    assert "no spill" in lines["plan_none"]
    assert main(["cache", "ls", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    flagged = {Path(e["path"]).name.split("-")[0]: e["spill_flagged"] for e in entries}
    assert flagged == {"plan_large": True, "plan_small": False, "plan_none": False}


def test_the_op_logs_one_line_when_it_compiles_a_plan_on_first_use(monkeypatch, caplog, tmp_path):
    from flashqla_tune.plan import default_plan
    from flashqla_tune.spec import GDNSpec

    plan = default_plan(GDNSpec(2, 8))
    built = []
    monkeypatch.setattr(kernel_cache, "lookup", lambda plan, *a: built[-1] if built else None)

    def get_kernel(plan, *a):
        (tmp_path / "k.so").write_bytes(b"library double")   # the loader checks who can write to it
        built.append(kernel_cache.CacheEntry(plan, "k", tmp_path, {"so": "k.so"}, built=True))
        return built[-1]

    monkeypatch.setattr(kernel_cache, "get_kernel", get_kernel)
    monkeypatch.setattr(loader, "open_library", lambda so, plan: ("library double", plan.name))
    with caplog.at_level(logging.INFO, logger="flashqla_tune"):
        assert loader.load_kernel(plan) == ("library double", plan.name)
        assert loader.load_kernel(plan) == ("library double", plan.name)   # cached: no second line
    lines = [r.getMessage() for r in caplog.records if r.name == "flashqla_tune"]
    assert len(lines) == 1 and plan.name in lines[0] and "first use" in lines[0]


def test_calibrate_json_reports_the_files_and_the_summary(tmp_path, monkeypatch, capsys):
    import flashqla_tune.calibrate.pipeline as pipeline
    from flashqla_tune.calibrate.pipeline import CalibrationResult
    from flashqla_tune.calibration_artifact import load_calibration

    ckpt, cal_file = checkpoint_and_calibration(tmp_path)
    monkeypatch.setattr(pipeline, "calibrate_checkpoint", lambda *a, **kw: CalibrationResult(
        load_calibration(cal_file), cal_file, cal_file.with_suffix(".md"), cal_file.with_suffix(".png")))
    assert main(["calibrate", str(ckpt), "--json", "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["artifact"] == str(cal_file) and data["calibration"]["model_table"] == load_calibration(
        cal_file).model_table()
    assert [layer["layer"] for layer in data["calibration"]["layers"]] == [0, 1, 2]


def test_compile_takes_the_kernel_form_for_a_checkpoint_and_refuses_unsupported_ones(tmp_path):
    from flashqla_tune.cli import build_parser
    from flashqla_tune.cli.compile import specs_for
    from flashqla_tune.supported_shapes import UnsupportedShapeError

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    specs = specs_for(build_parser().parse_args(["compile", str(ckpt), "--state-layout", "vk", "--dtype", "float16"]))
    assert [(s.num_qk_heads, s.num_v_heads, s.state_layout, s.qkv_dtype) for s in specs] == [
        (2, 8, "vk", "float16"), (8, 8, "vk", "float16")]
    assert specs_for(build_parser().parse_args(["compile", "--hqk", "2", "--hv", "4"]))[0].state_layout == "kv"
    wide = tiny_checkpoint(tmp_path / "wide", linear_value_head_dim=256)
    with pytest.raises(UnsupportedShapeError, match="V=256"):
        specs_for(build_parser().parse_args(["compile", str(wide)]))
