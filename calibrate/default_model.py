"""Where the embedded default checkpoint lives (trained by tools/train_default_model.py)."""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def default_model_path() -> Path:
    return Path(str(resources.files("flashqla_tune.calibrate") / "data" / "default_model"))
