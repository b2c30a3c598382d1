"""Bad inputs and faults around packs, publishing and the kernel cache (the cases of
../shared/reference/bad-input-cases.md named by each test's bad_input marker): nothing of the
user's is replaced or followed through a link, a build killed at any point leaves a pack that
readers load and leftovers the next build removes, and every bad value is a clear error naming
the file, the field or the path. No compiler runs: pack_doubles' FakeBinary packs,
test_cli_build's kernel-cache double, a host-extension builder double below, and SIGKILLs
injected into subprocesses."""
from __future__ import annotations

import errno
import json
import os
import platform
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import flashqla_tune
from flashqla_tune import cache as kernel_cache
from flashqla_tune import content_hash, environment, host_path, loader, pack_build
from flashqla_tune.abi import ABI_VERSION
from flashqla_tune.cli import main
from flashqla_tune.content_hash import HashCache, checkpoint_hash
from flashqla_tune.environment import CacheLocationError, GPUInfo
from flashqla_tune.files import sha256_file
from flashqla_tune.pack import PackError, check_binaries, read_manifest, recover, staging_dir
from flashqla_tune.pack_build import build_pack
from flashqla_tune.plan import default_plan

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from pack_doubles import MODEL_SPEC, FakeLibraryOpener, edit_manifest, make_pack  # noqa: E402
from test_cli_build import KernelCacheDouble, checkpoint_and_calibration  # noqa: E402

KILL_TIMEOUT_S = 60


def fake_host_builder(folder: Path) -> host_path.PrebuiltExtension:
    """Test double of host_path.build_into: FakeBinary bytes recorded as built for this process."""
    folder.mkdir(parents=True, exist_ok=True)
    so = folder / "flashqla_tune_host_fake.so"
    so.write_bytes(b"FakeBinary host extension")
    return host_path.PrebuiltExtension(so, so.stem, torch.__version__, host_path.python_abi(),
                                       host_path.sources_sha256(), ABI_VERSION)


def no_host_compiler(folder: Path):
    raise OSError("no C++ compiler in this test")


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """A private cache, the kernel-cache double and a fixed toolchain record for build_pack."""
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    double = KernelCacheDouble(tmp_path / "kernels")
    monkeypatch.setattr(pack_build, "cache", double)
    monkeypatch.setattr(pack_build, "toolchain", lambda: {"nvcc": "test double", "cutlass": "-", "torch": "-"})
    ckpt, cal = checkpoint_and_calibration(tmp_path)
    return double, ckpt, cal


def _build(ckpt, cal, out, build_host=no_host_compiler, log=None, **kw):
    return build_pack(ckpt, out, (1,), tune=False, calibration=cal, progress=False, build_host=build_host,
                      log=log if log is not None else (lambda msg: None), **kw)


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# --- nothing of the user's is replaced ---------------------------------------------------------------

@pytest.mark.bad_input("build --out a folder of another tool holding a valid manifest.json",
                       "build --out a folder holding a non-JSON manifest.json", "outdir:build_onto_file")
@pytest.mark.parametrize("force", [False, True])
def test_build_refuses_any_folder_that_is_not_its_own_pack(tmp_path, fakes, force):
    _, ckpt, cal = fakes
    foreign = tmp_path / "app"
    (foreign / "src").mkdir(parents=True)
    (foreign / "manifest.json").write_text(json.dumps({"name": "app", "version": "1.0", "manifest_version": 3}))
    (foreign / "src" / "app.js").write_text("console.log('mine')")
    (foreign / "README.md").write_text("keep me")
    not_json = tmp_path / "data"
    (not_json / "data").mkdir(parents=True)
    (not_json / "manifest.json").write_text("name = data\n")
    (not_json / "data" / "file.txt").write_text("keep me too")
    a_file = tmp_path / "build_out_file"
    a_file.write_text("a user's file")
    cases = [(foreign, "not a flashqla-tune pack's"), (not_json, "not JSON"), (a_file, "is a file, not a pack folder"),
             (a_file / "pack", "is a file, not a folder")]
    for out, named in cases:
        before = _tree(out) if out.is_dir() else (out.read_bytes() if out.is_file() else None)
        with pytest.raises(PackError, match=named) as caught:
            _build(ckpt, cal, out, force=force)
        assert str(out) in str(caught.value) or str(out.parent) in str(caught.value)
        if out.is_dir():
            assert _tree(out) == before
        elif before is not None:
            assert out.read_bytes() == before
    assert _siblings(foreign) == [] and _siblings(a_file) == []


def test_a_pack_of_its_own_is_replaced_even_when_damaged(tmp_path, fakes):
    _, ckpt, cal = fakes
    out = make_pack(tmp_path / "pack")               # another checkpoint's pack: rebuilt
    rep = _build(ckpt, cal, out)
    assert not rep.reused and "checkpoint changed" in rep.reason
    edit_manifest(out, lambda d: d.update(tp_sizes="12"))   # ours, but damaged: rebuilt, not refused
    rep = _build(ckpt, cal, out)
    assert not rep.reused and "existing pack unusable" in rep.reason and "tp_sizes" in rep.reason
    assert read_manifest(out).tp_sizes == (1,)


# --- publishing is crash-safe -------------------------------------------------------------------------

CHILD_PUBLISH = r"""
import os, shutil, signal, sys
from pathlib import Path
from flashqla_tune import pack
mode, new, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
staging = pack.staging_dir(out)
shutil.copytree(new, staging, dirs_exist_ok=True)
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "between the two renames":
    pack._exchange = lambda a, b: False      # the path of systems without an atomic exchange
    real_replace = os.replace
    def replace(a, b):
        real_replace(a, b)
        die()
    pack.os.replace = replace
else:                                        # after the atomic exchange, before the old pack is deleted
    pack.remove_path = die
pack.publish(staging, out)
sys.exit(3)
"""


@pytest.mark.bad_input("SIGKILL between publish()'s renames (injected)")
@pytest.mark.parametrize("mode", ["between the two renames", "after the exchange"])
def test_a_publish_killed_half_way_leaves_a_pack_readers_load(tmp_path, mode):
    out = make_pack(tmp_path / "site" / "pack")
    new = make_pack(tmp_path / "new")
    edit_manifest(new, lambda d: d["checkpoint"].update(path="/the-new-one"))
    run = subprocess.run([sys.executable, "-c", CHILD_PUBLISH, mode, str(new), str(out)], timeout=KILL_TIMEOUT_S,
                         capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert _siblings(out), "the kill left what a dead publish leaves"
    # a reader finds a whole pack at the path: the old one put back, or the new one swapped in
    m = read_manifest(out)
    assert m.checkpoint_path == ("/synthetic" if mode == "between the two renames" else "/the-new-one")
    check_binaries(out, m)
    opener = FakeLibraryOpener()
    assert flashqla_tune.load(out, 0, 1, gpu=None, open_library=opener).manifest == m and opener.opened
    # a later build's clean-up removes what the dead process left, and only that
    live = staging_dir(out)                          # this process is alive: its staging folder stays
    assert any("removed" in line for line in recover(out, clean=True))
    assert _siblings(out) == [live.name]
    assert read_manifest(out) == m


@pytest.mark.bad_input("kill -9 while calibrating", "kill -9 as the staging folder appears",
                       "kill -9 right after calibration.json is staged (warm cache: copy/manifest phase)")
@pytest.mark.parametrize("point", ["staging", "calibrating", "calibration staged"])
def test_a_build_killed_before_publishing_keeps_the_old_pack_and_the_next_build_cleans_up(tmp_path, fakes, point):
    _, ckpt, cal = fakes
    out = tmp_path / "pack"
    _build(ckpt, cal, out)
    before = _tree(out)
    child = r"""
import os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_cli_build import KernelCacheDouble
from flashqla_tune import pack_build
point, ckpt, cal, out, kernels = sys.argv[2:7]
pack_build.cache = KernelCacheDouble(Path(kernels))
pack_build.toolchain = lambda: {"nvcc": "test double", "cutlass": "-", "torch": "-"}
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
real_staging, real_calibration = pack_build.staging_dir, pack_build._calibration
if point == "staging":
    pack_build.staging_dir = lambda o: (real_staging(o), die())
elif point == "calibrating":
    pack_build._calibration = die
else:
    pack_build._calibration = lambda *a, **k: (real_calibration(*a, **k), die())
def no_host(folder):
    raise OSError("no C++ compiler")
pack_build.build_pack(Path(ckpt), Path(out), (1,), tune=False, calibration=Path(cal), progress=False, force=True,
                      log=lambda m: None, build_host=no_host)
sys.exit(3)
"""
    run = subprocess.run([sys.executable, "-c", child, str(TESTS), point, str(ckpt), str(cal), str(out),
                          str(tmp_path / "child-kernels")], timeout=KILL_TIMEOUT_S, capture_output=True, text=True,
                         env={**os.environ, "FLASHQLA_TUNE_CACHE": str(tmp_path / "cache")})
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert _tree(out) == before
    [leftover] = _siblings(out)
    assert leftover.startswith(".pack.staging-")
    if point == "calibration staged":
        assert (out.parent / leftover / "calibration.json").is_file()
    lines = []
    rep = _build(ckpt, cal, out, log=lines.append)
    assert rep.reused and _siblings(out) == []
    assert any(leftover in line and "died" in line for line in lines)


def test_leftovers_of_live_builds_stay_and_legacy_asides_restore(tmp_path):
    out = tmp_path / "pack"
    mine = staging_dir(out)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    dead_staging = out.parent / f".pack.staging-{dead_pid}-0123abcd"
    dead_staging.mkdir()
    legacy = make_pack(out.parent / ".pack.old-34f00511")      # an aside folder named without a pid
    assert read_manifest(out).checkpoint_path == "/synthetic"   # restored from it
    recover(out, clean=True)
    assert _siblings(out) == [mine.name] and not legacy.exists()


# --- the cache follows no link out of itself ---------------------------------------------------------

@pytest.mark.bad_input("kernels/.tmp symlink -> user folder: cache clear")
def test_cache_clear_unlinks_planted_links_and_keeps_their_targets(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True)
    user = tmp_path / "project"
    (user / "src").mkdir(parents=True)
    (user / "src" / "main.py").write_text("print('mine')")
    (user / "data").mkdir()
    (user / "data" / "x.bin").write_bytes(b"1234")
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("keep")
    (kernels / ".tmp").symlink_to(user, target_is_directory=True)
    (kernels / "gdn_planted-0123456789abcdef").symlink_to(other, target_is_directory=True)
    before = _tree(user), _tree(other)
    assert main(["cache", "ls"]) == 0
    assert "a symbolic link (not followed)" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert (_tree(user), _tree(other)) == before
    assert not (kernels / ".tmp").is_symlink() and not (kernels / "gdn_planted-0123456789abcdef").is_symlink()
    # a link planted inside a real .tmp goes too, its target stays
    (kernels / ".tmp").mkdir()
    (kernels / ".tmp" / "trash-planted").symlink_to(user, target_is_directory=True)
    assert main(["cache", "clear"]) == 0
    assert _tree(user) == before[0] and not (kernels / ".tmp" / "trash-planted").is_symlink()
    # a lock folder planted as a link is replaced by the cache's own before any lock file is made
    (kernels / ".locks").symlink_to(other, target_is_directory=True)
    with kernel_cache._locked(kernels, "ab" * 32):
        assert (kernels / ".locks").is_dir() and not (kernels / ".locks").is_symlink()
    assert _tree(other) == before[1]


# --- an unusable cache location is a clear error -----------------------------------------------------

@pytest.mark.bad_input("FLASHQLA_TUNE_CACHE is a file: compile", "FLASHQLA_TUNE_CACHE is a file: calibrate",
                       "FLASHQLA_TUNE_CACHE is a file: build", "FLASHQLA_TUNE_CACHE is a file: cache ls",
                       "FLASHQLA_TUNE_CACHE is a file: cache clear", "FLASHQLA_TUNE_CACHE is a file: info")
def test_a_cache_location_that_is_a_file_is_named_by_every_command(tmp_path, fakes, monkeypatch, capsys):
    _, ckpt, cal = fakes
    cache_file = tmp_path / "cache_is_a_file"
    cache_file.write_text("not a folder")
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(cache_file))
    named = f"{cache_file}: it is not a folder"
    for call in (environment.cache_dir, kernel_cache.kernels_dir, lambda: kernel_cache.lookup(default_plan(MODEL_SPEC)),
                 lambda: kernel_cache.get_kernels([default_plan(MODEL_SPEC)]),       # compile
                 lambda: checkpoint_hash(ckpt),                                      # calibrate
                 lambda: _build(ckpt, cal, tmp_path / "pack"),                       # build
                 environment.describe):                                              # info
        with pytest.raises(CacheLocationError, match=named):
            call()
    assert not (tmp_path / "pack").exists()
    monkeypatch.setattr(pack_build, "cache", kernel_cache)   # compile goes to the real cache (refused before nvcc)
    for argv in (["cache", "ls"], ["cache", "clear"], ["info"],
                 ["compile", "--hqk", "2", "--hv", "8", "--no-progress"]):
        assert main(argv) == 2, argv
        assert named in capsys.readouterr().err
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(cache_file / "below"))   # a file further up is named too
    with pytest.raises(CacheLocationError, match=f"{cache_file} is not a folder"):
        environment.cache_dir()
    assert cache_file.read_text() == "not a folder"


class ReadOnlyLock:
    """Test double of filelock.FileLock on a read-only filesystem: acquiring fails as os.open does there."""

    def __init__(self, path, *args, **kwargs):
        self.path = path

    def acquire(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), self.path)

    __enter__ = acquire

    def release(self):
        raise AssertionError("never acquired")

    def __exit__(self, *exc):
        self.release()


@pytest.mark.bad_input("ro cache: compile 4/8 (miss)", "ro cache: cache clear")
def test_a_read_only_kernel_cache_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "ro_cache"))
    monkeypatch.setattr(kernel_cache, "FileLock", ReadOnlyLock)
    monkeypatch.setattr(loader, "check_elf", lambda path: None)     # the entry's library is a byte double
    plan = default_plan(MODEL_SPEC.with_heads(4, 8))
    monkeypatch.setattr(kernel_cache, "keyed_source", lambda p, *a: kernel_cache.KeyedSource(
        p, "// source double", (), {}, "cd" * 32))                    # no nvcc: the key only
    with pytest.raises(kernel_cache.CacheError, match=f"kernel cache {tmp_path / 'ro_cache' / 'kernels'} cannot be "
                                                      f"written .*Read-only file system"):
        kernel_cache.get_kernels([plan])
    entry = tmp_path / "ro_cache" / "kernels" / f"{plan.name}-{'ab' * 8}"
    entry.mkdir(parents=True)
    (entry / "k.so").write_bytes(b"FakeBinary")
    (entry / "manifest.json").write_text(json.dumps({"key_format": kernel_cache.KEY_FORMAT, "key": "ab" * 32,
                                                     "so": "k.so", "so_sha256": sha256_file(entry / "k.so")}))
    assert main(["cache", "clear"]) == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err and "Read-only file system" in err and "FLASHQLA_TUNE_CACHE" in err
    assert entry.is_dir()


@pytest.mark.bad_input("ro cache: calibrate --out writable folder (fresh checkpoint copy: hash-cache miss)")
def test_a_read_only_hash_cache_warns_once_and_hashes_anyway(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "ro_cache"))
    ckpt, _ = checkpoint_and_calibration(tmp_path)
    (ckpt / "model-2.safetensors").write_bytes(b"a second stand-in shard")
    expected = checkpoint_hash(ckpt, HashCache(tmp_path / "writable" / "file_hashes.json"))
    monkeypatch.setattr(content_hash, "FileLock", ReadOnlyLock)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert checkpoint_hash(ckpt) == expected
    assert len(seen) == 1 and "cannot write the checkpoint-hash cache" in str(seen[0].message)
    assert str(tmp_path / "ro_cache") in str(seen[0].message)


# --- manifests are checked field by field ------------------------------------------------------------

@pytest.mark.bad_input("manifest: tp_sizes [0], load tp_size=0", "manifest: plans tp_size 1e30, load tp_size=1e30",
                       "manifest: segment_chunks 1e30", "manifest: tp_sizes '12' (string)")
@pytest.mark.parametrize("change, named", [
    (lambda d: d.update(tp_sizes=[0]), r"tp_sizes\[0\] is 0, expected 1\.\.2147483647"),
    (lambda d: d.update(tp_sizes="12"), "tp_sizes is '12', expected a non-empty list"),
    (lambda d: d.update(tp_sizes=[1, True]), r"tp_sizes\[1\] is True \(bool\), expected an integer"),
    (lambda d: d.update(tp_sizes=[1e30]), r"tp_sizes\[0\] is 1e\+30 \(float\), expected an integer"),
    (lambda d: [p.update(tp_size=1e30) for p in d["plans"]], r"plans\[0\]: tp_size is 1e\+30 \(float\)"),
    (lambda d: [p.update(tp_size=10**30) for p in d["plans"]], r"plans\[0\]: tp_size is 10{30}, expected 1\.\."),
    (lambda d: d["plans"][1].update(tp_size=4), r"plans\[1\]: tp_size 4 is not one of tp_sizes \[1, 2\]"),
    (lambda d: d["plans"][0].update(segment_chunks=[10**30] * 32), r"plans\[0\]: segment_chunks\[0\] is 10{30}"),
    (lambda d: d["plans"][0].update(segment_chunks=[1e30] * 32), r"plans\[0\] .*segment_chunks: a segment table"),
    (lambda d: d["plans"][0].update(segment_chunks=[2**31] + [0] * 31), r"segment_chunks\[0\] is 2147483648"),
    (lambda d: d["checkpoint"].update(num_gdn_layers=True), r"checkpoint.num_gdn_layers is True \(bool\)"),
    (lambda d: d["checkpoint"].update(num_gdn_layers=0), "checkpoint.num_gdn_layers is 0"),
    (lambda d: d["plans"][0].update(so_sha256=12), r"plans\[0\]: so_sha256 is 12 \(int\), expected a string"),
])
def test_manifest_fields_are_checked_naming_the_file_and_field(tmp_path, change, named):
    pack = make_pack(tmp_path / "p")
    edit_manifest(pack, change)
    opener = FakeLibraryOpener()
    with pytest.raises(PackError, match=named) as caught:
        flashqla_tune.load(pack, 0, 0 if "is 0, expected 1" in named else 1, gpu=None, open_library=opener)
    assert str(pack / "manifest.json") in str(caught.value) and opener.opened == []


def test_packs_of_other_schema_versions_and_hosts_are_refused_before_anything_opens(tmp_path):
    here = platform.machine()
    other = "aarch64" if here != "aarch64" else "x86_64"
    cases = [(lambda d: d.update(schema_version=3),
              r"schema version 3, newer than this flashqla-tune \S+ reads \(1\.\.2\): upgrade flashqla-tune, "
              r"or rebuild"),
             (lambda d: d.update(schema_version=0), r"schema version 0; .* reads versions 1\.\.2: rebuild the pack"),
             (lambda d: d.update(schema_version=True), "schema version True"),
             (lambda d: d["host"].update(machine=other), f"built on a {other} host; this machine is {here}: rebuild"),
             (lambda d: d.pop("host"), "damaged pack manifest: KeyError: 'host'")]
    for i, (change, named) in enumerate(cases):
        pack = make_pack(tmp_path / f"p{i}")
        edit_manifest(pack, change)
        opener = FakeLibraryOpener()
        with pytest.raises(PackError, match=named):
            flashqla_tune.load(pack, 0, 1, gpu=None, open_library=opener)
        assert opener.opened == []
    assert read_manifest(make_pack(tmp_path / "here")).machine == here
    # schema 1 (no host architecture recorded) still loads; build replaces it
    old = make_pack(tmp_path / "v1")
    edit_manifest(old, lambda d: (d.pop("host"), d.update(schema_version=1)))
    assert read_manifest(old).machine is None and flashqla_tune.load(old, 0, 1, gpu=None,
                                                                    open_library=FakeLibraryOpener())
    from pack_doubles import SHA
    reuse, why = pack_build._reuse_reason(old, SHA, (1, 2), {}, None)
    assert not reuse and "pack schema version 1, this flashqla-tune writes 2" in why


# --- an up-to-date pack: host/ alone, and the content hash on demand ---------------------------------

def test_an_up_to_date_pack_gets_only_its_host_extension_rebuilt(tmp_path, fakes):
    double, ckpt, cal = fakes
    out = tmp_path / "pack"
    _build(ckpt, cal, out)                                   # built where no host compiler was found
    assert read_manifest(out).host_extension is None
    kernels_before = {k: v for k, v in _tree(out).items() if k != "manifest.json"}
    calls = len(double.calls)
    rep = _build(ckpt, cal, out, build_host=no_host_compiler)  # still none here: nothing changes
    assert rep.reused and "could not be rebuilt here" in rep.reason and _siblings(out) == []
    rep = _build(ckpt, cal, out, build_host=fake_host_builder)
    assert not rep.reused and "only host/ rebuilt" in rep.reason and "has no C++ host extension" in rep.reason
    m = read_manifest(out)
    assert m.host_extension is not None and (out / m.host_extension.so).is_file()
    tree = _tree(out)
    assert {k: v for k, v in tree.items() if not k.startswith("host/") and k != "manifest.json"} == kernels_before
    assert len(double.calls) == calls                          # no kernel was asked for
    assert _build(ckpt, cal, out, build_host=fake_host_builder).reused
    # a torch (or Python) change: again only host/
    edit_manifest(out, lambda d: d["host_extension"].update(torch="1.0.0"))
    rep = _build(ckpt, cal, out, build_host=fake_host_builder)
    assert not rep.reused and "only host/" in rep.reason and "torch 1.0.0" in rep.reason
    assert read_manifest(out).host_extension.torch == torch.__version__ and _siblings(out) == []


@pytest.mark.bad_input("same-size in-place weight rewrite with the old mtime, then build")
def test_rehash_sees_a_checkpoint_rewritten_with_its_size_and_mtime_restored(tmp_path, fakes, monkeypatch, capsys):
    _, ckpt, cal = fakes
    out = tmp_path / "pack"
    _build(ckpt, cal, out)
    weights = ckpt / "model.safetensors"
    st = weights.stat()
    original = checkpoint_hash(ckpt)
    weights.write_bytes(bytes(reversed(weights.read_bytes())))   # same size, other bytes
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert checkpoint_hash(ckpt) == original                      # the fast path trusts size and mtime (by design)
    monkeypatch.setattr(pack_build, "_host_extension", lambda staging, build_host, log: None)  # no host compile
    argv = ["build", str(ckpt), "--out", str(out), "--no-tune", "--calibration", str(cal), "--no-progress"]
    assert main(argv) == 0 and "up to date" in capsys.readouterr().out
    assert main([*argv, "--rehash"]) == 2                         # the content is hashed again: a changed checkpoint
    err = capsys.readouterr().err
    assert "checkpoint" in err and checkpoint_hash(ckpt, HashCache(rehash=True))[:16] in err, err
    assert checkpoint_hash(ckpt) != original                      # and the remembered digest is the new one
    # every tuned build hashes the content again
    seen = []

    class Stop(Exception):
        pass

    def spy(checkpoint, cache=None):
        seen.append(cache.rehash)
        raise Stop

    monkeypatch.setattr(content_hash, "checkpoint_hash", spy)
    monkeypatch.setattr(environment, "gpu_info", lambda: GPUInfo("NVIDIA H200", (9, 0), 132, None))
    for tune in (True, False):
        with pytest.raises(Stop):
            build_pack(ckpt, out, (1,), tune=tune, calibration=cal, progress=False, log=lambda m: None)
    assert seen == [True, False]


def test_a_kernel_build_removes_what_dead_builds_left_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    tmp = tmp_path / "cache" / "kernels" / ".tmp"
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True).stdout)
    (tmp / f"build-{dead_pid}-aaaa1111" / "entry").mkdir(parents=True)
    (tmp / f"build-{dead_pid}-cccc3333").mkdir()          # a dead pid's recent folder: maybe another host's
    old = time.time() - kernel_cache.STALE_BUILD_S - 60
    os.utime(tmp / f"build-{dead_pid}-aaaa1111", (old, old))
    (tmp / f"build-{os.getpid()}-bbbb2222").mkdir()
    monkeypatch.setattr(kernel_cache, "keyed_source", lambda p, *a: kernel_cache.KeyedSource(
        p, "// source double", (), {}, "cd" * 32))
    seen = []

    def build_double(jobs, staging, config, parallel):   # stands in for nvcc: records what .tmp holds, fails
        seen.append(sorted(p.name for p in staging.parent.iterdir()))
        raise RuntimeError("build double")

    monkeypatch.setattr(kernel_cache, "build", build_double)
    with pytest.raises(RuntimeError, match="build double"):
        kernel_cache.get_kernels([default_plan(MODEL_SPEC)])
    [names] = seen
    assert f"build-{dead_pid}-aaaa1111" not in names and f"build-{os.getpid()}-bbbb2222" in names
    assert f"build-{dead_pid}-cccc3333" in names and len(names) == 3
