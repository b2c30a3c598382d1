"""Content-addressed cache of built kernel libraries.

An entry is a folder kernels/<plan name>-<key prefix>/ holding the .so, the .cu it was built
from, nvcc's ptxas report (raw and parsed) and manifest.json, written last. The key is a
sha256 over everything that changes the binary: the rendered source, every csrc/ header it
includes (transitively), the nvcc, host compiler and CUTLASS versions, the flags, the arch and
the ABI version. Entries are built in a staging folder on the same filesystem and published
with one rename, under a per-key file lock; an entry whose manifest or .so hash does not check
out is rebuilt, never trusted. Nothing here follows a symbolic link out of the cache: a link
planted as an entry or as kernels/.tmp is unlinked, never descended into. A cache that cannot
be written is a CacheError naming the folder (a hit needs no writing and still works).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from . import environment
from .build import BuildConfig, BuildError, BuildJob, build, host_compiler_version, nvcc_version_text
from .plan import KernelPlan
from .render import ABI_VERSION, Renderer
from .files import pid_alive, remove_path, sha256_file

MANIFEST = "manifest.json"
KEY_FORMAT = 1          # bump when the key's recipe or the entry layout changes
_PREFIX = 16            # key characters in an entry's folder name

_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.MULTILINE)
_MACRO_INCLUDE_RE = re.compile(r"^[ \t]*#[ \t]*include[ \t]+[A-Za-z_]", re.MULTILINE)


class CacheError(RuntimeError):
    """The cache folder cannot be used (e.g. an entry cannot be published)."""


def kernels_dir(root: Path | None = None) -> Path:
    """<cache>/kernels, the folder of built entries (FLASHQLA_TUNE_CACHE moves <cache>)."""
    return Path(root) if root is not None else environment.cache_dir() / "kernels"


def included_headers(source: str, csrc: Path) -> list[Path]:
    """Every file under csrc that `source` includes, directly or through other csrc headers.

    Quoted includes resolve against the including file's folder first, then csrc (nvcc's -I);
    angle includes against csrc. Includes inside #if branches count too: a superset only costs
    a spurious rebuild, a missing header would be a stale hit. A computed include
    (#include MACRO) cannot be followed, so every file in csrc counts then.
    """
    csrc = Path(csrc).resolve()
    found: set[Path] = set()
    pending: list[tuple[str, Path | None]] = [(source, None)]
    while pending:
        text, where = pending.pop()
        if _MACRO_INCLUDE_RE.search(text):
            return sorted(p.resolve() for p in csrc.rglob("*") if p.is_file())
        for kind, name in _INCLUDE_RE.findall(text):
            candidates = ([where.parent / name] if kind == '"' and where is not None else []) + [csrc / name]
            for candidate in candidates:
                if candidate.is_file():
                    resolved = candidate.resolve()
                    if resolved.is_relative_to(csrc) and resolved not in found:
                        found.add(resolved)
                        pending.append((resolved.read_text(errors="replace"), resolved))
                    break
    return sorted(found)


@dataclass(frozen=True)
class KeyedSource:
    """A plan's rendered source and the cache key computed over it and its toolchain.

    A plan is what one library is compiled for: a forward KernelPlan, or any frozen spec with a
    `name` and `to_dict()` (the backward's chain libraries), rendered by a renderer that has a
    `render(plan)` and, when its ABI is not the forward's, an `abi_version`."""
    plan: KernelPlan
    source: str
    headers: tuple[Path, ...]
    inputs: dict          # what the key hashes, readable (kept in the manifest)
    key: str

    @property
    def entry_name(self) -> str:
        return f"{self.plan.name}-{self.key[:_PREFIX]}"


def keyed_source(plan: KernelPlan, renderer: Renderer | None = None, config: BuildConfig | None = None) -> KeyedSource:
    """Render a plan and compute its cache key (no build)."""
    renderer, config = renderer or Renderer(), config or BuildConfig()
    source = renderer.render(plan)
    csrc = config.csrc_dir
    headers = included_headers(source, csrc)
    inputs = {
        "key_format": KEY_FORMAT,
        "abi_version": getattr(renderer, "abi_version", ABI_VERSION),
        "arch": config.arch,
        "flags": config.flags(),
        "nvcc": nvcc_version_text(),
        "host_compiler": host_compiler_version(),
        "cutlass": environment.cutlass_version(),
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "headers": {str(h.relative_to(csrc)): sha256_file(h) for h in headers},
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return KeyedSource(plan, source, tuple(headers), inputs, key)


@dataclass(frozen=True)
class CacheEntry:
    """A valid, published entry."""
    plan: KernelPlan
    key: str
    path: Path
    manifest: dict
    built: bool              # built by this call (False: an existing entry was reused)

    @property
    def so_path(self) -> Path:
        return self.path / self.manifest["so"]

    @property
    def source_path(self) -> Path:
        return self.path / self.manifest["source"]

    @property
    def resources(self) -> dict:
        return self.manifest.get("resources", {})

    @property
    def build_seconds(self) -> float | None:
        return self.manifest.get("build_seconds")


def read_manifest(entry_dir: Path) -> dict | None:
    try:
        data = json.loads((Path(entry_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_entry(entry_dir: Path, key: str | None = None) -> tuple[dict | None, str]:
    """(manifest, "") when the entry is intact (and has `key`), else (None, why not)."""
    if Path(entry_dir).is_symlink():
        return None, "a symbolic link (not followed)"
    manifest = read_manifest(entry_dir)
    if manifest is None:
        return None, "manifest.json missing or not valid JSON"
    if manifest.get("key_format") != KEY_FORMAT:
        return None, f"key format {manifest.get('key_format')!r}, expected {KEY_FORMAT}"
    if key is not None and manifest.get("key") != key:
        return None, "manifest key differs from the folder's key"
    so_name = manifest.get("so")
    if not isinstance(so_name, str) or "/" in so_name:
        return None, "manifest names no library"
    so = Path(entry_dir) / so_name
    if not so.is_file():
        return None, f"{so_name} missing"
    if sha256_file(so) != manifest.get("so_sha256"):
        return None, f"{so_name} does not match its recorded sha256"
    from .loader import MalformedLibraryError, check_elf

    try:  # a library cut short but re-hashed would kill the process inside dlopen
        check_elf(so)
    except MalformedLibraryError as exc:
        return None, str(exc)
    return manifest, ""


def lookup(plan: KernelPlan, renderer: Renderer | None = None, config: BuildConfig | None = None,
           root: Path | None = None) -> CacheEntry | None:
    """The valid entry for a plan, or None (never builds)."""
    root = kernels_dir(root)           # an unusable cache location is refused before rendering
    keyed = keyed_source(plan, renderer, config)
    path = root / keyed.entry_name
    manifest, _ = check_entry(path, keyed.key)
    return CacheEntry(plan, keyed.key, path, manifest, built=False) if manifest else None


@contextmanager
def _writing(root: Path, what: str):
    """Turn the OSError of a cache that cannot be written into a CacheError naming the folder."""
    try:
        yield
    except OSError as exc:
        raise CacheError(f"kernel cache {root} cannot be written ({what}: {exc.strerror or exc}"
                         f"{f': {exc.filename}' if exc.filename else ''}); make it writable or set "
                         f"{environment.CACHE_ENV} to a folder you can write") from exc


def _lock(root: Path, key: str) -> FileLock:
    with _writing(root, "lock folder"):
        locks = _own_dir(root / ".locks")
    return FileLock(str(locks / f"{key}.lock"))


@contextmanager
def _locked(root: Path, key: str):
    lock = _lock(root, key)
    with _writing(root, "lock"):
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _own_dir(path: Path) -> Path:
    """A folder of the cache's own, made if missing; a symbolic link in its place is unlinked first."""
    if path.is_symlink():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _discard(path: Path, root: Path) -> None:
    # Rename away first (atomic for readers), then delete at leisure.
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink():
        path.unlink()
        return
    trash = _own_dir(root / ".tmp") / f"trash-{uuid.uuid4().hex}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _publish(keyed: KeyedSource, staged: Path, root: Path, result, seconds_total: float) -> CacheEntry:
    so = result.job.output
    so_sha = sha256_file(so)
    # The .so name carries its hash, so a rebuilt (different) library never shares a path
    # with one an earlier dlopen in this process still holds.
    so_name = f"{keyed.plan.name}.{so_sha[:12]}.so"
    os.replace(so, staged / so_name)
    manifest = {
        "key_format": KEY_FORMAT,
        "key": keyed.key,
        "plan_name": keyed.plan.name,
        "plan": keyed.plan.to_dict(),
        "so": so_name,
        "so_sha256": so_sha,
        "source": f"{keyed.plan.name}.cu",
        "ptxas_log": result.job.log.name,
        "resources": result.resources,
        "build_seconds": result.seconds if result.seconds is not None else seconds_total,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "inputs": keyed.inputs,
    }
    (staged / f"{keyed.plan.name}.resources.json").write_text(json.dumps(result.resources, indent=2, sort_keys=True))
    (staged / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    final = root / keyed.entry_name
    _discard(final, root)   # a corrupt entry of this key (we hold its lock)
    os.replace(staged, final)
    return CacheEntry(keyed.plan, keyed.key, final, manifest, built=True)


def _check_headers(keyed: KeyedSource, recorded: list, csrc: Path) -> None:
    # nvcc's own dependency list must not name a csrc header the scanner missed: that header
    # would be outside the key and an edit to it would hit a stale entry.
    seen = {Path(p).resolve() for p in recorded}
    missed = sorted(p for p in seen if p.is_relative_to(csrc) and p not in set(keyed.headers))
    if missed:
        raise CacheError(f"plan {keyed.plan.name}: nvcc read csrc headers the cache key does not cover: "
                         f"{[str(p) for p in missed]} (include scanner bug; not published)")


def get_kernels(plans: list[KernelPlan], renderer: Renderer | None = None, config: BuildConfig | None = None,
                root: Path | None = None, jobs: int | None = None, force: bool = False) -> list[CacheEntry]:
    """The cache entry of every plan, building the missing ones in one parallel ninja run.

    Concurrent callers for one key serialise on its lock; the later one reuses the entry.
    force=True rebuilds even valid entries. On compile errors, entries of the plans that did
    build are published and a BuildError names the failing ones.
    """
    renderer, config = renderer or Renderer(), config or BuildConfig()
    root = kernels_dir(root)
    with _writing(root, "kernels folder"):
        root.mkdir(parents=True, exist_ok=True)
    keyed = [keyed_source(p, renderer, config) for p in plans]
    entries: dict[str, CacheEntry] = {}

    def valid(k: KeyedSource) -> CacheEntry | None:
        manifest, _ = check_entry(root / k.entry_name, k.key)
        return CacheEntry(k.plan, k.key, root / k.entry_name, manifest, built=False) if manifest else None

    if not force:
        for k in keyed:
            if (hit := valid(k)) is not None:
                entries[k.key] = hit
    missing = {k.key: k for k in keyed if k.key not in entries}
    if missing:
        # Sorted lock order: two callers wanting overlapping sets cannot deadlock.
        locks = [_lock(root, key) for key in sorted(missing)]
        held = []
        try:
            for lock in locks:
                with _writing(root, "lock"):
                    lock.acquire()
                held.append(lock)
            todo = []
            for key, k in sorted(missing.items()):
                hit = None if force else valid(k)   # another process may have built it meanwhile
                if hit is not None:
                    entries[key] = hit
                else:
                    todo.append(k)
            if todo:
                entries.update(_build_and_publish(todo, config, root, jobs))
        finally:
            for lock in reversed(held):
                lock.release()
    return [entries[k.key] for k in keyed]


# A build folder whose pid is not running here is left alone until it is this old: on a cache
# shared between hosts or containers, the pid may be another pid namespace's live build.
STALE_BUILD_S = 3600.0


def _is_dead_build(folder: Path) -> bool:
    pid = _build_pid(folder.name)
    if pid is None or pid_alive(pid):
        return False
    try:
        return time.time() - folder.lstat().st_mtime > STALE_BUILD_S
    except OSError:
        return False


def _build_and_publish(todo: list[KeyedSource], config: BuildConfig, root: Path, jobs: int | None) -> dict:
    with _writing(root, "build folder"):
        tmp = _own_dir(root / ".tmp")
        for child in tmp.iterdir():      # what builds that died left (a live build's folder stays)
            if _is_dead_build(child):
                remove_path(child)
        staging = tmp / f"build-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    build_jobs, staged = [], {}
    for k in todo:
        folder = staging / k.entry_name
        folder.mkdir(parents=True)
        (folder / f"{k.plan.name}.cu").write_text(k.source)
        staged[k.plan.name] = (k, folder)
        build_jobs.append(BuildJob(k.plan.name, folder / f"{k.plan.name}.cu", folder / f"{k.plan.name}.so"))
    published: dict[str, CacheEntry] = {}
    start = time.perf_counter()
    try:
        try:
            results, error = build(build_jobs, staging, config, jobs), None
        except BuildError as exc:
            results, error = exc.results, exc
        elapsed = time.perf_counter() - start
        for result in results:
            k, folder = staged[result.job.name]
            _check_headers(k, result.headers, config.csrc_dir)
            published[k.key] = _publish(k, folder, root, result, elapsed)
        if error is not None:
            raise error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return published


def get_kernel(plan: KernelPlan, renderer: Renderer | None = None, config: BuildConfig | None = None,
               root: Path | None = None, force: bool = False) -> CacheEntry:
    """The cache entry of one plan, built if missing."""
    return get_kernels([plan], renderer, config, root, force=force)[0]


def invalidate(entry: CacheEntry) -> None:
    """Drop an entry found to be stale (e.g. its library embeds another plan)."""
    root = entry.path.parent
    with _locked(root, entry.key), _writing(root, "drop entry"):
        _discard(entry.path, root)


@dataclass(frozen=True)
class EntryInfo:
    """One folder under kernels/, valid or not (for `cache ls`)."""
    path: Path
    manifest: dict | None
    problem: str
    size_bytes: int

    @property
    def valid(self) -> bool:
        return self.manifest is not None


def list_entries(root: Path | None = None) -> list[EntryInfo]:
    root = kernels_dir(root)
    if not root.is_dir():
        return []
    out = []
    for path in sorted(p for p in root.iterdir() if (p.is_dir() or p.is_symlink()) and not p.name.startswith(".")):
        if path.is_symlink():
            out.append(EntryInfo(path, None, "a symbolic link (not followed); removed by cache clear", 0))
            continue
        key_prefix = path.name.rsplit("-", 1)[-1]
        manifest, problem = check_entry(path)
        if manifest is not None and not str(manifest.get("key", "")).startswith(key_prefix):
            manifest, problem = None, "folder name does not match the manifest key"
        size = sum(os.lstat(os.path.join(folder, f)).st_size
                   for folder, _, files in os.walk(path) for f in files)   # os.walk follows no links
        out.append(EntryInfo(path, manifest, problem, size))
    return out


def clear(root: Path | None = None, match: str | None = None) -> int:
    """Remove entries (those whose folder name contains `match`, or all); returns how many.

    Without `match`, leftovers of dead builds go too. Lock files stay: deleting one another
    process holds would let a third take a fresh lock on the same key. Each entry is removed
    under its key's lock, so a builder publishing that key is not cut short.
    """
    root = kernels_dir(root)
    if not root.is_dir():
        return 0
    removed = 0
    for info in list_entries(root):
        if match is not None and match not in info.path.name:
            continue
        key = info.manifest["key"] if info.manifest else None
        if key:
            with _locked(root, key), _writing(root, "remove entry"):
                _discard(info.path, root)
        else:
            with _writing(root, "remove entry"):
                _discard(info.path, root)
        removed += 1
    if match is None:
        tmp = root / ".tmp"
        if tmp.is_symlink():
            with _writing(root, "remove .tmp link"):
                tmp.unlink()        # planted: the link goes, its target is not ours
        elif tmp.is_dir():
            for child in tmp.iterdir():
                # Staging folders of builds still running belong to live processes; keep those.
                pid = _build_pid(child.name)
                if pid is not None and pid_alive(pid):
                    continue
                with _writing(root, "remove leftovers"):
                    remove_path(child)
    return removed


def _build_pid(name: str) -> int | None:
    """The process id in a build staging folder's name (build-<pid>-<hex>), else None."""
    parts = name.split("-")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "build" and parts[1].isdigit() else None



__all__ = ["CacheEntry", "CacheError", "EntryInfo", "KeyedSource", "check_entry", "clear", "get_kernel",
           "get_kernels", "included_headers", "invalidate", "keyed_source", "kernels_dir", "list_entries",
           "lookup", "read_manifest", "sha256_file"]
