"""Text that is already on every machine with Python: no downloads.

Training reads the standard library's own .py sources; calibration ships Python's reference
documentation topics (pydoc_data), which training never sees, so the corpus is held out.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "pydoc_data", "site-packages", "dist-packages", "__pycache__",
             "turtledemo", "tkinter", "ensurepip"}


def python_docs_text() -> str:
    """The language-reference topics pydoc ships (about 0.45 MB of prose and grammar)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics)) + "\n"


def python_source_texts(limit_bytes: int | None = None) -> list[tuple[str, str]]:
    """(relative path, text) for the stdlib's .py files, sorted, up to limit_bytes in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append((str(rel), text))
        total += len(text)
        if limit_bytes is not None and total >= limit_bytes:
            break
    return out
