"""The eager op's host path in C++ (csrc/gdn_torch_host.cpp) and the signature contexts it launches from.

An eager call on the Python path takes a few dozen small Python steps (checks, plan and table
lookups, three allocations, the launch struct); here one call into a torch extension does the
checks, allocations and launch. The Python op asks `forward` first; a call it does not take as is
returns None and the checked Python path runs, which owns every error message and conversion.
After a call succeeds on the Python path, `remember` keeps a signature context (heads, dtype,
device, state layout, warm-up table), so the next call of that signature goes through C++. Both
paths launch the same library with the same arguments, so they give the same results.

Where the extension comes from:
- a kernel pack carries it prebuilt (`flashqla-tune build` compiles it into PACK/host/, see
  `build_into`); `use_pack_extension`, called when the pack is loaded, imports it when it was built
  for this torch, this Python ABI and these sources, and otherwise warns once, naming the mismatch:
  that pack's calls then stay on the Python path. A pack's calls never compile anything.
- the pack-less op builds it once per torch and Python version into the cache, with torch's
  headers and a C++ compiler, in a background thread that the first remembered call starts: until
  it is loaded, calls stay on the Python path. `extension()` waits for it (benchmarks and tests call
  it first). Where it cannot be built the op warns once and stays on the Python path. Nothing is
  built or imported from a cache folder that another user can write to (loader.check_private).
FLASHQLA_TUNE_HOST_PATH=python keeps every call on the Python path.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import environment
from .abi import ABI_VERSION
from .loader import check_elf, check_private
from .package_data import csrc_dir
from .warmup_tables import CP_SCRATCH_LIMIT_BYTES, MAX_SEGMENTS, segment_state_bytes

SOURCE_NAME = "gdn_torch_host.cpp"
ENV_SWITCH = "FLASHQLA_TUNE_HOST_PATH"
TORCH_BATON = "lock"  # torch.utils.cpp_extension's build baton in the build folder
MODULE_PREFIX = "flashqla_tune_host_"

_contexts: dict[tuple, "_SignatureContext"] = {}
taken = 0  # calls the C++ path has launched in this process (tests and benchmarks read it)
_lock = threading.Lock()
_extension = None          # the loaded module, once built or imported from a pack
_unavailable: str | None = None  # why it cannot be built or loaded (then the Python path only)
_build_thread: threading.Thread | None = None


class HostPathError(RuntimeError):
    """The C++ host path could not be built or loaded."""


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "cpp").lower() != "python"


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def source_files() -> list[Path]:
    """The extension's source and every csrc/ header it includes with quotes, directly or not."""
    root = csrc_dir()
    found, todo = [], [root / SOURCE_NAME]
    while todo:
        path = todo.pop()
        if path in found:
            continue
        found.append(path)
        for name in _INCLUDE.findall(path.read_text()):
            if (root / name).is_file():
                todo.append(root / name)
    return sorted(found)


def sources_sha256() -> str:
    """What the extension is compiled from, by name and content."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def python_abi() -> str:
    """The running interpreter's extension-module ABI tag, e.g. cpython-312-x86_64-linux-gnu."""
    return sysconfig.get_config_var("SOABI") or f"{sys.implementation.cache_tag}-{sys.platform}"


def build_key() -> str:
    """What the extension's binary depends on: its sources, torch, Python and the platform."""
    digest = hashlib.sha256()
    digest.update(sources_sha256().encode())
    digest.update(f"{torch.__version__}|{sys.version}|{sys.platform}".encode())
    return digest.hexdigest()[:16]


def module_name() -> str:
    """The extension's module name (its PyInit_ symbol), one per build key."""
    return MODULE_PREFIX + build_key()


def extension():
    """The loaded extension module: a pack's, or the cache's (waits for the build, started here if
    nothing started it); raises HostPathError where it cannot be built or loaded."""
    if _extension is None:
        start_build()
        _build_thread.join()
    if _extension is None:
        raise HostPathError(_unavailable)
    return _extension


def start_build() -> None:
    """Build (or load from the cache) the extension in a background thread, once per process: the
    call that first needs it does not wait for the compiler; its signature's calls stay on the
    Python path until the module is there."""
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
        module = _build_and_load()
    except Exception as exc:  # a missing compiler or header: the op keeps the Python path
        _unavailable = f"the C++ host path could not be built ({type(exc).__name__}: {exc})"
        return
    with _lock:
        if _extension is None:  # a pack's prebuilt one, imported meanwhile, is the same sources
            _extension = module


def _build_and_load():
    """The extension built in (or loaded from) the cache's folder for this build key."""
    return compile_extension(environment.cache_dir() / "host" / build_key())


def compile_extension(where: Path):
    """Compile the extension into the folder `where` (or load it from there when torch finds it up
    to date) and import it; one builder per folder across processes."""
    from filelock import FileLock
    from torch.utils import cpp_extension

    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    check_private_folder(where)
    with FileLock(str(where / ".build.lock")):
        clear_stale_baton(where)
        for built in where.glob("*.so"):  # what torch would import if it finds the build up to date
            check_private(built, where)
        module = cpp_extension.load(name=module_name(), sources=[str(csrc_dir() / SOURCE_NAME)],
                                    extra_include_paths=[str(csrc_dir())], extra_cflags=["-O2"],
                                    build_directory=str(where), with_cuda=False, verbose=False)
    _check_abi(module, where)
    return module


def check_private_folder(where: Path) -> None:
    """Refuse (loader.UnsafeLocationError) a build folder that another user can write to, checking
    every folder from it up to the cache's root when it lies inside the cache."""
    where = Path(where).absolute()
    root = environment.cache_dir().absolute()
    check_private(where, root if where.is_relative_to(root) else where)


def _check_abi(module, where) -> None:
    if module.ABI_VERSION != ABI_VERSION:
        raise HostPathError(f"the host extension in {where} speaks ABI {module.ABI_VERSION}, not {ABI_VERSION}")


def clear_stale_baton(where: Path) -> None:
    """Remove torch's build baton (the file `lock` in the build folder) left by a process that
    died while building, e.g. one that exited while this module's background build was still
    compiling. torch waits for that file to disappear and would wait forever. Called with our own
    lock held, which every builder of the folder takes first, so no live build owns the file."""
    baton = where / TORCH_BATON
    if baton.exists():
        warnings.warn(f"flashqla_tune: removing a stale build lock {baton} (a build was interrupted)", stacklevel=2)
        baton.unlink(missing_ok=True)


# --- the prebuilt extension of a kernel pack ------------------------------------------------------

@dataclass(frozen=True)
class PrebuiltExtension:
    """A compiled extension and what it was built for (a pack's manifest records these fields)."""
    path: Path
    module: str
    torch: str
    python_abi: str
    sources_sha256: str
    abi_version: int


def build_into(folder: Path) -> PrebuiltExtension:
    """Compile the extension (through the cache's build folder, so a second pack reuses it) and copy
    its binary into `folder` as <module>.so. Needs a C++ compiler and Python's headers, no GPU."""
    module = _build_and_load()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / f"{module.__name__}.so"
    shutil.copyfile(module.__file__, dest)
    return PrebuiltExtension(dest, module.__name__, torch.__version__, python_abi(), sources_sha256(),
                             int(module.ABI_VERSION))


def mismatch(record) -> str | None:
    """How a prebuilt extension's record (module, torch, python_abi, sources_sha256, abi_version)
    does not fit this process, or None when it does."""
    wrong = []
    if record.torch != torch.__version__:
        wrong.append(f"built for torch {record.torch}, this process runs torch {torch.__version__}")
    if record.python_abi != python_abi():
        wrong.append(f"built for Python ABI {record.python_abi}, this interpreter is {python_abi()}")
    if record.abi_version != ABI_VERSION:
        wrong.append(f"speaks kernel ABI {record.abi_version}, this flashqla_tune speaks {ABI_VERSION}")
    if record.sources_sha256 != sources_sha256():
        wrong.append("built from other csrc/ sources than this flashqla_tune's")
    return "; ".join(wrong) or None


def import_prebuilt(path: Path, name: str):
    """Import a compiled extension from its file (no compiler involved), after checking that the
    file is a complete shared library (loader.check_elf: a truncated one would kill the process)."""
    check_elf(path)
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise HostPathError(f"{path} is not an importable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _check_abi(module, path)
    return module


def use_pack_extension(pack, record) -> bool:
    """Take a loaded pack's prebuilt extension (`record`: its manifest entry, with `so` relative to
    the pack; None: the pack has none) for the C++ path, where it fits this process. Otherwise warn
    once, naming why, and keep that pack's calls on the Python path: nothing is compiled for them.
    Returns whether the pack's calls can take the C++ path."""
    global _extension
    if not enabled():
        return False
    if record is None:
        _warn(f"pack {pack} carries no prebuilt C++ host extension (rebuild it with flashqla-tune build --force)")
        return False
    why = mismatch(record)
    if why is not None:
        _warn(f"pack {pack}: its prebuilt C++ host extension does not fit this process ({why}); rebuild the "
              f"pack with this torch and Python for the C++ path")
        return False
    if _extension is not None:  # one is loaded already, from the same sources: the pack's calls use it
        return True
    try:
        module = import_prebuilt(Path(pack) / record.so, record.module)
    except Exception as exc:  # a binary that does not load here (a missing system library, say)
        _warn(f"pack {pack}: its prebuilt C++ host extension {record.so} does not load "
              f"({type(exc).__name__}: {exc})")
        return False
    with _lock:
        if _extension is None:
            _extension = module
    return True


def _warn(message: str) -> None:
    warnings.warn(f"{message}; its eager calls take the Python host path (the same results, more host time "
                  f"per call)", RuntimeWarning, stacklevel=3)


# --- signature contexts ---------------------------------------------------------------------------

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
        result = context.extension.forward(context.handle, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu,
                                           initial_state, None if scale is None else float(scale),
                                           bool(output_final_state), bool(use_qk_l2norm), stream)
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


class _SignatureContext:
    """One signature's C++ SignatureContext (`handle`), the extension module that made it and the
    objects its raw pointers point into (the library, the warm-up tables), kept alive with it."""

    def __init__(self, extension, handle, library, tables):
        self.extension = extension
        self.handle = handle
        self.library = library
        self.tables = tables


def remember(key, plan, library, tables, device: torch.device, may_build: bool = True) -> None:
    """Keep the context of a call that just succeeded on the Python path (plan, its loaded library,
    its warmup_tables.WarmupTables). Until the extension is loaded it keeps nothing: where
    may_build (the pack-less op) it starts the background build here (once); a pack's call passes
    may_build=False and never builds (loading the pack said why its extension is not in use). It
    does nothing when the C++ path is switched off or cannot be built (warning once)."""
    if key is None or tables is None or key in _contexts or not enabled():
        return  # tables None: a default table first seen under graph capture ran without CP
    ext = _extension
    if ext is None:
        if not may_build:
            return
        start_build()  # not built yet: start it (once) and let a later call of the signature come back
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
        _contexts.setdefault(key, _SignatureContext(ext, handle, library, tables))


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


__all__ = ["ENV_SWITCH", "HostPathError", "PrebuiltExtension", "build_into", "build_key", "check_private_folder",
           "compile_extension", "enabled", "extension", "forget", "forward", "import_prebuilt", "known", "mismatch",
           "module_name", "python_abi", "remember", "signature", "source_files", "sources_sha256", "start_build",
           "use_pack_extension"]
