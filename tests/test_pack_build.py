"""`flashqla-tune build --no-tune` end to end on the embedded default model (CPU, nvcc): calibrate,
compile four plans (TP 1 and 2, each with the q/k-repeated form) and the C++ host path, write the
pack, reuse it when nothing changed, rebuild it for a changed checkpoint, and load it with the real
ctypes opener."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

import flashqla_tune
from flashqla_tune.calibrate.default_model import default_model_path
from flashqla_tune.cli import main
from flashqla_tune.pack import read_manifest

pytestmark = pytest.mark.slow
SMALL = ["--max-sequences", "4", "--seq-len", "512", "--no-progress"]


def test_build_no_tune_end_to_end(tmp_path, monkeypatch, capsys):
    pytest.importorskip("cutlass_library")
    if shutil.which("nvcc") is None:
        from flashqla_tune.environment import ToolchainError, find_nvcc
        try:
            find_nvcc()
        except ToolchainError:
            pytest.skip("needs nvcc")
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    pack = tmp_path / "pack"
    assert main(["build", str(default_model_path()), "--out", str(pack), "--tp", "1,2", "--no-tune", *SMALL]) == 0
    out, err = capsys.readouterr()
    assert "untuned sm_90a pack" in out
    assert "context parallel (segment tables from the pooled calibration" in out and "tp=2 native      2048 tokens: " in out
    assert "5 GDN layers x 8 v-heads" in err and "layer 0: " in err  # the calibration summary
    assert "compile [" not in err   # --no-progress: the per-plan lines are tests/test_cli_build.py's
    m = read_manifest(pack)
    assert not m.tuned and m.gpu["arch"] == "sm_90a" and m.tp_sizes == (1, 2)
    assert sorted((p.tp_size, p.form, p.heads) for p in m.plans) == [
        (1, "native", (2, 8)), (1, "qk_repeated", (8, 8)), (2, "native", (1, 4)), (2, "qk_repeated", (4, 4))]
    assert all((pack / p.so).is_file() and p.tuning is None for p in m.plans)
    # the eager op's C++ host path, compiled into the pack for this torch and Python
    from flashqla_tune import host_path
    assert m.host_extension is not None and (pack / m.host_extension.so).is_file()
    assert host_path.mismatch(m.host_extension) is None and f"C++ host path: {m.host_extension.so}" in out
    # the backward's chain kernels, built through the kernel cache, so the pack's op trains with
    # nothing compiled where it runs
    from flashqla_tune.backward import chain_kernels
    chain_spec = chain_kernels.spec_for(128, 128)
    assert m.backward is not None and m.backward.spec == chain_spec.to_dict() and (pack / m.backward.so).is_file()
    assert f"the backward's chain kernels {chain_spec.name} (built)" in err
    assert f"backward chain kernels: {m.backward.so}" in out
    # every plan carries the CP split it applies with this calibration (an H200's SMs: untuned)
    from flashqla_tune.calibration_artifact import load_calibration
    from flashqla_tune.pack_build import cp_segment_table
    cal_obj = load_calibration(pack / "calibration.json")
    assert all(p.segment_chunks == cp_segment_table(cal_obj, p.plan, None) and len(p.segment_chunks) == 32
               for p in m.plans)
    data = json.loads((pack / "manifest.json").read_text())
    assert data["toolchain"]["nvcc"] and data["toolchain"]["cutlass"] and data["calibration"]["sha256"]
    cal = json.loads((pack / "calibration.json").read_text())
    assert cal["checkpoint"]["sha256"] == m.checkpoint_sha256

    # info PACK describes what was built
    assert main(["info", str(pack)]) == 0
    described = capsys.readouterr().out
    assert "any sm_90 GPU" in described and "TP degrees 1, 2" in described and "DAMAGED" not in described
    assert f"C++ host path: {m.host_extension.so}" in described and "model-wide table" in described
    assert f"backward chain kernels: {m.backward.so}" in described

    # Unchanged checkpoint and options: reused, not rebuilt.
    before = (pack / "manifest.json").stat().st_mtime_ns
    assert main(["build", str(default_model_path()), "--out", str(pack), "--tp", "1,2", "--no-tune", *SMALL]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (pack / "manifest.json").stat().st_mtime_ns == before

    # The real loader opens the pack's libraries with ctypes (no GPU needed to open them), and
    # offers its backward library (opened, ABI-checked, on the first backward).
    monkeypatch.setattr(chain_kernels, "_libraries", {})
    monkeypatch.setattr(chain_kernels, "_offered", {})
    ops = flashqla_tune.load(pack, tp_rank=1, tp_size=2)
    assert chain_kernels._offered == {chain_spec: (pack / m.backward.so, m.backward.sha256)}
    assert chain_kernels.library(chain_spec).path == pack / m.backward.so
    assert sorted(lib.plan.name for lib in ops.libraries.values()) == sorted(
        p.plan.name for p in m.plans if p.tp_size == 2)
    assert ops.warmup_table().tolist() == cal["model_table"][4:]

    # A changed checkpoint at the same --out: rebuilt, with the new hash (binaries come from the cache).
    changed = tmp_path / "changed_model"
    shutil.copytree(default_model_path(), changed)
    weights = load_file(changed / "model.safetensors")
    name = next(n for n in sorted(weights) if n.endswith("A_log"))
    weights[name] = weights[name] * 1.5
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    assert main(["build", str(changed), "--out", str(pack), "--tp", "1,2", "--no-tune", *SMALL]) == 0
    assert "checkpoint changed" in capsys.readouterr().err
    m2 = read_manifest(pack)
    assert m2.checkpoint_sha256 != m.checkpoint_sha256 and m2.checkpoint_path == str(changed.resolve())
    assert [p.so_sha256 for p in m2.plans] == [p.so_sha256 for p in m.plans]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pack.")]
