"""Bad-input cases of the toolchain, the kernel cache's entries and a pack on a machine without a
GPU: a broken nvcc, a cache entry whose library was cut short and re-hashed, a bit flip in a
checkpoint's weights, a pack loaded where no GPU is."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import flashqla_tune
from flashqla_tune import build, cache as kernel_cache, environment
from flashqla_tune.cli import main
from flashqla_tune.content_hash import HashCache, checkpoint_hash
from flashqla_tune.files import sha256_file
from flashqla_tune.plan import default_plan

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from pack_doubles import MODEL_SPEC, FakeLibraryOpener, make_pack  # noqa: E402


@pytest.fixture
def fresh_toolchain_lookups():
    """find_nvcc and nvcc --version are remembered per process; a test that changes PATH starts
    and ends with them forgotten."""
    lookups = (environment.find_nvcc, environment.nvcc_version_output, build.nvcc_version_text)
    for f in lookups:
        f.cache_clear()
    yield
    for f in lookups:
        f.cache_clear()


@pytest.mark.bad_input("nvcc --version fails (broken shim): compile 2/8")
def test_an_nvcc_that_does_not_answer_is_a_clear_error(tmp_path, monkeypatch, capsys, fresh_toolchain_lookups):
    shim = tmp_path / "bin" / "nvcc"
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\necho 'shim: cannot start' >&2\nexit 3\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    assert main(["compile", "--hqk", "2", "--hv", "8"]) == 2
    err = capsys.readouterr().err
    assert f"{shim} --version failed (exit status 3: shim: cannot start)" in err
    assert "Traceback" not in err


def _truncated_entry(root: Path) -> Path:
    """A cache entry whose library was cut to its first bytes and whose sha256 was recomputed."""
    entry = root / f"{default_plan(MODEL_SPEC).name}-{'ab' * 8}"
    entry.mkdir(parents=True)
    (entry / "k.so").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(9))   # an ELF header's first 16 bytes only
    (entry / "manifest.json").write_text(json.dumps({
        "key_format": kernel_cache.KEY_FORMAT, "key": "ab" * 32, "so": "k.so", "so_sha256": sha256_file(entry / "k.so"),
        "plan_name": default_plan(MODEL_SPEC).name, "resources": {}, "build_seconds": 1.0, "created": "now"}))
    return entry


@pytest.mark.bad_input("truncated+re-signed .so: compile 2/8", "after load_kernel: cache ls")
def test_a_cut_library_with_a_recomputed_hash_is_not_trusted(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    entry = _truncated_entry(kernel_cache.kernels_dir())
    manifest, why = kernel_cache.check_entry(entry, "ab" * 32)
    assert manifest is None and "k.so" in why and "not" in why   # stale: the build path replaces it
    assert main(["cache", "ls"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if entry.name in l)
    assert "INVALID" in line and "rebuilt on next use" in line


@pytest.mark.bad_input("calibrate:bitflip_data")
def test_a_bit_flip_in_the_weights_changes_the_checkpoint_hash(tmp_path):
    """Inherent: safetensors carries no checksum, so flipped weight bytes calibrate as weights. What
    holds is that the checkpoint's content hash changes, so no pack or calibration of the old
    bytes is taken for it."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    weights = bytearray(os.urandom(4096))
    (ckpt / "model.safetensors").write_bytes(bytes(weights))
    before = checkpoint_hash(ckpt, HashCache(tmp_path / "hashes.json"))
    weights[2048] ^= 0x10
    (ckpt / "model.safetensors").write_bytes(bytes(weights))
    after = checkpoint_hash(ckpt, HashCache(tmp_path / "hashes-2.json"))
    assert before != after


@pytest.mark.bad_input("good pack, CPU machine")
def test_a_pack_loads_without_a_gpu_and_its_op_names_the_device(tmp_path):
    """Loading on a machine without a GPU is allowed (a pack may be inspected or moved there); the
    first call on CPU tensors is refused by name, before any library call."""
    pack = make_pack(tmp_path / "pack")
    opener = FakeLibraryOpener()
    ops = flashqla_tune.load(pack, 0, 1, gpu=None, open_library=opener)
    q = torch.zeros(1, 8, MODEL_SPEC.num_qk_heads, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, 8, MODEL_SPEC.num_v_heads, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, 8, MODEL_SPEC.num_v_heads)
    with pytest.raises(ValueError, match="inputs must be on a CUDA device, got cpu"):
        ops.chunk_gated_delta_rule(q, q, v, g, g, layer=0)
