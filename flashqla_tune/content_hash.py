"""Content hashes for the artifact's keys: the checkpoint (config and every weight file, since
the gate at layer l depends on all layers below it) and the corpus.

Hashing a large checkpoint takes a while, so each file's digest is remembered in the cache by
(absolute path, size, mtime_ns); a file whose size or mtime changed is hashed again. A file
rewritten in place with its size and mtime restored keeps its remembered digest: HashCache(rehash=True)
hashes every file's content again (`build --rehash`, and every tuned build). A cache that cannot
be written (a read-only FLASHQLA_TUNE_CACHE) costs only the remembering: one warning, then every
file is hashed each time.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

from filelock import FileLock

from .calibration_settings import CalibrationError
from .environment import cache_dir
from .files import atomic_write_text, sha256_file

WEIGHT_SUFFIXES = (".safetensors",)


def _cache_file() -> Path:
    return cache_dir() / "calibrate" / "file_hashes.json"


def checkpoint_files(checkpoint: str | Path) -> list[Path]:
    """config.json plus every weight file, sorted by name so the hash does not depend on listing order."""
    root = Path(checkpoint)
    config = root / "config.json"
    if not config.is_file():
        raise CalibrationError(f"no config.json in checkpoint folder {root}")
    weights = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise CalibrationError(f"no *.safetensors weight files in checkpoint folder {root}")
    return [config, *weights]


class HashCache:
    """file -> sha256, valid while the file's size and mtime_ns are unchanged."""

    def __init__(self, path: Path | None = None, rehash: bool = False):
        self.path = path or _cache_file()
        self.rehash = rehash      # hash every file's content, whatever is remembered (and remember anew)
        self.hits = 0
        self.misses = 0
        self._unwritable = False

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, json.JSONDecodeError):
            return {}  # a missing or corrupt cache only costs a rehash

    def digest(self, file: Path) -> str:
        file = file.resolve()
        st = file.stat()
        entry = None if self.rehash else self._read().get(str(file))
        if (isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns
                and isinstance(entry.get("sha256"), str)):
            self.hits += 1
            return entry["sha256"]
        self.misses += 1
        sha = sha256_file(file)
        if not self._unwritable:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with FileLock(str(self.path) + ".lock"):
                    data = self._read()
                    data[str(file)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
                    atomic_write_text(self.path, json.dumps(data, indent=1, sort_keys=True))
            except OSError as exc:
                self._unwritable = True
                warnings.warn(f"cannot write the checkpoint-hash cache {self.path} ({exc.strerror or exc}); "
                              f"going on without it: checkpoint files are hashed in full each time",
                              RuntimeWarning, stacklevel=2)
        return sha


def checkpoint_hash(checkpoint: str | Path, cache: HashCache | None = None) -> str:
    cache = cache or HashCache()
    digest = hashlib.sha256()
    for f in checkpoint_files(checkpoint):
        digest.update(f"{f.name}\0{cache.digest(f)}\n".encode())
    return digest.hexdigest()


def corpus_hash(texts: list[tuple[str, str]]) -> str:
    """sha256 over (name, text) pairs in the order the pass reads them."""
    digest = hashlib.sha256()
    for name, text in texts:
        data = text.encode("utf-8")
        digest.update(f"{os.path.basename(name)}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()
