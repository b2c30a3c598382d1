"""`flashqla-tune build --no-tune` end to end on the embedded default model (CPU, nvcc; marked slow):
calibrate, compile four plans (TP 1 and 2, each with the q/k-repeated form), the backward's three
kernel libraries and the C++ host path, write the pack, reuse it when nothing changed, rebuild it for
a changed checkpoint, and load it with the real ctypes opener. Without nvcc: the backward libraries
a build records and a load offers, through test_cli_build's kernel cache double."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import flashqla_tune
from flashqla_tune.calibrate.default_model import default_model_path
from flashqla_tune.cli import main
from flashqla_tune.pack import read_manifest

sys.path.insert(0, str(Path(__file__).parent))
from pack_doubles import FakeLibraryOpener  # noqa: E402
from test_cli_build import KernelCacheDouble, checkpoint_and_calibration  # noqa: E402

SMALL = ["--max-sequences", "4", "--seq-len", "512", "--no-progress"]


@pytest.mark.slow
def test_build_no_tune_end_to_end(tmp_path, build_cache, monkeypatch, capsys):
    pytest.importorskip("cutlass_library")
    if shutil.which("nvcc") is None:
        from flashqla_tune.environment import ToolchainError, find_nvcc
        try:
            find_nvcc()
        except ToolchainError:
            pytest.skip("needs nvcc")
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(build_cache))   # shared: the backward's libraries build once a run
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
    # the backward's three kernel libraries, built through the kernel cache, so the pack's op trains
    # with nothing compiled where it runs
    from flashqla_tune.backward import libraries
    specs = {kind: module.spec_for(128, 128) for kind, module in libraries.modules().items()}
    assert [b.kind for b in m.backward] == ["chain", "prep", "chunk"]
    for b in m.backward:
        assert b.spec == specs[b.kind].to_dict() and (pack / b.so).is_file()
        assert (f"the backward's {b.kind} kernels {specs[b.kind].name} (built)" in err
                or f"the backward's {b.kind} kernels {specs[b.kind].name} (cached)" in err)
        assert f"    {b.kind}: {b.so}" in out
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
    assert all(f"    {b.kind}: {b.so}" in described for b in m.backward)

    # Unchanged checkpoint and options: reused, not rebuilt.
    before = (pack / "manifest.json").stat().st_mtime_ns
    assert main(["build", str(default_model_path()), "--out", str(pack), "--tp", "1,2", "--no-tune", *SMALL]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (pack / "manifest.json").stat().st_mtime_ns == before

    # The real loader opens the pack's libraries with ctypes (no GPU needed to open them), and
    # offers its backward libraries (each opened, ABI-checked, on its first use).
    from flashqla_tune.backward.kernel_library import LibraryTable
    for module in libraries.modules().values():
        monkeypatch.setattr(module, "LIBRARIES", LibraryTable(module.KIND))
    ops = flashqla_tune.load(pack, tp_rank=1, tp_size=2)
    for b in m.backward:
        module = libraries.module(b.kind)
        monkeypatch.setattr(module.LIBRARIES, "cache_entry", lambda *a, **k: pytest.fail("built instead"))
        assert module.LIBRARIES.get(specs[b.kind]).path == pack / b.so
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


def test_a_build_records_each_backward_library_and_a_load_offers_them(tmp_path, monkeypatch, capsys):
    from flashqla_tune import pack_build
    from flashqla_tune.backward import libraries

    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    double = KernelCacheDouble(tmp_path / "kernels")
    monkeypatch.setattr(pack_build, "cache", double)
    monkeypatch.setattr(pack_build, "toolchain", lambda: {"nvcc": "test double", "cutlass": "-", "torch": "-"})
    monkeypatch.setattr(pack_build, "_host_extension", lambda staging, build_host, log: None)
    renderers = []
    get_kernels = double.get_kernels
    monkeypatch.setattr(double, "get_kernels", lambda plans, renderer=None, **kw: renderers.append(renderer)
                        or get_kernels(plans, renderer, **kw))
    ckpt, cal_file = checkpoint_and_calibration(tmp_path)
    pack = tmp_path / "pack"
    argv = ["build", str(ckpt), "--out", str(pack), "--no-tune", "--calibration", str(cal_file), "--no-progress"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    m = read_manifest(pack)
    modules = libraries.modules()
    specs = {kind: module.spec_for(128, 128) for kind, module in modules.items()}
    assert [b.kind for b in m.backward] == ["chain", "prep", "chunk"]
    for b in m.backward:
        module = modules[b.kind]
        assert b.spec == specs[b.kind].to_dict() and b.abi_version == module.ABI_VERSION
        assert b.so == f"binaries/{specs[b.kind].name}.so" and (pack / b.so).read_bytes() == (
            double.entries[specs[b.kind]].so_path.read_bytes())
        assert module.LIBRARIES.renderer in renderers   # each built through the cache with its kind's renderer
        assert (f"the backward's {b.kind} kernels {specs[b.kind].name} (built)" in err
                or f"the backward's {b.kind} kernels {specs[b.kind].name} (cached)" in err)
        assert f"    {b.kind}: {b.so}" in out

    # the same build again: up to date (all three recorded and current)
    assert main(argv) == 0
    assert "up to date" in capsys.readouterr().out

    # info PACK lists each
    assert main(["info", str(pack)]) == 0
    described = capsys.readouterr().out
    assert "  backward kernels:\n" in described and all(f"    {b.kind}: {b.so}\n" in described for b in m.backward)

    # a load offers all three to their kinds' tables (nothing opened until first use)
    offered = []
    for kind, module in modules.items():
        monkeypatch.setattr(module.LIBRARIES, "offer",
                            lambda spec, path, sha, kind=kind: offered.append((kind, spec, path, sha)))
    flashqla_tune.load(pack, gpu=None, open_library=FakeLibraryOpener())
    assert offered == [(b.kind, specs[b.kind], pack / b.so, b.sha256) for b in m.backward]

    # a kind with no library for the dims is left out of the build, said in the log
    def no_prep(K, V):
        raise ValueError(f"no prep for K={K}, V={V} in this test")

    monkeypatch.setattr(modules["prep"], "spec_for", no_prep)
    assert main([*argv, "--force"]) == 0
    out, err = capsys.readouterr()
    assert "build: no backward prep kernels for K=128, V=128 (no prep for K=128, V=128 in this test)" in err
    assert [b.kind for b in read_manifest(pack).backward] == ["chain", "chunk"]
    assert "    prep: none (no prep kernels for these head dims: the backward runs that part in torch)" in out
