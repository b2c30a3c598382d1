"""Where the package's data folders are: the Jinja templates and the csrc/ sources.

A leaf: the compiler side (render, build, cache) and the runtime's C++ host path both read
csrc/, and neither should import the other to find it.
"""
from __future__ import annotations

import importlib.resources
from pathlib import Path


class PackageDataError(FileNotFoundError):
    """A data folder of the installed package cannot be found."""


def _package_dir(package: str, source_name: str) -> Path:
    # A regular install has the data as a package; an editable install of a data folder with
    # no __init__.py may not resolve, so fall back to the source tree beside flashqla_tune/.
    try:
        path = Path(str(importlib.resources.files(package)))
        if path.is_dir():
            return path
    except ModuleNotFoundError:
        pass
    path = Path(__file__).resolve().parent.parent / source_name
    if path.is_dir():
        return path
    raise PackageDataError(f"cannot find the {package} package data (looked for {path})")


def templates_dir() -> Path:
    """The folder of the shipped Jinja templates (package data flashqla_tune.templates)."""
    return _package_dir("flashqla_tune.templates", "templates")


def csrc_dir() -> Path:
    """The folder of the shipped csrc/ headers (package data flashqla_tune.csrc)."""
    return _package_dir("flashqla_tune.csrc", "csrc")


__all__ = ["PackageDataError", "csrc_dir", "templates_dir"]
