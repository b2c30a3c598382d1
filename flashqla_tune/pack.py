"""Kernel packs: a folder with manifest.json, the kernel binaries and the calibration artifact.

    PACK/manifest.json       what is inside and what it was built for (read first, written last)
    PACK/calibration.json    the calibration artifact (and its report beside it)
    PACK/binaries/<plan>.so  one library per plan
    PACK/host/<module>.so    the eager op's C++ host path, prebuilt for one torch and Python ABI

A pack is tuned for one GPU (name and arch recorded) or untuned ("untuned sm_90a": default
tiles, built without a GPU, runs on any sm_90). This module reads, checks and writes the
folder; pack_build makes one, packed_ops runs one.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .cp_cost_model import CostModelError, check_segment_table
from .files import sha256_file
from .plan import KernelPlan, PlanError
from .spec import GDNSpec, SpecError

SCHEMA = "flashqla-tune.pack"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
CALIBRATION = "calibration.json"
BINARIES = "binaries"
HOST = "host"
UNTUNED_TARGET = "untuned sm_90a"
NATIVE, QK_REPEATED = "native", "qk_repeated"   # a plan's head form: the model's, or q/k repeated to Hv


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
    def from_dict(cls, d: dict) -> "PackPlan":
        if d.get("form") not in (NATIVE, QK_REPEATED):
            raise PackError(f"plan entry has form {d.get('form')!r}, expected {NATIVE!r} or {QK_REPEATED!r}")
        so = _inside_pack(d["so"], "plan entry")
        segments = d.get("segment_chunks")
        if segments is not None:
            try:
                segments = check_segment_table(segments)
            except CostModelError as exc:
                raise PackError(f"plan entry {d.get('name')!r}: segment_chunks: {exc}") from None
        return cls(int(d["tp_size"]), d["form"], KernelPlan.from_dict(d["plan"]), so, str(d["so_sha256"]),
                   d.get("tuning"), segments)


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
    def from_dict(cls, d: dict) -> "HostExtension":
        return cls(_inside_pack(d["so"], "host extension entry"), str(d["sha256"]), str(d["module"]),
                   str(d["torch"]), str(d["python_abi"]), str(d["sources_sha256"]), int(d["abi_version"]))


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
    tool_version: str = __version__
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    schema_version: int = SCHEMA_VERSION

    @property
    def tuned(self) -> bool:
        return self.gpu.get("target") != UNTUNED_TARGET

    @property
    def target(self) -> str:
        return f"{self.gpu['name']} ({self.gpu['arch']})" if self.tuned else UNTUNED_TARGET

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "schema_version": self.schema_version, "tool_version": self.tool_version,
                "created": self.created, "spec": self.spec.to_dict(),
                "checkpoint": {"sha256": self.checkpoint_sha256, "path": self.checkpoint_path,
                               "num_gdn_layers": self.num_gdn_layers},
                "calibration": {"file": CALIBRATION, "sha256": self.calibration_sha256},
                "tp_sizes": list(self.tp_sizes), "tuned": self.tuned, "gpu": self.gpu,
                "toolchain": self.toolchain, "build": self.build, "plans": [p.to_dict() for p in self.plans],
                "host_extension": None if self.host_extension is None else self.host_extension.to_dict()}

    @classmethod
    def from_dict(cls, data, source: str) -> "Manifest":
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise PackError(f"{source} is not a flashqla-tune pack manifest")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise PackError(f"{source} has pack schema version {data.get('schema_version')!r}; this "
                            f"flashqla-tune {__version__} reads version {SCHEMA_VERSION}: rebuild the pack")
        try:
            gpu = dict(data["gpu"])
            if gpu.get("target") != UNTUNED_TARGET and not (gpu.get("name") and gpu.get("arch")):
                raise PackError(f"{source}: a tuned pack must record its GPU name and arch, got {gpu!r}")
            return cls(spec=GDNSpec.from_dict(data["spec"]), checkpoint_sha256=data["checkpoint"]["sha256"],
                       checkpoint_path=data["checkpoint"]["path"],
                       num_gdn_layers=int(data["checkpoint"]["num_gdn_layers"]),
                       calibration_sha256=data["calibration"]["sha256"],
                       tp_sizes=tuple(int(t) for t in data["tp_sizes"]), gpu=gpu,
                       toolchain=dict(data["toolchain"]), plans=tuple(PackPlan.from_dict(p) for p in data["plans"]),
                       build=dict(data.get("build") or {}),
                       host_extension=(None if data.get("host_extension") is None
                                       else HostExtension.from_dict(data["host_extension"])),
                       tool_version=data["tool_version"], created=data["created"],
                       schema_version=data["schema_version"])
        except PackError:
            raise
        except (KeyError, TypeError, ValueError, PlanError, SpecError) as exc:
            raise PackError(f"{source} is a damaged pack manifest: {type(exc).__name__}: {exc}") from exc


def read_manifest(pack: str | Path) -> Manifest:
    pack = Path(pack)
    if not pack.is_dir():
        raise PackError(f"no pack folder at {pack}")
    path = pack / MANIFEST
    if not path.is_file():
        raise PackError(f"{pack} has no {MANIFEST}: not a pack, or a build that did not finish")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackError(f"{path} is damaged (not JSON: {exc})") from exc
    return Manifest.from_dict(data, str(path))


def check_binaries(pack: str | Path, manifest: Manifest, plans=None) -> None:
    """Every listed kernel binary (or those of `plans`) and the host extension exist and match their
    recorded sha256."""
    listed = [(p.so, p.so_sha256, f"plan {p.plan.name}") for p in (plans if plans is not None else manifest.plans)]
    if manifest.host_extension is not None:
        listed.append((manifest.host_extension.so, manifest.host_extension.sha256, "the C++ host path"))
    for so, sha, of in listed:
        path = Path(pack) / so
        if not path.is_file():
            raise PackError(f"pack {pack} lacks binary {so} of {of}: copy the whole folder")
        if sha256_file(path) != sha:
            raise PackError(f"pack {pack}: binary {so} does not match its recorded sha256 (damaged or replaced)")


def check_calibration(pack: str | Path, manifest: Manifest) -> Path:
    path = Path(pack) / CALIBRATION
    if not path.is_file():
        raise PackError(f"pack {pack} has no {CALIBRATION}")
    if sha256_file(path) != manifest.calibration_sha256:
        raise PackError(f"pack {pack}: {CALIBRATION} does not match the manifest's calibration sha256")
    return path


def publish(staging: Path, out: Path) -> None:
    """Replace `out` by the finished `staging` folder (same filesystem): readers see the old pack
    or the new one, never a mix; the old one is deleted after the swap."""
    out = Path(out)
    trash = None
    if out.exists():
        trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, trash)
    try:
        os.replace(staging, out)
    except OSError:
        if trash is not None:
            os.replace(trash, out)   # put the old pack back
        raise
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def staging_dir(out: Path) -> Path:
    out = Path(out)
    path = out.parent / f".{out.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    path = Path(folder) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)
    return path
