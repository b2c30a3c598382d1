"""What this machine offers the toolchain: GPU, nvcc, CUTLASS headers, cache location."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CACHE_ENV = "FLASHQLA_TUNE_CACHE"


class ToolchainError(RuntimeError):
    """nvcc or the CUTLASS headers cannot be found."""


class CacheLocationError(RuntimeError):
    """The cache location (FLASHQLA_TUNE_CACHE or the default) is not a folder."""


@dataclass(frozen=True)
class GPUInfo:
    name: str
    capability: tuple[int, int]
    sm_count: int
    driver: str | None

    @property
    def arch(self) -> str:
        major, minor = self.capability
        return f"sm_{major}{minor}"


def gpu_info(device: int | None = None) -> GPUInfo | None:
    """The current CUDA GPU, or None on a machine without one (or with a CPU build of torch)."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(device)
    return GPUInfo(name=props.name, capability=(props.major, props.minor),
                   sm_count=props.multi_processor_count, driver=_driver_version())


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


@lru_cache(maxsize=None)
def find_nvcc() -> Path:
    """nvcc from PATH (or CUDA_HOME), else from the nvidia-cuda-nvcc wheel."""
    candidates = []
    if shutil.which("nvcc"):
        candidates.append(Path(shutil.which("nvcc")))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    try:
        import nvidia.cuda_nvcc as wheel  # type: ignore[import-not-found]

        for base in wheel.__path__:
            candidates.append(Path(base) / "bin" / "nvcc")
    except ImportError:
        pass
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise ToolchainError("nvcc not found: put it on PATH, set CUDA_HOME, or pip install nvidia-cuda-nvcc")


@lru_cache(maxsize=None)
def nvcc_version_output() -> str:
    """`nvcc --version` in full; a compiler that does not answer is a ToolchainError naming it."""
    nvcc = find_nvcc()
    try:
        run = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolchainError(f"{nvcc} --version could not run: {exc}") from exc
    if run.returncode != 0 or "release" not in run.stdout:
        detail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ToolchainError(f"{nvcc} --version failed (exit status {run.returncode}: {detail[0]}); this is not a "
                             f"working nvcc (set CUDA_HOME or PATH to a CUDA toolkit)")
    return run.stdout


def nvcc_version() -> str:
    out = nvcc_version_output()
    match = re.search(r"release (\d+\.\d+), V([\d.]+)", out)
    return match.group(2) if match else out.strip().splitlines()[-1]


@lru_cache(maxsize=None)
def cutlass_include_dir() -> Path:
    """The CUTLASS/CuTe headers shipped inside the nvidia-cutlass wheel."""
    try:
        import cutlass_library  # the wheel's importable part; headers live beside it
    except ImportError as exc:
        raise ToolchainError("nvidia-cutlass is not installed (pip install nvidia-cutlass)") from exc
    include = Path(cutlass_library.__file__).parent / "source" / "include"
    if not (include / "cute" / "tensor.hpp").is_file():
        raise ToolchainError(f"nvidia-cutlass is installed but has no CuTe headers under {include}")
    return include


@lru_cache(maxsize=None)
def cutlass_version() -> str:
    text = (cutlass_include_dir() / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts if m)


def cache_dir() -> Path:
    """Where built kernels, tuning studies and calibrations live; FLASHQLA_TUNE_CACHE moves it.
    Raises CacheLocationError where the path (or the nearest part of it that exists) is not a folder."""
    if os.environ.get(CACHE_ENV):
        path = Path(os.environ[CACHE_ENV]).expanduser()
        named = f"{CACHE_ENV}={os.environ[CACHE_ENV]}"
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashqla_tune"
        named = f"the cache folder {path}"
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "it" if existing == path else str(existing)
        raise CacheLocationError(f"{named}: {where} is not a folder (a file is there); point {CACHE_ENV} at a "
                                 f"folder, or move the file")
    return path


def describe() -> dict:
    """A plain dict for `flashqla-tune info`; missing tools are reported, not raised."""
    import torch

    info: dict = {"torch": torch.__version__, "cache": str(cache_dir())}
    gpu = gpu_info()
    info["gpu"] = None if gpu is None else {"name": gpu.name, "arch": gpu.arch, "sm_count": gpu.sm_count,
                                            "driver": gpu.driver}
    try:
        info["nvcc"] = {"path": str(find_nvcc()), "version": nvcc_version()}
    except (ToolchainError, OSError, subprocess.CalledProcessError) as exc:
        info["nvcc"] = {"error": str(exc)}
    try:
        info["cutlass"] = {"include": str(cutlass_include_dir()), "version": cutlass_version()}
    except ToolchainError as exc:
        info["cutlass"] = {"error": str(exc)}
    return info
