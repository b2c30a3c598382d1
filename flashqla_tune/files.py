"""File helpers every stage shares (calibration, cache, packs): content hashes and atomic writes."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks so multi-GB weight shards stay out of memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write a file so readers see the old content or the new, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temp file sits in the same folder so os.replace is a rename on one filesystem.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def remove_path(path: Path) -> None:
    """Delete a file or folder; a symbolic link is unlinked, never followed."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    else:
        shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int | None) -> bool:
    """Whether a process of this id runs on this host (one of another user's counts as running)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["atomic_write_bytes", "atomic_write_text", "pid_alive", "remove_path", "sha256_file"]
