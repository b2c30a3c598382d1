"""The eager op's host path in C++ (csrc/gdn_torch_host.cpp) and the call contexts it launches from.

An eager call of ops.chunk_gated_delta_rule spent ~40 us of host time in a few dozen small Python
steps (checks, plan and table lookups, three allocations, the launch struct). Here one call into
a torch extension does the checks, allocations and launch. The Python op asks `forward` first;
a call it does not take as is returns None and the checked Python path runs, which owns every
error message and conversion. After a call succeeds on the Python path, `remember` keeps a
context for its signature (heads, dtype, device, state layout, warm-up table), so the next call
of that signature goes through C++. Both paths launch the same library with the same arguments.

The extension is built once per torch and Python version into the cache (about 30 s with torch's
headers), in a background thread that the first remembered call starts: until it is loaded, calls
stay on the Python path. `extension()` waits for it (benchmarks and tests call it first). Where it
cannot be built (no C++ compiler, no Python headers) the op warns once and stays on the Python
path.
FLASHQLA_TUNE_HOST_PATH=python keeps every call on the Python path.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path

import torch

from . import environment
from .render import csrc_dir
from .warmup import CP_SCRATCH_LIMIT_BYTES, MAX_SEGMENTS, segment_state_bytes

SOURCE_NAME = "gdn_torch_host.cpp"
ENV_SWITCH = "FLASHQLA_TUNE_HOST_PATH"
TORCH_BATON = "lock"  # torch.utils.cpp_extension's build baton in the build folder

_contexts: dict[tuple, object] = {}
taken = 0  # calls the C++ path has launched in this process (tests and scripts/host_overhead.py read it)
_lock = threading.Lock()
_extension = None          # the loaded module, once built
_unavailable: str | None = None  # why it cannot be built or loaded (then the Python path only)
_build_thread: threading.Thread | None = None


class HostPathError(RuntimeError):
    """The C++ host path could not be built or loaded."""


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "cpp").lower() != "python"


def build_key() -> str:
    """What the extension's binary depends on: its sources, torch, Python and the platform."""
    digest = hashlib.sha256()
    for name in (SOURCE_NAME, "gdn_abi.h"):
        digest.update((csrc_dir() / name).read_bytes())
    digest.update(f"{torch.__version__}|{sys.version}|{sys.platform}".encode())
    return digest.hexdigest()[:16]


def extension():
    """The built extension module: waits for the build (started here if nothing started it) and
    raises HostPathError where it cannot be built or loaded."""
    start_build()
    _build_thread.join()
    if _extension is None:
        raise HostPathError(_unavailable)
    return _extension


def start_build() -> None:
    """Build (or load from the cache) the extension in a background thread, once per process: the
    call that first needs it, such as a pack's first call, does not wait about 30 s of compiling;
    its signature's calls stay on the Python path until the module is there."""
    global _build_thread
    with _lock:
        if _build_thread is None:
            _build_thread = threading.Thread(target=_build_in_background, name="flashqla-tune host path build",
                                             daemon=True)
            _build_thread.start()


def _after_fork_in_child() -> None:
    # a forked child has no build thread: let it start its own where the parent's was unfinished
    global _build_thread
    if _extension is None and _build_thread is not None and not _build_thread.is_alive():
        _build_thread = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _build_in_background() -> None:
    global _extension, _unavailable
    try:
        _extension = _build_and_load()
    except Exception as exc:  # a missing compiler or header: the op keeps the Python path
        _unavailable = f"the C++ host path could not be built ({type(exc).__name__}: {exc})"


def _build_and_load():
    from filelock import FileLock
    from torch.utils import cpp_extension

    key = build_key()
    where = environment.cache_dir() / "host" / key
    where.mkdir(parents=True, exist_ok=True)
    with FileLock(str(where / ".build.lock")):  # one builder per key across processes
        clear_stale_baton(where)
        module = cpp_extension.load(name=f"flashqla_tune_host_{key}", sources=[str(csrc_dir() / SOURCE_NAME)],
                                    extra_include_paths=[str(csrc_dir())], extra_cflags=["-O2"],
                                    build_directory=str(where), with_cuda=False, verbose=False)
    if module.ABI_VERSION != _abi_version():
        raise HostPathError(f"the host extension speaks ABI {module.ABI_VERSION}, not {_abi_version()}")
    return module


def clear_stale_baton(where: Path) -> None:
    """Remove torch's build baton (the file `lock` in the build folder) left by a process that
    died while building, e.g. one that exited while this module's background build was still
    compiling. torch waits for that file to disappear and would wait forever. Called with our own
    lock held, which every builder of the folder takes first, so no live build owns the file."""
    baton = where / TORCH_BATON
    if baton.exists():
        warnings.warn(f"flashqla_tune: removing a stale build lock {baton} (a build was interrupted)", stacklevel=2)
        baton.unlink(missing_ok=True)


def _abi_version() -> int:
    from .abi import ABI_VERSION
    return ABI_VERSION


def signature(q, v, state_v_first, warmup, warmup_eps, plan_name: str) -> tuple | None:
    """The key of a call's context, or None for calls the C++ path never takes (a warm-up table it
    would have to read from the GPU or check element by element)."""
    if warmup is None:
        table = None
    elif type(warmup) in (list, tuple):
        table = tuple(warmup)
    elif isinstance(warmup, torch.Tensor) and warmup.device.type == "cpu":
        table = tuple(warmup.tolist())
    else:
        return None
    return (q.shape[2], v.shape[2], q.dtype, q.get_device(), bool(state_v_first), table, float(warmup_eps), plan_name)


def known(key) -> bool:
    return key in _contexts


def forward(key, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens,
            cu_seqlens_cpu):
    """(o, final_state or None) through the C++ path, or None where the Python path must run (key
    None included: a call the C++ path never takes)."""
    context = _contexts.get(key) if key is not None else None
    if context is None or (cu_seqlens_cpu is not None and not isinstance(cu_seqlens_cpu, torch.Tensor)):
        return None
    stream = torch._C._cuda_getCurrentRawStream(key[3])
    try:
        result = _extension.forward(context.handle, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state,
                                    None if scale is None else float(scale), bool(output_final_state),
                                    bool(use_qk_l2norm), stream)
    except TypeError:  # an argument pybind cannot convert (not a tensor): the Python path says what
        return None
    if result is None:
        return None
    global taken
    taken += 1
    o, final, code = result
    if code != 0:
        context.library.raise_launch_error(code)
    return o, final


class _Context:
    """A signature's C++ context, with the objects its raw pointers point into kept alive."""

    def __init__(self, handle, library, tables):
        self.handle = handle
        self.library = library
        self.tables = tables


def remember(key, plan, library, tables, device: torch.device) -> None:
    """Keep the context of a call that just succeeded on the Python path (plan, its loaded library,
    its warmup.WarmupTables). Until the extension is built (in the background, started here) it
    keeps nothing; it does nothing when the C++ path is switched off or cannot be built (warning
    once)."""
    if key is None or tables is None or key in _contexts or not enabled():
        return  # tables None: a default table first seen under graph capture ran without CP
    ext = _extension
    if ext is None:  # not built yet: start it (once) and let a later call of the signature come back
        start_build()
        if _unavailable is not None:
            _warn_once(_unavailable)
        return
    spec, bound = plan.spec, tables.bound
    handle = ext.make_context(
        library.entry_address("fqt_gdn_fwd"), library.entry_address("fqt_gdn_fwd_workspace_bytes"), device,
        torch.bfloat16 if spec.qkv_dtype == "bfloat16" else torch.float16,
        spec.num_qk_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim, spec.state_layout == "vk",
        tables.warmup.data_ptr(), tables.segment_chunks.data_ptr(), tables.log_eps, list(bound.lengths),
        list(bound.top_extra), list(bound.top_shortest), MAX_SEGMENTS, CP_SCRATCH_LIMIT_BYTES,
        segment_state_bytes(spec.num_v_heads, spec.head_k_dim, spec.head_v_dim), tables.exact_heads)
    with _lock:
        _contexts.setdefault(key, _Context(handle, library, tables))


_warned = False


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"{message}; eager calls stay on the Python host path", RuntimeWarning, stacklevel=3)


def forget() -> None:
    """Drop every context (tests). A context keeps alive what its pointers point into, so dropping
    one frees nothing that a running call still uses."""
    with _lock:
        _contexts.clear()


__all__ = ["ENV_SWITCH", "HostPathError", "build_key", "enabled", "extension", "forget", "forward", "known",
           "remember", "signature", "start_build"]
