"""What the backward's three kernel libraries (chain_kernels, prep_kernels, chunk_kernels) share:
rendering a template, building through the kernel cache, opening through ctypes with the ABI
checks, the process's table of opened, registered and offered (a pack's) libraries, and the small
helpers their launches use on torch tensors.

Each library exports, under its own symbol prefix P (for example fqt_bwd_chain):
P_abi_version() -> int32, P_spec_json() -> the spec it was built for, P_args_bytes() -> the size
of its argument struct, P(const Args*, cudaStream_t) -> a CUDA error code (0: launched), and
P_error_string(code). A library is used only when all four checks agree with this flashqla_tune:
its ELF header, its ABI version, the argument struct's size and the spec it embeds.
"""
from __future__ import annotations

import ctypes
import json
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger("flashqla_tune")
CHUNK = 64
ELEMENT_TYPES = {"float16": "cutlass::half_t", "bfloat16": "cutlass::bfloat16_t"}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# The dtypes of the inputs the prep and per-chunk kernels read in place (the call's), by their
# csrc/gdn_bwd_inputs.cuh InputDtype codes.
INPUT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def input_dtype_code(name: str, t: torch.Tensor) -> int:
    """The InputDtype code of an input read in place: ValueError naming `name` for another dtype."""
    try:
        return INPUT_DTYPES[t.dtype]
    except KeyError:
        raise ValueError(f"{name}: the kernel reads float32, float16 or bfloat16 inputs, got {t.dtype}") from None


def whole_pieces(t: torch.Tensor) -> bool:
    """Whether the kernels can read t in place in 16-byte pieces: contiguous columns, its other
    strides multiples of a piece and a 16-byte aligned start (an empty t always)."""
    piece = 16 // t.element_size()
    return not t.numel() or (t.stride(-1) == 1 and all(s % piece == 0 for s in t.stride()[:-1])
                             and t.data_ptr() % 16 == 0)


def check_pieces(name: str, t: torch.Tensor) -> None:
    """ValueError naming `name` unless a [chunks, H, 64, D] input read in place is whole 16-byte
    pieces (whole_pieces)."""
    piece = 16 // t.element_size()
    if not whole_pieces(t):
        raise ValueError(f"{name}: the kernel reads its rows in 16-byte pieces: it needs contiguous columns, "
                         f"strides of multiples of {piece} elements ({t.dtype}) and a 16-byte aligned start, "
                         f"got strides {t.stride()} at {t.data_ptr():#x}")


class BackwardKernelError(RuntimeError):
    """A backward kernel library cannot be built, loaded or launched here; the message says why.
    Each library has its own subclass; the backward's fallbacks catch this base."""


def spec_json(spec) -> str:
    """The spec as the library embeds it (sorted keys, no spaces)."""
    return json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))


def render_template(template_name: str, **constants) -> str:
    """The .cu text of a library: templates/<template_name> rendered with `constants` (strict: a
    constant the template names but is not given raises)."""
    import jinja2

    from ..package_data import templates_dir

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                             autoescape=False, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    return env.get_template(template_name).render(**constants)


class LibrarySpec:
    """What the three spec dataclasses share (each a frozen dataclass with an `operand_dtype` field,
    the 16-bit wgmma operand type, and a `name` property): the operand's torch dtype, the dict the
    library embeds, and the check of the operand dtype."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.operand_dtype]

    def to_dict(self) -> dict:
        return asdict(self)

    def _check_operand_dtype(self) -> None:
        if self.operand_dtype not in ELEMENT_TYPES:
            raise ValueError(f"{type(self).__name__}.operand_dtype={self.operand_dtype!r} must be one of "
                             f"{sorted(ELEMENT_TYPES)}")


@dataclass(frozen=True)
class LibraryKind:
    """One family of backward libraries: the exported symbols' prefix, how the messages name it,
    its ABI version (its *_host.cuh's), the ctypes mirror of its argument struct, its error class
    and the function that renders a spec's source."""
    symbol: str
    description: str
    abi_version: int
    args_type: type
    error: type
    render: Callable


@dataclass(frozen=True)
class LibraryRenderer:
    """The kernel cache's renderer of one kind's libraries: entries live beside the forward's plans,
    keyed, locked, checked and listed by flashqla_tune.cache alike, with the kind's ABI in their key."""
    kind: LibraryKind

    @property
    def abi_version(self) -> int:
        return self.kind.abi_version

    def render(self, spec) -> str:
        return self.kind.render(spec)


class OpenedLibrary:
    """A library opened through ctypes, checked against its kind's ABI and the spec asked for."""

    def __init__(self, kind: LibraryKind, so_path: Path, spec):
        from ..loader import MalformedLibraryError, check_elf

        self.kind, self.path, self.spec = kind, Path(so_path), spec
        p = kind.symbol
        try:
            check_elf(self.path)
            lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL)
            for name, res, args in ((f"{p}_abi_version", ctypes.c_int32, []),
                                    (f"{p}_spec_json", ctypes.c_char_p, []),
                                    (f"{p}_args_bytes", ctypes.c_int64, []),
                                    (p, ctypes.c_int32, [ctypes.POINTER(kind.args_type), ctypes.c_void_p]),
                                    (f"{p}_error_string", ctypes.c_char_p, [ctypes.c_int32])):
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
        except (OSError, AttributeError, MalformedLibraryError) as exc:
            raise kind.error(f"cannot load {kind.description} library {self.path}: {exc}") from exc
        self._lib = lib
        try:
            version = getattr(lib, f"{p}_abi_version")()
            size = getattr(lib, f"{p}_args_bytes")()
            embedded = json.loads(getattr(lib, f"{p}_spec_json")().decode())
        except (AttributeError, UnicodeDecodeError, ValueError) as exc:  # a NULL or malformed embedded spec
            raise kind.error(f"{kind.description} library {self.path} does not report its spec: "
                             f"{type(exc).__name__}: {exc}; it is stale or not one of ours") from exc
        want_size = ctypes.sizeof(kind.args_type)
        if version != kind.abi_version or size != want_size or embedded != spec.to_dict():
            raise kind.error(f"{kind.description} library {self.path} (ABI {version}, args {size} bytes, spec "
                             f"{embedded}) does not match this flashqla_tune (ABI {kind.abi_version}, args {want_size} "
                             f"bytes, spec {spec.to_dict()}); it is stale")

    def args_bytes(self) -> int:
        return getattr(self._lib, f"{self.kind.symbol}_args_bytes")()

    def launch(self, args, stream: int) -> None:
        p = self.kind.symbol
        code = getattr(self._lib, p)(ctypes.byref(args), ctypes.c_void_p(stream or None))
        if code != 0:
            text = getattr(self._lib, f"{p}_error_string")(code)
            raise self.kind.error(f"{self.spec.name}: {p} failed with CUDA error {code}: "
                                  f"{text.decode(errors='replace') if text else 'unknown'}")


class LibraryTable:
    """This process's libraries of one kind, per spec: registered or offered ones first, else built
    through the kernel cache on first use (one build per spec and process, under a lock)."""

    def __init__(self, kind: LibraryKind):
        self.kind = kind
        self.renderer = LibraryRenderer(kind)
        self._opened: dict = {}
        self._offered: dict = {}    # spec -> (path, sha256 or None): a pack's, opened on first use
        self._lock = threading.Lock()

    def cache_entry(self, spec, root: Path | None = None, config=None):
        """The kernel cache's entry (cache.CacheEntry) of `spec`'s library, built if missing or invalid.
        root: the kernels folder (default: the kernel cache's)."""
        from ..cache import get_kernels, lookup

        if lookup(spec, self.renderer, config, root) is None:
            logger.warning("compiling %s %s with nvcc on first use (cached afterwards)", self.kind.description,
                           spec.name)
        return get_kernels([spec], self.renderer, config, root, jobs=1)[0]

    def open(self, so_path: Path, spec) -> OpenedLibrary:
        """A built library opened and checked (ELF, ABI, argument size, spec), not kept in the table;
        the kind's error, saying "stale", when it was built for another spec or ABI."""
        return OpenedLibrary(self.kind, Path(so_path), spec)

    def holds(self, spec) -> bool:
        """Whether `spec` has a registered, opened or offered library here (one that get() would use
        before building)."""
        return spec in self._opened or spec in self._offered

    def register(self, spec, so_path: Path) -> OpenedLibrary:
        """Use an already built library for `spec` (one built on another machine), so that nothing is
        built in this process; checked like any other (ELF, ABI, argument size, spec)."""
        lib = OpenedLibrary(self.kind, Path(so_path), spec)
        with self._lock:
            self._opened[spec] = lib
            self._offered.pop(spec, None)
        return lib

    def offer(self, spec, so_path: Path, sha256: str | None = None) -> None:
        """Make a prebuilt library (a kernel pack's) the one `spec` uses in this process, opened and
        checked (its sha256 when given, ELF, ABI, argument size, spec) on first use instead of a
        build; nothing is loaded now, so a pack opens without touching CUDA."""
        with self._lock:
            if spec not in self._opened:
                self._offered[spec] = (Path(so_path), sha256)

    def forget(self) -> None:
        """Drop every opened and offered library (tests; a later use opens or builds again)."""
        with self._lock:
            self._opened.clear()
            self._offered.clear()

    def _open_offered(self, spec) -> OpenedLibrary:
        """The offered library opened; it stays offered until it opens, so a changed or stale pack
        file raises every time instead of being passed over for a build."""
        from ..files import sha256_file

        path, sha = self._offered[spec]
        try:
            actual = sha256_file(path) if sha is not None else None
        except OSError as exc:
            raise self.kind.error(f"{self.kind.description} library {path} cannot be read: {exc}") from exc
        if actual != sha:
            raise self.kind.error(f"{self.kind.description} library {path} does not match the sha256 its pack "
                                  f"recorded (changed since the pack was loaded)")
        lib = OpenedLibrary(self.kind, path, spec)
        del self._offered[spec]
        return lib

    def get(self, spec) -> OpenedLibrary:
        """The opened library of `spec`. Raises the kind's error naming the cause when it cannot be
        built or opened (no nvcc, a failed build, an unsafe cache, a changed pack file)."""
        lib = self._opened.get(spec)
        if lib is not None:
            return lib
        with self._lock:
            lib = self._opened.get(spec)
            if lib is None and spec in self._offered:
                lib = self._opened[spec] = self._open_offered(spec)
            if lib is None:
                from ..environment import cache_dir
                from ..loader import check_private

                try:
                    entry = self.cache_entry(spec)
                    check_private(entry.so_path, cache_dir())
                except BackwardKernelError:
                    raise
                except Exception as exc:
                    raise self.kind.error(f"{self.kind.description} ({spec.name}) is not available: "
                                          f"{type(exc).__name__}: {exc}") from exc
                lib = self._opened[spec] = OpenedLibrary(self.kind, entry.so_path, spec)
        return lib


# ---------------------------------------------------------------- helpers of the launches

def ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def stream_handle(device) -> int:
    from ..runtime import current_stream_handle

    return current_stream_handle(device)


def check_tensor(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device=None) -> None:
    """ValueError naming `name` unless t is a contiguous CUDA tensor of this shape and dtype (on
    `device` when given), saying what it is instead."""
    if (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_cuda
            or not t.is_contiguous() or (device is not None and t.device != device)):
        got = (f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}"
               if isinstance(t, torch.Tensor) else type(t).__name__)
        raise ValueError(f"{name}: expected a contiguous {dtype} tensor of shape {tuple(shape)} on "
                         f"{device or 'a CUDA device'}, got {got}")


__all__ = ["BackwardKernelError", "CHUNK", "ELEMENT_TYPES", "INPUT_DTYPES", "LibraryKind", "LibraryRenderer",
           "LibrarySpec", "LibraryTable", "OpenedLibrary", "TORCH_DTYPES", "check_pieces", "check_tensor",
           "input_dtype_code", "ptr", "render_template", "spec_json", "stream_handle", "whole_pieces"]
