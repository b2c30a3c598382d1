"""Open a built kernel library through ctypes and check it (no PyTorch C++ extension, nothing built
at import).

A library is trusted only after it says it speaks this ABI version and embeds the plan we asked
for. Opening a pack's libraries needs nothing else, so this module imports only abi and plan:
`load_kernel`, which builds through the cache first (the pack-less op's first use of a plan),
imports the compiler side when it is called; a cache entry whose library disagrees is dropped
and rebuilt once.
"""
from __future__ import annotations

import ctypes
import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from . import abi
from .plan import KernelPlan

if TYPE_CHECKING:
    from .build import BuildConfig
    from .render import Renderer

logger = logging.getLogger("flashqla_tune")
_loaded: dict[Path, "KernelLibrary"] = {}
_loaded_lock = threading.Lock()


class StaleKernelError(RuntimeError):
    """A library's ABI version or embedded plan does not match what the caller expects."""


class KernelLaunchError(RuntimeError):
    """fqt_gdn_fwd returned a CUDA error code."""


class KernelLibrary:
    """One built .so: its plan, checked at open, and typed entry points."""

    def __init__(self, so_path: Path, plan: KernelPlan):
        self.path = Path(so_path)
        self.plan = plan
        try:
            self._lib = abi.declare(ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL))
        except OSError as exc:
            raise StaleKernelError(f"cannot load kernel library {self.path}: {exc}") from exc
        except AttributeError as exc:
            raise StaleKernelError(f"kernel library {self.path} lacks an ABI symbol: {exc}") from exc
        version = self._lib.fqt_abi_version()
        if version != abi.ABI_VERSION:
            raise StaleKernelError(f"kernel library {self.path} speaks ABI {version}, this flashqla_tune speaks "
                                   f"{abi.ABI_VERSION}; it is stale")
        raw = self._lib.fqt_plan_json()
        try:
            embedded = json.loads(raw.decode()) if raw else None
        except ValueError:
            embedded = None
        if embedded != plan.to_dict():
            raise StaleKernelError(f"kernel library {self.path} was built for plan {embedded!r}, not for "
                                   f"{plan.name} ({plan.to_dict()!r}); it is stale")

    def workspace_bytes(self, total_tokens: int, num_seqs: int, max_segments: int = 0) -> int:
        """Scratch bytes of a call; max_segments > 0 adds context parallelism's."""
        if total_tokens < 0 or num_seqs < 0 or max_segments < 0:
            raise ValueError(f"workspace_bytes needs non-negative sizes, got total_tokens={total_tokens}, "
                             f"num_seqs={num_seqs}, max_segments={max_segments}")
        return int(self._lib.fqt_gdn_fwd_workspace_bytes(total_tokens, num_seqs, max_segments))

    def launch(self, args: abi.FqtGdnFwdArgs, stream: int) -> None:
        """Enqueue the forward on `stream` (a cudaStream_t as an int); never synchronises."""
        code = self._lib.fqt_gdn_fwd(ctypes.byref(args), ctypes.c_void_p(stream or None))
        if code != 0:
            self.raise_launch_error(code)

    def raise_launch_error(self, code: int) -> None:
        raise KernelLaunchError(f"{self.plan.name}: fqt_gdn_fwd failed with CUDA error {code}: "
                                f"{self.error_string(code)}")

    def entry_address(self, symbol: str) -> int:
        """The address of one of the ABI's functions (abi.SYMBOLS), for callers outside ctypes (the
        C++ host path); valid while this library stays loaded (libraries are never unloaded)."""
        if symbol not in abi.SYMBOLS:
            raise ValueError(f"{symbol} is not one of the ABI's functions {abi.SYMBOLS}")
        return ctypes.cast(getattr(self._lib, symbol), ctypes.c_void_p).value

    def error_string(self, code: int) -> str:
        text = self._lib.fqt_error_string(code)
        return text.decode(errors="replace") if text else f"unknown error {code}"

    def __repr__(self) -> str:
        return f"KernelLibrary({self.plan.name}, {self.path})"


def open_library(so_path: Path, plan: KernelPlan) -> KernelLibrary:
    """Open (once per process and path) and check a library for `plan`."""
    path = Path(so_path).resolve()
    with _loaded_lock:
        lib = _loaded.get(path)
        if lib is None:
            lib = _loaded[path] = KernelLibrary(path, plan)
        elif lib.plan != plan:
            raise StaleKernelError(f"{path} is loaded for plan {lib.plan.name}, not {plan.name}")
        return lib


def load_kernel(plan: KernelPlan, renderer: Renderer | None = None, config: BuildConfig | None = None,
                root: Path | None = None) -> KernelLibrary:
    """The checked library of a plan, built through the cache if needed.

    A stale entry (wrong ABI version or embedded plan) is dropped and rebuilt once; if the fresh
    build is stale too, the template itself embeds the wrong plan and the error says so.
    """
    from . import cache  # the compiler side (render, build, nvcc): only where a plan is built

    entry = cache.lookup(plan, renderer, config, root)
    if entry is None:  # a compile stalls this first call: say so once, where a user's logging sees it
        logger.warning("compiling kernel plan %s with nvcc on its first use (cached afterwards; "
                       "a kernel pack compiles nothing)", plan.name)
        entry = cache.get_kernel(plan, renderer, config, root)
    try:
        return open_library(entry.so_path, plan)
    except StaleKernelError as first:
        cache.invalidate(entry)
        entry = cache.get_kernel(plan, renderer, config, root)
        try:
            return open_library(entry.so_path, plan)
        except StaleKernelError as second:
            raise StaleKernelError(f"{second} (even after a rebuild: the template does not embed the plan it "
                                   f"was rendered for; first error: {first})") from second


__all__ = ["KernelLaunchError", "KernelLibrary", "StaleKernelError", "load_kernel", "open_library"]
