"""Bad inputs and faults on the code-loading side: malformed libraries, pack signatures,
reproducible builds, a kernel cache others can write to, shell metacharacters in build paths,
and a killed build's compilers.

Everything here runs without a GPU or nvcc (test doubles stand in for the compiler and the
libraries) except the one slow test that builds a fixture plan twice and compares the bytes.
Tests that would die with SIGBUS if a check regressed run their loading in a child process.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import sysconfig
import textwrap
import time
from functools import partial
from pathlib import Path

import pytest

import flashqla_tune
from flashqla_tune import build as build_mod
from flashqla_tune import cache as kernel_cache
from flashqla_tune import environment, host_path, loader, pack_signing
from flashqla_tune.build import BuildConfig, BuildJob, UnsafePathError
from flashqla_tune.cli import main
from flashqla_tune.cli import verify as verify_cli
from flashqla_tune.pack import read_manifest, sha256_file
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec

from pack_doubles import FakeLibraryOpener, edit_manifest, make_pack
from toolchain import needs_nvcc

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
bad_input = pytest.mark.bad_input


def a_shared_library() -> Path:
    """A real ELF shared object of this host (one of Python's own extension modules)."""
    for folder in (sysconfig.get_config_var("DESTSHARED"), sysconfig.get_paths().get("platstdlib")):
        if folder and Path(folder).is_dir():
            found = sorted(Path(folder).rglob("*.so"), key=lambda p: p.stat().st_size)
            found = [p for p in found if p.stat().st_size > 16384]
            if found:
                return found[0]
    pytest.skip("no shared library of this Python to copy")


def truncated_copy(dest: Path) -> Path:
    data = a_shared_library().read_bytes()
    dest.write_bytes(data[: len(data) // 2])
    return dest


def run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run Python code in a fresh interpreter (a SIGBUS there fails the test instead of killing it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


# ---- malformed libraries are refused before dlopen --------------------------------------------

def test_check_elf_accepts_a_real_library_and_refuses_damage(tmp_path):
    good = a_shared_library()
    loader.check_elf(good)
    cases = {"empty": b"", "not_elf": b"#!/bin/sh\necho hi\n" * 10, "truncated": good.read_bytes()[:4096]}
    data = bytearray(good.read_bytes())
    data[16:18] = struct.pack("<H", 2)            # ET_EXEC: an executable, not a shared object
    cases["exec"] = bytes(data)
    for name, content in cases.items():
        path = tmp_path / f"{name}.so"
        path.write_bytes(content)
        with pytest.raises(loader.MalformedLibraryError, match=name):
            loader.check_elf(path)


def test_a_library_of_another_host_architecture_is_refused_naming_both(tmp_path):
    data = bytearray(a_shared_library().read_bytes())
    mine = struct.unpack_from("<H", data, 18)[0]
    other = 183 if mine == 62 else 62
    struct.pack_into("<H", data, 18, other)
    path = tmp_path / "other.so"
    path.write_bytes(bytes(data))
    with pytest.raises(loader.MalformedLibraryError, match="rebuild it on this host") as err:
        loader.check_elf(path)
    assert ("aarch64" if other == 183 else "x86-64") in str(err.value)


@bad_input("binary truncated (re-signed)")
def test_a_pack_with_a_truncated_rehashed_binary_is_refused_without_sigbus(tmp_path):
    pack = make_pack(tmp_path / "pack", tp_sizes=(1,))
    manifest = read_manifest(pack)
    so = manifest.plans[0].so
    truncated_copy(pack / so)
    edit_manifest(pack, lambda d: d["plans"][0].update(so_sha256=sha256_file(pack / so)))
    out = run_child(f"""
        import flashqla_tune
        from flashqla_tune.pack import PackError
        try:
            flashqla_tune.load({str(pack)!r}, gpu=None)
        except PackError as exc:
            print("REFUSED", exc)
    """)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "REFUSED" in out.stdout and "not a complete shared library" in out.stdout and so in out.stdout


@bad_input("truncated+re-signed .so: loader.load_kernel (CPU)")
def test_a_truncated_cache_entry_goes_through_the_drop_and_rebuild_path(tmp_path):
    cache_root = tmp_path / "cache"
    out = run_child(f"""
        from pathlib import Path
        from flashqla_tune import cache, loader
        from flashqla_tune.plan import default_plan
        from flashqla_tune.spec import GDNSpec
        from test_bad_input_security import truncated_copy, a_shared_library
        import shutil

        root = Path({str(cache_root)!r}) / "kernels"
        plan = default_plan(GDNSpec(2, 8))
        def entry(name, make):
            folder = root / name
            folder.mkdir(parents=True)
            make(folder / "k.so")
            return cache.CacheEntry(plan, name, folder, {{"so": "k.so"}}, built=False)
        events = []
        cache.lookup = lambda *a: entry("truncated", truncated_copy)
        def rebuild(*a, **kw):
            events.append("rebuilt")
            return entry("rebuilt", lambda p: shutil.copyfile(a_shared_library(), p))
        cache.get_kernel = rebuild
        cache.invalidate = lambda e: events.append("dropped " + e.key)
        try:
            loader.load_kernel(plan, root=root)
        except loader.StaleKernelError as exc:
            print(events, exc)
    """)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    # the truncated entry is dropped and rebuilt; the "rebuilt" double is an ELF without the ABI
    assert "['dropped truncated', 'rebuilt']" in out.stdout
    assert "lacks an ABI symbol" in out.stdout and "not a complete shared library" in out.stdout


def test_a_truncated_host_extension_is_refused_before_import(tmp_path):
    path = truncated_copy(tmp_path / "flashqla_tune_host_x.so")
    with pytest.raises(loader.MalformedLibraryError):
        host_path.import_prebuilt(path, "flashqla_tune_host_x")


# ---- signatures --------------------------------------------------------------------------------

@pytest.fixture
def key(tmp_path):
    private, public = pack_signing.generate_key(tmp_path / "signing.key")
    return private, public


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "k"
    assert main(["keygen", "--out", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert b"PUBLIC KEY" in (tmp_path / "k.pub").read_bytes()
    before = out.read_bytes()
    assert main(["keygen", "--out", str(out)]) == 2
    assert "not overwriting" in capsys.readouterr().err and out.read_bytes() == before


def test_a_signed_pack_loads_with_its_key_given_every_way(tmp_path, key):
    private, public = key
    pack = make_pack(tmp_path / "pack")
    assert main(["sign", str(pack), "--key", str(private)]) == 0
    raw = pack_signing.load_public_key(public)
    for trusted in ([public], [str(public)], [public.read_bytes()], [public.read_text()], [raw]):
        ops = flashqla_tune.load(pack, gpu=None, open_library=FakeLibraryOpener(), trusted_keys=trusted)
        assert ops.num_layers == 3


@bad_input("pack whose binary is replaced by an attacker .so, manifest sha re-computed")
def test_a_replaced_binary_with_a_rehashed_manifest_is_refused_before_anything_is_opened(tmp_path, key):
    private, public = key
    pack = make_pack(tmp_path / "pack", tp_sizes=(1,))
    pack_signing.sign_pack(pack, private)
    so = read_manifest(pack).plans[0].so
    (pack / so).write_bytes(b"attacker's library")
    edit_manifest(pack, lambda d: d["plans"][0].update(so_sha256=sha256_file(pack / so)))
    opener = FakeLibraryOpener()
    with pytest.raises(pack_signing.PackSignatureError, match="differ from what was signed") as err:
        flashqla_tune.load(pack, gpu=None, open_library=opener, trusted_keys=[public])
    assert "manifest.json" in str(err.value) and so in str(err.value)
    assert opener.opened == []
    # without keys the recomputed hashes pass (all the sha256 check can show is damage)
    flashqla_tune.load(pack, gpu=None, open_library=FakeLibraryOpener())


def test_an_unsigned_pack_or_one_signed_by_another_key_is_refused_when_keys_are_given(tmp_path, key):
    private, public = key
    pack = make_pack(tmp_path / "pack")
    opener = FakeLibraryOpener()
    with pytest.raises(pack_signing.PackSignatureError, match="not signed"):
        flashqla_tune.load(pack, gpu=None, open_library=opener, trusted_keys=[public])
    other_private, other_public = pack_signing.generate_key(tmp_path / "other.key")
    pack_signing.sign_pack(pack, other_private)
    with pytest.raises(pack_signing.PackSignatureError, match="not among the trusted keys"):
        flashqla_tune.load(pack, gpu=None, open_library=opener, trusted_keys=[public])
    # a forged signature.json: the files match, the signature does not
    record = json.loads((pack / "signature.json").read_text())
    record["public_key"], record["key_id"] = "", "forged"
    (pack / "signature.json").write_text(json.dumps(record))
    with pytest.raises(pack_signing.PackSignatureError):
        flashqla_tune.load(pack, gpu=None, open_library=opener, trusted_keys=[public])
    assert opener.opened == []
    with pytest.raises(pack_signing.SigningKeyError, match="private key"):
        flashqla_tune.load(pack, gpu=None, open_library=opener, trusted_keys=[private])
    with pytest.raises(pack_signing.SigningKeyError, match="empty"):
        flashqla_tune.load(pack, gpu=None, open_library=opener, trusted_keys=[])


def test_the_signature_covers_the_calibration_and_the_host_extension(tmp_path, key):
    private, public = key
    pack = make_pack(tmp_path / "pack")
    (pack / "host").mkdir()
    (pack / "host" / "ext.so").write_bytes(b"host extension double")
    edit_manifest(pack, lambda d: d.update(host_extension={
        "so": "host/ext.so", "sha256": sha256_file(pack / "host" / "ext.so"), "module": "m", "torch": "-",
        "python_abi": "-", "sources_sha256": "-", "abi_version": 1}))
    pack_signing.sign_pack(pack, private)
    assert set(json.loads((pack / "signature.json").read_text())["files"]) >= {
        "manifest.json", "calibration.json", "host/ext.so"}
    for name in ("host/ext.so", "calibration.json"):
        saved = (pack / name).read_bytes()
        (pack / name).write_bytes(saved + b" ")
        with pytest.raises(pack_signing.PackSignatureError, match=name.replace(".", r"\.")):
            pack_signing.verify_pack(pack, [public])
        (pack / name).write_bytes(saved)
    pack_signing.verify_pack(pack, [public])


@bad_input("build --out the tampered pack")
def test_build_sign_refuses_to_sign_an_up_to_date_pack_it_cannot_vouch_for(tmp_path, key, monkeypatch):
    from flashqla_tune import pack_build
    from flashqla_tune.pack_build import BuildReport

    private, public = key
    pack = make_pack(tmp_path / "pack")
    reused = BuildReport(pack, read_manifest(pack), True, "up to date (test double)", {})
    monkeypatch.setattr(pack_build, "build_pack", lambda *a, **kw: reused)
    argv = ["build", "--out", str(pack), "--no-tune", "--sign", str(private)]
    assert main(argv) == 2                      # unsigned: it cannot tell a tampered pack from ours
    assert not (pack / "signature.json").exists()
    pack_signing.sign_pack(pack, private)       # signed by this key before: re-signing it is fine
    assert main(argv) == 0
    pack_signing.verify_pack(pack, [public])
    assert main(["build", "--out", str(pack), "--no-tune", "--sign", str(tmp_path / "missing.key")]) == 2


# ---- reproducibility ---------------------------------------------------------------------------

def test_verify_reports_the_library_that_differs_from_its_rebuild(tmp_path, monkeypatch, capsys):
    pack = make_pack(tmp_path / "pack", tp_sizes=(1,))
    manifest = read_manifest(pack)
    odd = manifest.plans[-1]

    def rebuild_double(plans, work, jobs=None):
        """Stands in for nvcc: 'builds' the bytes make_pack wrote, except for one plan."""
        out = {}
        for plan in plans:
            path = Path(work) / f"{plan.name}.so"
            path.write_bytes(b"FakeBinary " + plan.name.encode() + (b" rebuilt" if plan == odd.plan else b""))
            out[plan.name] = path
        return out

    monkeypatch.setattr(verify_cli, "build_with_nvcc", rebuild_double)
    monkeypatch.setattr(verify_cli, "toolchain_differences", lambda recorded: [])
    assert main(["verify", str(pack)]) == 1
    text = capsys.readouterr().out
    assert f"{odd.so}: DIFFERS" in text and f"differ from their rebuild: {odd.so}" in text
    assert sum("identical" in line for line in text.splitlines()) == len({p.so for p in manifest.plans}) - 1
    (pack / odd.so).write_bytes(b"FakeBinary " + odd.plan.name.encode() + b" rebuilt")
    edit_manifest(pack, lambda d: [p.update(so_sha256=sha256_file(pack / p["so"])) for p in d["plans"]])
    assert main(["verify", str(pack)]) == 0
    assert "rebuild to identical bytes" in capsys.readouterr().out
    private, public = pack_signing.generate_key(tmp_path / "k")
    assert main(["verify", str(pack), "--key", str(public)]) == 2      # unsigned: refused before any build
    pack_signing.sign_pack(pack, private)
    assert main(["verify", str(pack), "--key", str(public)]) == 0
    assert "signature by key" in capsys.readouterr().out


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory):
    """One fixture plan built twice, in two folders, by the path `flashqla-tune verify` takes."""
    from flashqla_tune.render import Renderer, csrc_dir

    tmp = tmp_path_factory.mktemp("repro")
    templates, csrc = tmp / "templates", tmp / "csrc"
    shutil.copytree(FIXTURE_TEMPLATES, templates, ignore=shutil.ignore_patterns("csrc"))
    shutil.copytree(FIXTURE_TEMPLATES / "csrc", csrc)
    shutil.copy(csrc_dir() / "gdn_abi.h", csrc / "gdn_abi.h")
    builder = partial(verify_cli.build_with_nvcc, renderer=Renderer(templates), config=BuildConfig(csrc=csrc))
    plan = default_plan(GDNSpec(2, 8))
    return [builder([plan], tmp / f"build{i}")[plan.name] for i in (1, 2)]


@pytest.mark.slow
@needs_nvcc
def test_two_builds_of_one_plan_give_identical_bytes(two_builds):
    first, second = two_builds
    assert first.read_bytes() == second.read_bytes()
    loader.check_elf(first)


# ---- a kernel cache others can write to --------------------------------------------------------

def cache_doubles(monkeypatch, root: Path):
    """A cache double whose one entry is a real (non-kernel) shared library under root/kernels."""
    folder = root / "kernels" / "entry"
    folder.mkdir(parents=True)
    shutil.copyfile(a_shared_library(), folder / "k.so")
    plan = default_plan(GDNSpec(2, 8))
    entry = kernel_cache.CacheEntry(plan, "k", folder, {"so": "k.so"}, built=False)
    opened = []
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(root))
    monkeypatch.setattr(kernel_cache, "lookup", lambda *a: entry)
    monkeypatch.setattr(kernel_cache, "get_kernel", lambda *a, **kw: entry)
    monkeypatch.setattr(loader, "open_library", lambda so, plan: opened.append(so) or "library double")
    return plan, folder, opened


@pytest.mark.parametrize("where", ["root", "kernels", "entry", "so"])
def test_code_is_not_loaded_from_a_cache_folder_others_can_write_to(tmp_path, monkeypatch, where):
    root = tmp_path / "cache"
    plan, folder, opened = cache_doubles(monkeypatch, root)
    target = {"root": root, "kernels": root / "kernels", "entry": folder, "so": folder / "k.so"}[where]
    target.chmod(target.stat().st_mode | stat.S_IWGRP | stat.S_IWOTH)
    monkeypatch.setattr(loader, "_own_private_group", lambda gid, uid: False)
    with pytest.raises(loader.UnsafeLocationError, match="other users can write") as err:
        loader.load_kernel(plan)
    mode = f"{stat.S_IMODE(target.stat().st_mode):04o}"
    assert str(target) in str(err.value) and mode in str(err.value)
    assert opened == []


def test_group_write_is_refused_unless_the_group_is_the_owners_private_group(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    plan, folder, opened = cache_doubles(monkeypatch, root)
    folder.chmod(0o775)
    monkeypatch.setattr(loader, "_own_private_group", lambda gid, uid: False)
    with pytest.raises(loader.UnsafeLocationError, match="0775"):
        loader.load_kernel(plan)
    monkeypatch.setattr(loader, "_own_private_group", lambda gid, uid: True)   # a umask-002 system's own group
    assert loader.load_kernel(plan) == "library double"
    folder.chmod(0o777)
    with pytest.raises(loader.UnsafeLocationError, match="0777"):
        loader.load_kernel(plan)


def test_a_shared_tuning_journal_folder_does_not_block_loading(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    plan, folder, opened = cache_doubles(monkeypatch, root)
    (root / "tuning").mkdir()
    (root / "tuning").chmod(0o1777)
    assert loader.load_kernel(plan) == "library double" and opened == [folder / "k.so"]


def test_a_cache_folder_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    plan, folder, opened = cache_doubles(monkeypatch, root)
    real_stat = os.stat

    def stat_as_if_owned_by_another(path, *a, **kw):
        st = real_stat(path, *a, **kw)
        if isinstance(path, (str, os.PathLike)) and Path(path) == folder:
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid + 1, *st[5:]))
        return st

    monkeypatch.setattr(loader.os, "stat", stat_as_if_owned_by_another)
    with pytest.raises(loader.UnsafeLocationError, match="is owned by uid") as err:
        loader.load_kernel(plan)
    assert str(folder) in str(err.value) and opened == []


def test_the_host_extension_is_not_built_or_imported_from_a_folder_others_can_write_to(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    root = tmp_path / "cache"
    where = root / "host" / "key"
    where.mkdir(parents=True)
    (root / "host").chmod(0o777)
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(root))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("imported from a shared folder"))
    with pytest.raises(loader.UnsafeLocationError, match="0777"):
        host_path.compile_extension(where)


# ---- shell metacharacters in build paths -------------------------------------------------------

@bad_input("cache path containing $(touch ...)", "cache path with space/$/;/quotes: compile 2/8")
@pytest.mark.parametrize("name", ["c$(touch PWNED)", "c`touch PWNED`", "with space", "semi;colon", "q'uote"])
def test_a_build_path_with_shell_metacharacters_is_refused_before_nvcc(tmp_path, name, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / name / "kernels" / ".tmp" / "build"
    folder.mkdir(parents=True)
    source = folder / "p.cu"
    source.write_text("// never compiled\n")
    monkeypatch.setattr(build_mod, "_run_ninja_supervised",
                        lambda *a: pytest.fail("ninja ran with an unsafe path"))
    with pytest.raises(UnsafePathError, match="metacharacters") as err:
        build_mod.build([BuildJob("p", source, folder / "p.so")], folder)
    assert name in str(err.value)
    assert not list(tmp_path.rglob("PWNED"))


# ---- a killed build's compilers ----------------------------------------------------------------

SLOW_NVCC = """#!/bin/sh
# test double of nvcc: records its pid and a child's, then waits as a compile would
sleep 300 &
echo "$$ $!" >> "$FQT_SHIM_PIDS"
wait
"""

BUILDER = """
import sys
from pathlib import Path
from flashqla_tune import build
work = Path(sys.argv[1])
(work / "p.cu").write_text("// compiled by a test double\\n")
build.build([build.BuildJob("p", work / "p.cu", work / "p.so")], work / "build",
            build.BuildConfig(csrc=work))
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@bad_input("kill -9 while nvcc compiles (cold cache)")
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_compilers_end_with_a_build_killed_by_sigkill(tmp_path):
    try:
        environment.cutlass_include_dir()
    except environment.ToolchainError:
        pytest.skip("needs the nvidia-cutlass headers (the build's include path)")
    shim = tmp_path / "bin" / "nvcc"
    shim.parent.mkdir()
    shim.write_text(SLOW_NVCC)
    shim.chmod(0o755)
    pids = tmp_path / "pids"
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}", "FQT_SHIM_PIDS": str(pids),
           "FLASHQLA_TUNE_BUILD_JOBS": "1"}
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path)], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (pids.is_file() and pids.read_text().strip()):
            assert builder.poll() is None, "the build ended before the nvcc double started"
            assert time.monotonic() < deadline, "the nvcc double did not start within 60 s"
            time.sleep(0.05)
        compilers = [int(p) for p in pids.read_text().split()]
        assert all(_alive(p) for p in compilers)
        os.kill(builder.pid, signal.SIGKILL)
        builder.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in compilers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in compilers if _alive(p)], "compiler processes outlived the killed build"
    finally:
        if builder.poll() is None:
            builder.kill()
        for pid in (int(p) for p in (pids.read_text().split() if pids.is_file() else [])):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
