"""Open a built kernel library through ctypes and check it (no PyTorch C++ extension, nothing built
at import).

Before dlopen, the file's ELF header is read and every segment and section it declares must lie
inside the file (a truncated library would otherwise kill the process with SIGBUS inside
dlopen). dlopen runs the library's constructors, so these checks cannot make a library safe to
open: they catch damage, not malice. After dlopen a library is used only when it says it speaks
this ABI version and embeds the plan we asked for. Code is loaded from the kernel cache only when
its folders are writable by this user alone (`check_private`): a cache others can write to is a
channel for their code into this process.

Opening a pack's libraries needs nothing else, so this module imports only abi and plan:
`load_kernel`, which builds through the cache first (the pack-less op's first use of a plan),
imports the compiler side when it is called; a cache entry whose library disagrees or is
malformed is dropped and rebuilt once.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import stat
import struct
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


class MalformedLibraryError(StaleKernelError):
    """A library file is not a complete shared object for this host (truncated, not ELF, another
    machine's); detected before dlopen, so the cache's rebuild path and the pack loader can act."""


class UnsafeLocationError(RuntimeError):
    """Code would be loaded from a folder or file that another user can write to (or owns)."""


class KernelLaunchError(RuntimeError):
    """fqt_gdn_fwd returned a CUDA error code."""


# ELF machine numbers of the hosts a Hopper GPU sits in (x86-64 servers, GH200's aarch64).
_ELF_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}
_ELF_MACHINE_NAMES = {62: "x86-64", 183: "aarch64", 3: "i386", 40: "arm", 243: "riscv"}
_ET_DYN, _PT_LOAD, _SHT_NOBITS = 3, 1, 8


def check_elf(path: Path) -> None:
    """Raise MalformedLibraryError unless `path` is a complete 64-bit ELF shared object of this
    host's machine type: every program header's and section's bytes must lie inside the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read()
    except OSError as exc:
        raise MalformedLibraryError(f"cannot read kernel library {path}: {exc}") from exc

    def bad(why: str) -> MalformedLibraryError:
        return MalformedLibraryError(f"{path} is not a complete shared library ({why}; {size} bytes); "
                                     f"it was not opened")

    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise bad("no ELF header")
    if data[4] != 2:
        raise bad(f"ELF class {data[4]}, expected 2 (64-bit)")
    if data[5] not in (1, 2):
        raise bad(f"ELF data encoding {data[5]}")
    end = "<" if data[5] == 1 else ">"
    (e_type, e_machine, _version, _entry, phoff, shoff, _flags, _ehsize, phentsize, phnum, shentsize,
     shnum, _shstrndx) = struct.unpack_from(end + "HHIQQQIHHHHHH", data, 16)
    if e_type != _ET_DYN:
        raise bad(f"ELF type {e_type}, expected {_ET_DYN} (a shared object)")
    want = _ELF_MACHINES.get(platform.machine().lower())
    if want is not None and e_machine != want:
        raise MalformedLibraryError(
            f"{path} is built for {_ELF_MACHINE_NAMES.get(e_machine, f'ELF machine {e_machine}')}, this host is "
            f"{platform.machine()}; rebuild it on this host architecture")
    if phnum == 0 or phentsize < 56 or phoff + phnum * phentsize > size:
        raise bad(f"program headers at {phoff} ({phnum} x {phentsize} bytes) do not fit")
    for i in range(phnum):
        p_type, _pflags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from(end + "IIQQQQ", data,
                                                                                  phoff + i * phentsize)
        if p_offset + p_filesz > size:
            raise bad(f"segment {i} (type {p_type}) spans bytes {p_offset}..{p_offset + p_filesz}")
    if shoff:
        if shentsize < 64 or shoff + shnum * shentsize > size:
            raise bad(f"section headers at {shoff} ({shnum} x {shentsize} bytes) do not fit")
        for i in range(shnum):
            _name, sh_type, _shflags, _addr, sh_offset, sh_size = struct.unpack_from(end + "IIQQQQ", data,
                                                                                      shoff + i * shentsize)
            if sh_type != _SHT_NOBITS and sh_offset + sh_size > size:
                raise bad(f"section {i} spans bytes {sh_offset}..{sh_offset + sh_size}")


def _own_private_group(gid: int, uid: int) -> bool:
    """Whether `gid` is the user private group of `uid` (named as the user, no other members), as
    systems with a umask of 002 give each user: writable by its group is then writable by its owner."""
    try:
        import grp
        import pwd

        group, user = grp.getgrgid(gid), pwd.getpwuid(uid)
    except (ImportError, KeyError):
        return False
    return group.gr_name == user.pw_name and user.pw_gid == gid and set(group.gr_mem) <= {user.pw_name}


def check_private(path: Path, up_to: Path | None = None) -> None:
    """Raise UnsafeLocationError unless `path` and each folder above it, up to and including
    `up_to` (default: only its own folder), is owned by this user and writable by no one else
    (group write is allowed only for the owner's own private group). Anyone who can write to one
    of them can replace the code loaded from it."""
    path = Path(path).absolute()
    stop = Path(up_to).absolute() if up_to is not None else path.parent
    chain, folder = [path], path.parent
    while folder.is_relative_to(stop):
        chain.append(folder)
        if folder == stop:
            break
        folder = folder.parent
    me = os.geteuid()
    for item in chain:
        try:
            st = os.stat(item)
        except OSError as exc:
            raise UnsafeLocationError(f"cannot check {item} before loading code from it: {exc}") from exc
        what = "folder" if stat.S_ISDIR(st.st_mode) else "file"
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != me:
            raise UnsafeLocationError(
                f"refusing to load code from {path}: the {what} {item} (mode {mode:04o}) is owned by uid "
                f"{st.st_uid}, not by this user (uid {me}); use a kernel cache of your own (FLASHQLA_TUNE_CACHE)")
        if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not _own_private_group(st.st_gid, st.st_uid)):
            raise UnsafeLocationError(
                f"refusing to load code from {path}: the {what} {item} has mode {mode:04o}, so other users can "
                f"write to it; chmod go-w it or use a kernel cache of your own (FLASHQLA_TUNE_CACHE)")


class KernelLibrary:
    """One built .so: its plan, checked at open, and typed entry points."""

    def __init__(self, so_path: Path, plan: KernelPlan):
        self.path = Path(so_path)
        self.plan = plan
        check_elf(self.path)
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

    A stale entry (wrong ABI version or embedded plan, or a malformed file) is dropped and rebuilt
    once; if the fresh build is stale too, the template itself embeds the wrong plan and the error
    says so. A cache folder that others can write to is refused (UnsafeLocationError) before
    anything in it is opened.
    """
    from . import cache  # the compiler side (render, build, nvcc): only where a plan is built

    top = cache.kernels_dir(root)
    if root is None:
        from .environment import cache_dir

        top = cache_dir()
    if top.is_dir():
        check_private(top, top)

    entry = cache.lookup(plan, renderer, config, root)
    if entry is None:  # a compile stalls this first call: say so once, where a user's logging sees it
        logger.warning("compiling kernel plan %s with nvcc on its first use (cached afterwards; "
                       "a kernel pack compiles nothing)", plan.name)
        entry = cache.get_kernel(plan, renderer, config, root)
    try:
        check_private(entry.so_path, top)
        return open_library(entry.so_path, plan)
    except StaleKernelError as first:
        cache.invalidate(entry)
        entry = cache.get_kernel(plan, renderer, config, root)
        try:
            check_private(entry.so_path, top)
            return open_library(entry.so_path, plan)
        except StaleKernelError as second:
            raise StaleKernelError(f"{second} (even after a rebuild: the template does not embed the plan it "
                                   f"was rendered for; first error: {first})") from second


__all__ = ["KernelLaunchError", "KernelLibrary", "MalformedLibraryError", "StaleKernelError", "UnsafeLocationError",
           "check_elf", "check_private", "load_kernel", "open_library"]
