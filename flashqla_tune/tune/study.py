"""Where a study lives and how it is opened: one per (spec, GPU name, kernel sources).

Journal storage on a file (not SQLite): appends under a file lock, so several tuner
processes, one per GPU or on several machines sharing a filesystem, can work on one study.
The name carries a hash of the templates, csrc headers and the search space, so timings of
older kernels are never mixed with new ones.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

from .. import environment
from ..render import csrc_dir, templates_dir
from ..spec import GDNSpec
from .search_space import SPACE

STUDY_FORMAT = 1


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-") or "unknown"


def sources_hash() -> str:
    """sha256 over the kernel sources (templates, csrc) and the search space."""
    digest = hashlib.sha256(json.dumps({"format": STUDY_FORMAT, "space": SPACE}, sort_keys=True).encode())
    for folder in (templates_dir(), csrc_dir()):
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.suffix != ".pyc"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def study_name(spec: GDNSpec, gpu_name: str) -> str:
    return f"{spec.name}@{_slug(gpu_name)}@{sources_hash()[:12]}"


def study_path(spec: GDNSpec, gpu_name: str, root: Path | None = None) -> Path:
    """<cache>/tuning/<study name>.journal (root replaces <cache>/tuning)."""
    base = Path(root) if root is not None else environment.cache_dir() / "tuning"
    return base / f"{study_name(spec, gpu_name)}.journal"


def open_study(spec: GDNSpec, gpu_name: str, root: Path | None = None, seed: int | None = None) -> optuna.Study:
    """Create or resume the study. seed fixes the sampler (reproducible only when run alone)."""
    path = study_path(spec, gpu_name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The open-lock works on filesystems without symlinks (and on NFS).
    storage = JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))
    # constant_liar keeps concurrent workers off each other's running points.
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=10, constant_liar=True)
    study = optuna.create_study(study_name=study_name(spec, gpu_name), storage=storage, direction="minimize",
                                sampler=sampler, load_if_exists=True)
    if "spec" not in study.user_attrs:
        study.set_user_attr("spec", spec.to_dict())
        study.set_user_attr("gpu_name", gpu_name)
    return study
