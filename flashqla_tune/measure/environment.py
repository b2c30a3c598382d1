"""What a scoreboard ran on: date, GPU, driver, library versions."""
from __future__ import annotations

import datetime
import importlib.metadata as md
import platform
import subprocess

import torch

_DISTS = {"torch": "torch", "triton": "triton", "fla": "fla-core", "flash_qla": "flash-qla",
          "tilelang": "tilelang", "flashqla_tune": "flashqla-tune"}


def versions() -> dict[str, str | None]:
    out = {}
    for key, dist in _DISTS.items():
        try:
            out[key] = md.version(dist)
        except md.PackageNotFoundError:
            out[key] = None  # on PYTHONPATH without metadata, or absent
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["python"] = platform.python_version()
    return out


def driver_version() -> str | None:
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def describe(device=None) -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "versions": versions(), "gpu": None, "driver": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
        info["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                       "sm_count": props.multi_processor_count,
                       "l2_bytes": getattr(props, "L2_cache_size", None),
                       "memory_bytes": props.total_memory}
        info["driver"] = driver_version()
    return info
