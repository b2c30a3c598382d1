"""Kernel packs: a folder with manifest.json, the kernel binaries and the calibration artifact.

    PACK/manifest.json       what is inside and what it was built for (read first, written last)
    PACK/calibration.json    the calibration artifact (and its report beside it)
    PACK/binaries/<plan>.so  one library per plan, and the backward's kernel libraries
    PACK/host/<module>.so    the eager op's C++ host path, prebuilt for one torch and Python ABI

A pack is tuned for one GPU (name and arch recorded) or untuned ("untuned sm_90a": default
tiles, built without a GPU, runs on any sm_90). This module reads, checks and writes the
folder; pack_build makes one, packed_ops runs one.

Every manifest field is checked against the schema when read, and the error names the file and
the field. A manifest of schema version 1 (before the host architecture was recorded) still reads,
with the architecture unknown: it is not checked against this machine, and `build` rebuilds such a
pack. A pack built on another architecture (platform.machine(), e.g. x86_64 against aarch64) is
refused before anything in it is opened. The backward's kernel libraries are listed under
"backward_libraries", one record per kind (BACKWARD_KINDS); a manifest that has the single "backward"
record instead (the chain library alone) reads as one record of kind "chain".

Publishing is crash-safe: where the kernel offers an atomic exchange of two paths
(renameat2 RENAME_EXCHANGE on Linux) the finished staging folder and the old pack swap in one
step, so the path always names a whole pack; elsewhere the old pack is renamed aside first, and a
reader that finds the path missing puts the aside copy back (recover) when the process that moved
it is gone. Staging and aside folders carry their process id, so a later build deletes only those
of dead processes (pids are per host: two hosts building into one shared folder at once are not
told apart).
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import platform
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .cp_cost_model import CostModelError, check_segment_table
from .files import pid_alive, remove_path, sha256_file
from .plan import KernelPlan, PlanError
from .spec import GDNSpec, SpecError

SCHEMA = "flashqla-tune.pack"
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)   # 1: no host architecture recorded
INT32_MAX = 2**31 - 1               # the kernels' ABI passes counts as int32
MANIFEST = "manifest.json"
CALIBRATION = "calibration.json"
BINARIES = "binaries"
HOST = "host"
UNTUNED_TARGET = "untuned sm_90a"
NATIVE, QK_REPEATED = "native", "qk_repeated"   # a plan's head form: the model's, or q/k repeated to Hv
BACKWARD_KINDS = ("chain", "prep", "chunk")   # backward.libraries.MODULE_NAMES: a backward library's kind
# (readers refuse a kind they do not know: adding one is a new SCHEMA_VERSION)


class PackError(RuntimeError):
    """A pack folder is missing, damaged, or does not fit this machine or call."""


@dataclass(frozen=True)
class PackPlan:
    tp_size: int
    form: str                   # NATIVE or QK_REPEATED
    plan: KernelPlan
    so: str                     # path relative to the pack
    so_sha256: str
    tuning: dict | None = None  # study, best trial, times_ms, default_times_ms, speedup; None if untuned
    # CP segment length (chunks) per length bucket (segment_policy.SEGMENT_BUCKETS entries) that the plan
    # applies with the pack's calibration; None (older packs): the cost model decides per call
    segment_chunks: tuple[int, ...] | None = None

    @property
    def heads(self) -> tuple[int, int]:
        return self.plan.spec.num_qk_heads, self.plan.spec.num_v_heads

    def to_dict(self) -> dict:
        return {"tp_size": self.tp_size, "form": self.form, "heads": list(self.heads), "name": self.plan.name,
                "plan": self.plan.to_dict(), "so": self.so, "so_sha256": self.so_sha256, "tuning": self.tuning,
                "segment_chunks": None if self.segment_chunks is None else list(self.segment_chunks)}

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan entry") -> "PackPlan":
        if not isinstance(d, dict):
            raise PackError(f"{where} is {type(d).__name__}, expected an object")
        if d.get("form") not in (NATIVE, QK_REPEATED):
            raise PackError(f"plan entry has form {d.get('form')!r}, expected {NATIVE!r} or {QK_REPEATED!r}")
        so = _inside_pack(d["so"], "plan entry")
        tp_size = _count(d["tp_size"], f"{where}: tp_size")
        segments = d.get("segment_chunks")
        if segments is not None:
            if not isinstance(segments, list):
                raise PackError(f"{where} ({d.get('name')!r}): segment_chunks is {type(segments).__name__}, "
                                f"expected a list")
            try:
                segments = check_segment_table(segments)
            except CostModelError as exc:
                raise PackError(f"{where} ({d.get('name')!r}): segment_chunks: {exc}") from None
            for i, value in enumerate(segments):
                _count(value, f"{where}: segment_chunks[{i}]", minimum=0)
        return cls(tp_size, d["form"], KernelPlan.from_dict(d["plan"]), so,
                   _text(d["so_sha256"], f"{where}: so_sha256"),
                   d.get("tuning"), segments)


def _count(value, what: str, minimum: int = 1, maximum: int = INT32_MAX) -> int:
    """An integer field in minimum..maximum; JSON booleans, floats (1e30) and strings ("12") are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PackError(f"{what} is {value!r} ({type(value).__name__}), expected an integer")
    if not minimum <= value <= maximum:
        raise PackError(f"{what} is {value}, expected {minimum}..{maximum}")
    return value


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise PackError(f"{what} is {value!r} ({type(value).__name__}), expected a string")
    return value


def _inside_pack(rel, what: str) -> str:
    if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise PackError(f"{what} names binary {rel!r}: must be a path inside the pack")
    return rel


@dataclass(frozen=True)
class HostExtension:
    """The prebuilt C++ host extension (host_path.build_into) and what it was built for: the
    pack's eager calls use it only under the same torch, Python ABI, csrc/ sources and kernel ABI."""
    so: str                     # path relative to the pack
    sha256: str
    module: str                 # its module name (the PyInit_ symbol it exports)
    torch: str                  # torch.__version__ it was compiled against
    python_abi: str             # the interpreter's SOABI tag
    sources_sha256: str         # host_path.sources_sha256() of the sources it was compiled from
    abi_version: int            # the kernel libraries' C ABI version it calls

    def to_dict(self) -> dict:
        return {"so": self.so, "sha256": self.sha256, "module": self.module, "torch": self.torch,
                "python_abi": self.python_abi, "sources_sha256": self.sources_sha256,
                "abi_version": self.abi_version}

    @classmethod
    def from_dict(cls, d: dict, where: str = "host extension entry") -> "HostExtension":
        if not isinstance(d, dict):
            raise PackError(f"{where} is {type(d).__name__}, expected an object")
        texts = [_text(d[name], f"{where}: {name}") for name in ("sha256", "module", "torch", "python_abi",
                                                                 "sources_sha256")]
        return cls(_inside_pack(d["so"], "host extension entry"), *texts,
                   _count(d["abi_version"], f"{where}: abi_version"))


@dataclass(frozen=True)
class BackwardLibrary:
    """One of the backward's kernel libraries (flashqla_tune.backward.libraries: kind "chain", "prep"
    or "chunk") prebuilt for the pack's head dims, so a pack's op trains without compiling anything;
    used only where its spec and ABI are the ones this flashqla_tune's backward asks for."""
    kind: str                   # one of BACKWARD_KINDS
    so: str                     # path relative to the pack
    sha256: str
    spec: dict                  # the kind's spec (e.g. chain_kernels.ChainSpec).to_dict()
    abi_version: int            # the kind's module's ABI_VERSION it was built with

    def to_dict(self) -> dict:
        return {"kind": self.kind, "so": self.so, "sha256": self.sha256, "spec": dict(self.spec),
                "abi_version": self.abi_version}

    @classmethod
    def from_dict(cls, d: dict, where: str = "backward entry", kind: str | None = None) -> "BackwardLibrary":
        """A record as the manifest lists it; `kind` given: a record that does not name its kind
        (the single "backward" entry, which is the chain library's)."""
        if not isinstance(d, dict) or not isinstance(d.get("spec"), dict):
            raise PackError(f"{where} is {d!r}, expected an object with "
                            f"{'' if kind is not None else 'kind, '}so, sha256, spec and abi_version")
        if kind is None:
            kind = d.get("kind")
            if kind not in BACKWARD_KINDS:
                raise PackError(f"{where}: kind is {kind!r}, expected one of {', '.join(BACKWARD_KINDS)}")
        return cls(kind, _inside_pack(d["so"], where), _text(d["sha256"], f"{where}: sha256"), dict(d["spec"]),
                   _count(d["abi_version"], f"{where}: abi_version"))


def _backward_libraries(data: dict, source: str) -> tuple[BackwardLibrary, ...]:
    """The manifest's backward libraries: its "backward_libraries" list (one record per kind), or its
    single "backward" record read as the chain library's, or none."""
    listed, single = data.get("backward_libraries"), data.get("backward")
    if listed is not None and single is not None:
        raise PackError(f"{source} has both backward_libraries and a single backward entry; expected one of them")
    if listed is None:
        return () if single is None else (BackwardLibrary.from_dict(single, f"{source}: backward", kind="chain"),)
    if not isinstance(listed, list):
        raise PackError(f"{source}: backward_libraries is {type(listed).__name__}, expected a list")
    records, seen = [], set()
    for i, d in enumerate(listed):
        record = BackwardLibrary.from_dict(d, f"{source}: backward_libraries[{i}]")
        if record.kind in seen:
            raise PackError(f"{source}: backward_libraries[{i}]: kind {record.kind!r} is listed twice")
        seen.add(record.kind)
        records.append(record)
    return tuple(records)


@dataclass(frozen=True)
class Manifest:
    spec: GDNSpec                    # the model's spec (all heads)
    checkpoint_sha256: str
    checkpoint_path: str
    calibration_sha256: str
    num_gdn_layers: int
    tp_sizes: tuple[int, ...]
    gpu: dict                        # tuned: name, arch, driver, sm_count; untuned: {"target": UNTUNED_TARGET}
    toolchain: dict                  # nvcc, cutlass, torch
    plans: tuple[PackPlan, ...]
    build: dict = field(default_factory=dict)   # the options that made it (calibration corpus, sizes)
    host_extension: HostExtension | None = None  # None: built where the extension could not be compiled
    backward: tuple[BackwardLibrary, ...] = ()   # at most one per kind; empty: the pack carries none
    tool_version: str = __version__
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    schema_version: int = SCHEMA_VERSION
    machine: str | None = field(default_factory=platform.machine)  # host architecture; None: schema 1

    @property
    def tuned(self) -> bool:
        return self.gpu.get("target") != UNTUNED_TARGET

    @property
    def target(self) -> str:
        return f"{self.gpu['name']} ({self.gpu['arch']})" if self.tuned else UNTUNED_TARGET

    def backward_library(self, kind: str) -> BackwardLibrary | None:
        """The pack's backward library of `kind` (one of BACKWARD_KINDS), or None when it carries none."""
        return next((b for b in self.backward if b.kind == kind), None)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "schema_version": self.schema_version, "tool_version": self.tool_version,
                "created": self.created, "spec": self.spec.to_dict(),
                "checkpoint": {"sha256": self.checkpoint_sha256, "path": self.checkpoint_path,
                               "num_gdn_layers": self.num_gdn_layers},
                "calibration": {"file": CALIBRATION, "sha256": self.calibration_sha256},
                "tp_sizes": list(self.tp_sizes), "tuned": self.tuned, "gpu": self.gpu,
                "toolchain": self.toolchain, "build": self.build, "plans": [p.to_dict() for p in self.plans],
                "host_extension": None if self.host_extension is None else self.host_extension.to_dict(),
                "backward_libraries": [b.to_dict() for b in self.backward],
                "host": {"machine": self.machine}}

    @classmethod
    def from_dict(cls, data, source: str) -> "Manifest":
        if not is_pack_manifest(data):
            raise PackError(f"{source} is not a flashqla-tune pack manifest")
        version = data.get("schema_version")
        readable = f"{READABLE_SCHEMA_VERSIONS[0]}..{READABLE_SCHEMA_VERSIONS[-1]}"
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            raise PackError(f"{source} has pack schema version {version}, newer than this flashqla-tune "
                            f"{__version__} reads ({readable}): upgrade flashqla-tune, or rebuild the pack with "
                            f"this one")
        if version not in READABLE_SCHEMA_VERSIONS or isinstance(version, bool):
            raise PackError(f"{source} has pack schema version {version!r}; this flashqla-tune {__version__} "
                            f"reads versions {readable}: rebuild the pack")
        try:
            gpu = dict(data["gpu"])
            if gpu.get("target") != UNTUNED_TARGET and not (gpu.get("name") and gpu.get("arch")):
                raise PackError(f"{source}: a tuned pack must record its GPU name and arch, got {gpu!r}")
            checkpoint = data["checkpoint"]
            if not isinstance(data["tp_sizes"], list) or not data["tp_sizes"]:
                raise PackError(f"{source}: tp_sizes is {data['tp_sizes']!r}, expected a non-empty list of "
                                f"tensor-parallel degrees")
            tp_sizes = tuple(_count(t, f"{source}: tp_sizes[{i}]") for i, t in enumerate(data["tp_sizes"]))
            if not isinstance(data["plans"], list):
                raise PackError(f"{source}: plans is {type(data['plans']).__name__}, expected a list")
            plans = tuple(PackPlan.from_dict(p, f"{source}: plans[{i}]") for i, p in enumerate(data["plans"]))
            for i, p in enumerate(plans):
                if p.tp_size not in tp_sizes:
                    raise PackError(f"{source}: plans[{i}]: tp_size {p.tp_size} is not one of tp_sizes "
                                    f"{list(tp_sizes)}")
            machine = None
            if version >= 2:
                host = data["host"]
                machine = _text(host.get("machine") if isinstance(host, dict) else host, f"{source}: host.machine")
            return cls(spec=GDNSpec.from_dict(data["spec"]),
                       checkpoint_sha256=_text(checkpoint["sha256"], f"{source}: checkpoint.sha256"),
                       checkpoint_path=_text(checkpoint["path"], f"{source}: checkpoint.path"),
                       num_gdn_layers=_count(checkpoint["num_gdn_layers"], f"{source}: checkpoint.num_gdn_layers"),
                       calibration_sha256=_text(data["calibration"]["sha256"], f"{source}: calibration.sha256"),
                       tp_sizes=tp_sizes, gpu=gpu, toolchain=dict(data["toolchain"]), plans=plans,
                       build=dict(data.get("build") or {}),
                       host_extension=(None if data.get("host_extension") is None
                                       else HostExtension.from_dict(data["host_extension"],
                                                                    f"{source}: host_extension")),
                       backward=_backward_libraries(data, source),
                       tool_version=data["tool_version"], created=data["created"],
                       schema_version=version, machine=machine)
        except PackError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, PlanError, SpecError) as exc:
            raise PackError(f"{source} is a damaged pack manifest: {type(exc).__name__}: {exc}") from exc


def is_pack_manifest(data) -> bool:
    """Whether parsed JSON claims to be this tool's pack manifest (whatever its version or damage)."""
    return isinstance(data, dict) and data.get("schema") == SCHEMA


def check_machine(manifest: Manifest, source) -> None:
    """Refuse a pack built on another host architecture (its host extension and any code it runs on
    the CPU are that architecture's)."""
    here = platform.machine()
    if manifest.machine is not None and manifest.machine != here:
        raise PackError(f"{source} was built on a {manifest.machine} host; this machine is {here}: "
                        f"rebuild the pack here (flashqla-tune build)")


def read_manifest(pack: str | Path, *, this_host: bool = True) -> Manifest:
    """The pack's manifest, checked against the schema and (this_host) against this machine's
    architecture. A pack path left missing by a publish that died half-way is restored first."""
    pack = Path(pack)
    if not pack.exists() and not pack.is_symlink():
        recover(pack)
    if not pack.is_dir():
        raise PackError(f"no pack folder at {pack}" + (" (a file is there)" if pack.exists() else ""))
    path = pack / MANIFEST
    if not path.is_file():
        raise PackError(f"{pack} has no {MANIFEST}: not a pack, or a build that did not finish")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PackError(f"{path} cannot be read: {exc}") from exc
    return parse_manifest(raw, path, this_host=this_host)


def parse_manifest(raw: bytes, path: Path, *, this_host: bool = True) -> Manifest:
    """A manifest from the bytes read at `path` (the bytes a signature check hashed, when one did)."""
    try:
        data = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackError(f"{path} is damaged (not JSON: {exc})") from exc
    manifest = Manifest.from_dict(data, str(path))
    if this_host:
        check_machine(manifest, path)
    return manifest


def check_replaceable(out: Path) -> None:
    """Refuse to build into `out` unless it is missing, an empty folder, or a folder whose
    manifest.json claims to be this tool's pack (intact or not): nothing else is ever replaced."""
    out = Path(out)
    if not out.exists():
        if out.is_symlink():
            raise PackError(f"--out {out} is a dangling symbolic link; refusing to replace it")
        return
    if not out.is_dir():
        raise PackError(f"--out {out} is a file, not a pack folder; refusing to replace it")
    manifest = out / MANIFEST
    if not manifest.exists():
        if any(out.iterdir()):
            raise PackError(f"{out} exists and is not a pack (no {MANIFEST}); refusing to replace it")
        return
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PackError(f"{out} holds a {MANIFEST} that is not JSON ({type(exc).__name__}), so it is not a "
                        f"flashqla-tune pack; refusing to replace the folder: choose another --out") from None
    if not is_pack_manifest(data):
        raise PackError(f"{out} holds a {MANIFEST} that is not a flashqla-tune pack's (another tool's folder); "
                        f"refusing to replace it: choose another --out")


def check_binaries(pack: str | Path, manifest: Manifest, plans=None) -> None:
    """Every listed kernel binary (or those of `plans`) and the host extension exist and match their
    recorded sha256."""
    listed = [(p.so, p.so_sha256, f"plan {p.plan.name}") for p in (plans if plans is not None else manifest.plans)]
    if manifest.host_extension is not None:
        listed.append((manifest.host_extension.so, manifest.host_extension.sha256, "the C++ host path"))
    listed.extend((b.so, b.sha256, f"the backward's {b.kind} kernels") for b in manifest.backward)
    for so, sha, of in listed:
        path = Path(pack) / so
        if not path.is_file():
            raise PackError(f"pack {pack} lacks binary {so} of {of}: copy the whole folder")
        if sha256_file(path) != sha:
            raise PackError(f"pack {pack}: binary {so} does not match its recorded sha256 (damaged, or changed since it was built; the hash sits in the pack itself, so it cannot show who built it)")


def check_calibration(pack: str | Path, manifest: Manifest) -> Path:
    path = Path(pack) / CALIBRATION
    if not path.is_file():
        raise PackError(f"pack {pack} has no {CALIBRATION}")
    if sha256_file(path) != manifest.calibration_sha256:
        raise PackError(f"pack {pack}: {CALIBRATION} does not match the manifest's calibration sha256")
    return path


def publish(staging: Path, out: Path) -> None:
    """Replace `out` by the finished `staging` folder (same filesystem): readers see the old pack
    or the new one, never a mix and never neither; the old one is deleted after the swap."""
    out, staging = Path(out), Path(staging)
    if not out.exists() and not out.is_symlink():
        os.replace(staging, out)
        return
    if _exchange(staging, out):
        remove_path(staging)   # the old pack, now under the staging name
        return
    aside = out.parent / f".{out.name}{_ASIDE}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(out, aside)
    try:
        os.replace(staging, out)
    except OSError:
        os.replace(aside, out)   # put the old pack back
        raise
    remove_path(aside)


_STAGING, _ASIDE = ".staging-", ".old-"
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _leftovers(out: Path) -> list[tuple[Path, str, int | None]]:
    """(path, kind, pid) of the staging and aside folders of `out` itself: names exactly as
    staging_dir and publish make them (.NAME.staging-PID-HEX8, .NAME.old-PID-HEX8; schema-1 tools
    named them without the pid, pid None, and no such publisher runs), so another pack's folders,
    whose names may share the prefix, are never taken for this one's."""
    out = Path(out)
    found = []
    try:
        names = os.listdir(out.parent)
    except OSError:
        return []
    for name in names:
        for kind in (_STAGING, _ASIDE):
            match = re.fullmatch(re.escape(f".{out.name}{kind}") + r"(?:(\d+)-)?[0-9a-f]{8}", name)
            if match:
                found.append((out.parent / name, kind, int(match.group(1)) if match.group(1) else None))
    return found


def recover(out: Path, *, clean: bool = False, wait_s: float = 2.0) -> list[str]:
    """Restore `out` where a publish died between its two renames (the old pack is put back from its
    aside folder), and with clean=True delete the staging and aside folders of dead processes.
    A live publisher between its renames is waited for up to wait_s. Returns what was done."""
    out = Path(out)
    done = []
    deadline = time.monotonic() + wait_s
    while not out.exists() and not out.is_symlink():
        aside = [(p, pid) for p, kind, pid in _leftovers(out) if kind == _ASIDE and p.is_dir() and not p.is_symlink()]
        dead = sorted((p for p, pid in aside if not pid_alive(pid)), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        if dead:
            try:
                os.rename(dead[0], out)
                done.append(f"restored {out} from {dead[0].name}, left by a build that died while publishing")
            except OSError:
                pass   # another reader restored it first, or the folder is not ours to write
            continue
        if not aside or time.monotonic() > deadline:
            break
        time.sleep(0.05)   # its publisher is alive and about to rename the new pack in
    if clean:
        for path, kind, pid in _leftovers(out):
            if not pid_alive(pid) and (out.exists() or kind == _STAGING):
                remove_path(path)
                done.append(f"removed {path.name}, left by a build that died (pid {pid})")
    return done


def staging_dir(out: Path) -> Path:
    out = Path(out)
    path = out.parent / f".{out.name}{_STAGING}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    path = Path(folder) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)
    return path
