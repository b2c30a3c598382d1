"""The backward's sequential chains on Hopper: csrc/gdn_bwd_chain.cuh through templates/gdn_bwd_chain.cu.j2.

Two directions of one kernel family, for the batched PyTorch backward (chunked_torch) to call on
CUDA devices in place of its two loops over chunk positions:

- `chain_states`: every chunk's incoming state S_c (and the new values Vn = u - w S_c),
  S_{c+1} = e^{gamma_C} S_c + Kd^T Vn, from h0 or zeros;
- `chain_gradients`: every chunk's end-state gradient dS_{c+1} (and dVn = scale P^T dO + Kd dS_{c+1}),
  dS_c = e^{gamma_C} dS_{c+1} + (D Q)^T (scale dO) - w^T dVn, from dht or zeros, ending at dh0.

Their inputs are the batched part's per-chunk tensors in its padded chunk layout [chunks, Hv, 64, D]
(pad rows zero): w, Kd and D Q and the scaled dO as the 16-bit wgmma operands (`OPERAND_DTYPE`,
fp16 by default: three more mantissa bits than bf16; chunked_torch hands each chain its inputs
scaled near unit magnitude per (sequence, v-head), so a training step's loss scale does not decide
the range; the states themselves, rounded to fp16 as A operands, must stay below 65504 after that
scaling, which normalised k and a decaying gate keep them far from),
u and scale P^T dO in fp32, e^{gamma_C} in fp32; the
states are fp32 [., Hv, K, V] (a state_v_first call's states are transposed outside, by the caller).
The chains themselves accumulate in fp32.

A library is built once per ChainSpec with the project's build (ninja driving nvcc, build.py), kept
in the kernel cache under a content-addressed key over the rendered source, every csrc/ header it
includes, the toolchain's versions, the flags and the arch, and opened through ctypes (no PyTorch C++
extension). Launches go on the current stream and never synchronise.
"""
from __future__ import annotations

import ctypes
import json
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger("flashqla_tune")
CHUNK = 64
TEMPLATE_NAME = "gdn_bwd_chain.cu.j2"
ABI_VERSION = 1      # csrc/gdn_bwd_chain_host.cuh FQT_BWD_CHAIN_ABI_VERSION
STATES, GRADIENTS = 0, 1
_ELEMENT_TYPES = {"float16": "cutlass::half_t", "bfloat16": "cutlass::bfloat16_t"}
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class ChainKernelError(RuntimeError):
    """The chain kernels cannot be built, loaded or launched here; the message says why."""


@dataclass(frozen=True)
class ChainSpec:
    """What one chain library is compiled for: the operand dtype, the head dims, the V columns of a
    CTA (64: one consumer warp group; 128: two) and the stage ring's depth."""
    operand_dtype: str = "float16"
    head_k_dim: int = 128
    head_v_dim: int = 128
    block_v: int = 64
    stages: int = 2

    def __post_init__(self) -> None:
        if self.operand_dtype not in _ELEMENT_TYPES:
            raise ValueError(f"ChainSpec.operand_dtype={self.operand_dtype!r} must be one of {sorted(_ELEMENT_TYPES)}")
        if self.head_k_dim % 64 or not 64 <= self.head_k_dim <= 256:
            raise ValueError(f"ChainSpec.head_k_dim={self.head_k_dim} must be 64, 128, 192 or 256")
        if self.block_v not in (64, 128) or self.head_v_dim % self.block_v or self.head_v_dim <= 0:
            raise ValueError(f"ChainSpec.block_v={self.block_v} must be 64 or 128 and divide "
                             f"head_v_dim={self.head_v_dim}")
        if not 1 <= self.stages <= 4:
            raise ValueError(f"ChainSpec.stages={self.stages} must be 1 to 4")

    @property
    def name(self) -> str:
        return (f"gdn_bwd_chain_{self.operand_dtype}_k{self.head_k_dim}_v{self.head_v_dim}"
                f"_bv{self.block_v}_s{self.stages}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.operand_dtype]

    def to_dict(self) -> dict:
        return asdict(self)


OPERAND_DTYPE = "float16"
# The head dims (K, V) whose chain library the backward uses: built and checked for spills and
# shared memory here, and run against the float64 loops on the H200. Other dims ChainSpec takes
# (K up to 256) compile, but at K = 256 two stages exceed the shared memory and one spills.
BACKWARD_DIMS = frozenset({(128, 128)})


def spec_for(head_k_dim: int, head_v_dim: int) -> ChainSpec:
    """The chain library the backward uses for these head dims; ValueError for dims outside
    BACKWARD_DIMS."""
    if (head_k_dim, head_v_dim) not in BACKWARD_DIMS:
        raise ValueError(f"the backward's chain kernels are built for (K, V) in {sorted(BACKWARD_DIMS)}, "
                         f"not K={head_k_dim}, V={head_v_dim}")
    return ChainSpec(OPERAND_DTYPE, head_k_dim, head_v_dim)


def spec_json(spec: ChainSpec) -> str:
    return json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))


def render_source(spec: ChainSpec) -> str:
    """The .cu text of a chain library (the template only fixes constants)."""
    import jinja2

    from ..package_data import templates_dir

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                             autoescape=False, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    return env.get_template(TEMPLATE_NAME).render(
        name=spec.name, abi_version=ABI_VERSION, spec_json=spec_json(spec),
        element_type=_ELEMENT_TYPES[spec.operand_dtype],
        head_k_dim=spec.head_k_dim, head_v_dim=spec.head_v_dim, block_v=spec.block_v, stages=spec.stages)


# ---------------------------------------------------------------- build and cache

@dataclass(frozen=True)
class ChainRenderer:
    """The kernel cache's renderer of chain libraries: entries live beside the forward's plans,
    keyed, locked, checked and listed by flashqla_tune.cache alike, with this ABI in their key."""
    abi_version: int = ABI_VERSION

    def render(self, spec: ChainSpec) -> str:
        return render_source(spec)


def get_chain_library(spec: ChainSpec, root: Path | None = None, config=None):
    """The kernel cache's entry (cache.CacheEntry) of `spec`'s library, built if missing or invalid.
    root: the kernels folder (default: the kernel cache's)."""
    from ..cache import get_kernels, lookup

    if lookup(spec, ChainRenderer(), config, root) is None:
        logger.warning("compiling the backward's chain kernels %s with nvcc on their first use (cached afterwards)",
                       spec.name)
    return get_kernels([spec], ChainRenderer(), config, root, jobs=1)[0]


class ChainArgs(ctypes.Structure):
    """ctypes mirror of FqtBwdChainArgs (csrc/gdn_bwd_chain_host.cuh); the library reports its size."""
    _fields_ = [
        ("direction", ctypes.c_int32), ("num_heads", ctypes.c_int32),
        ("num_chunks", ctypes.c_int64), ("num_seqs", ctypes.c_int64),
        ("w", ctypes.c_void_p), ("kd", ctypes.c_void_p), ("qd", ctypes.c_void_p), ("dout", ctypes.c_void_p),
        ("add", ctypes.c_void_p), ("decay", ctypes.c_void_p), ("chunk_offsets", ctypes.c_void_p),
        ("state_in", ctypes.c_void_p), ("state_out", ctypes.c_void_p),
        ("chunk_states", ctypes.c_void_p), ("chunk_values", ctypes.c_void_p),
    ]


class ChainLibrary:
    """An opened chain library, checked against this module's ABI and the spec it was asked for."""

    def __init__(self, so_path: Path, spec: ChainSpec):
        from ..loader import MalformedLibraryError, check_elf

        self.path, self.spec = Path(so_path), spec
        try:
            check_elf(self.path)
            lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL)
            for name, res, args in (("fqt_bwd_chain_abi_version", ctypes.c_int32, []),
                                    ("fqt_bwd_chain_spec_json", ctypes.c_char_p, []),
                                    ("fqt_bwd_chain_args_bytes", ctypes.c_int64, []),
                                    ("fqt_bwd_chain", ctypes.c_int32, [ctypes.POINTER(ChainArgs), ctypes.c_void_p]),
                                    ("fqt_bwd_chain_error_string", ctypes.c_char_p, [ctypes.c_int32])):
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
        except (OSError, AttributeError, MalformedLibraryError) as exc:
            raise ChainKernelError(f"cannot load the backward chain library {self.path}: {exc}") from exc
        self._lib = lib
        version, size = lib.fqt_bwd_chain_abi_version(), lib.fqt_bwd_chain_args_bytes()
        embedded = json.loads(lib.fqt_bwd_chain_spec_json().decode())
        if version != ABI_VERSION or size != ctypes.sizeof(ChainArgs) or embedded != spec.to_dict():
            raise ChainKernelError(f"backward chain library {self.path} (ABI {version}, args {size} bytes, spec "
                                   f"{embedded}) does not match this flashqla_tune (ABI {ABI_VERSION}, args "
                                   f"{ctypes.sizeof(ChainArgs)} bytes, spec {spec.to_dict()}); it is stale")

    def launch(self, args: ChainArgs, stream: int) -> None:
        code = self._lib.fqt_bwd_chain(ctypes.byref(args), ctypes.c_void_p(stream or None))
        if code != 0:
            text = self._lib.fqt_bwd_chain_error_string(code)
            raise ChainKernelError(f"{self.spec.name}: fqt_bwd_chain failed with CUDA error {code}: "
                                   f"{text.decode(errors='replace') if text else 'unknown'}")


_libraries: dict[ChainSpec, ChainLibrary] = {}
_offered: dict[ChainSpec, tuple[Path, str | None]] = {}   # prebuilt (a pack's): path, sha256; opened on first use
_lock = threading.Lock()


def register_library(spec: ChainSpec, so_path: Path) -> ChainLibrary:
    """Use an already built library for `spec` (a kernel pack's, or one built on another machine),
    so that nothing is built in this process; checked like any other (ABI, argument size, spec)."""
    lib = ChainLibrary(Path(so_path), spec)
    with _lock:
        _libraries[spec] = lib
    return lib


def offer_library(spec: ChainSpec, so_path: Path, sha256: str | None = None) -> None:
    """Make a prebuilt library (a kernel pack's) the one `spec` uses in this process, opened and
    checked (its sha256 when given, ABI, argument size, spec) on first use instead of building one;
    nothing is loaded now, so a pack opens without touching CUDA."""
    with _lock:
        if spec not in _libraries:
            _offered[spec] = (Path(so_path), sha256)


def _open_offered(spec: ChainSpec) -> ChainLibrary:
    from ..files import sha256_file

    path, sha = _offered.pop(spec)
    try:
        actual = sha256_file(path) if sha is not None else None
    except OSError as exc:
        raise ChainKernelError(f"the backward chain library {path} cannot be read: {exc}") from exc
    if actual != sha:
        raise ChainKernelError(f"the backward chain library {path} does not match the sha256 its pack recorded "
                               f"(changed since the pack was loaded)")
    return ChainLibrary(path, spec)


def library(spec: ChainSpec) -> ChainLibrary:
    """The opened library of `spec`: a registered or offered one, else built through the kernel
    cache on first use in this process. Raises ChainKernelError naming the cause when it cannot
    be built or opened."""
    lib = _libraries.get(spec)
    if lib is not None:
        return lib
    with _lock:
        lib = _libraries.get(spec)
        if lib is None and spec in _offered:
            lib = _libraries[spec] = _open_offered(spec)
        if lib is None:
            from ..environment import cache_dir
            from ..loader import check_private

            try:
                entry = get_chain_library(spec)
                top = cache_dir()
                check_private(entry.so_path, top)
            except ChainKernelError:
                raise
            except Exception as exc:  # no nvcc, a failed build, an unsafe cache: the backward cannot run on CUDA
                raise ChainKernelError(f"the backward's chain kernels ({spec.name}) are not available: "
                                       f"{type(exc).__name__}: {exc}") from exc
            lib = _libraries[spec] = ChainLibrary(entry.so_path, spec)
    return lib


# ---------------------------------------------------------------- launches on torch tensors

def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _stream(device) -> int:
    from ..runtime import current_stream_handle

    return current_stream_handle(device)


def add_tiles(x: torch.Tensor, block_v: int) -> torch.Tensor:
    """[chunks, Hv, 64, V] fp32 -> the kernels' [chunks, Hv, V / block_v, 64, block_v] tiles."""
    NC, Hv, C, V = x.shape
    return x.reshape(NC, Hv, C, V // block_v, block_v).transpose(2, 3).contiguous()


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device=None) -> None:
    if (tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous() or not t.is_cuda
            or (device is not None and t.device != device)):
        raise ValueError(f"{name}: expected a contiguous {dtype} tensor of shape {tuple(shape)} on "
                         f"{device or 'a CUDA device'}, got {t.dtype} {tuple(t.shape)} "
                         f"(contiguous={t.is_contiguous()}, device={t.device})")


def _run(direction: int, *, w, kd, add, decay, chunk_offsets, state_in, values, qd=None, dout=None, out=None):
    NC, Hv, C, K = w.shape
    V = add.shape[-1]
    N = chunk_offsets.shape[0] - 1
    spec = spec_for(K, V)
    op = spec.torch_dtype
    if C != CHUNK:
        raise ValueError(f"chunk layout rows must be {CHUNK}, got {C}")
    dev = w.device
    _check("w", w, (NC, Hv, C, K), op)
    _check("kd", kd, (NC, Hv, C, K), op, dev)
    _check("add", add, (NC, Hv, C, V), torch.float32, dev)
    _check("decay", decay, (NC, Hv), torch.float32, dev)
    _check("chunk_offsets", chunk_offsets, (N + 1,), torch.int64, dev)
    if direction == GRADIENTS:
        _check("qd", qd, (NC, Hv, C, K), op, dev)
        _check("dout", dout, (NC, Hv, C, V), op, dev)
    if state_in is not None:
        _check("state_in", state_in, (N, Hv, K, V), torch.float32, dev)
    if NC * Hv * CHUNK >= 2 ** 31:
        raise ValueError(f"{NC} chunks x {Hv} heads x {CHUNK} rows = {NC * Hv * CHUNK} rows: the chain kernels' TMA "
                         f"coordinates are int32 (fewer than 2^31 rows); split the batch")
    tiles = add_tiles(add, spec.block_v)
    if out is None:
        chunk_states = torch.empty(NC, Hv, K, V, dtype=torch.float32, device=dev)
        chunk_values = torch.empty(NC, Hv, C, V, dtype=torch.float32, device=dev) if values else None
        state_out = torch.empty(N, Hv, K, V, dtype=torch.float32, device=dev)
    else:  # the caller's buffers (tests pass NaN-filled ones to see that every element is written)
        chunk_states, chunk_values, state_out = out
        _check("out chunk_states", chunk_states, (NC, Hv, K, V), torch.float32, dev)
        if chunk_values is not None:
            _check("out chunk_values", chunk_values, (NC, Hv, C, V), torch.float32, dev)
        _check("out state", state_out, (N, Hv, K, V), torch.float32, dev)
    args = ChainArgs(direction=direction, num_heads=Hv, num_chunks=NC, num_seqs=N, w=_ptr(w), kd=_ptr(kd),
                     qd=_ptr(qd), dout=_ptr(dout), add=_ptr(tiles), decay=_ptr(decay),
                     chunk_offsets=_ptr(chunk_offsets), state_in=_ptr(state_in), state_out=_ptr(state_out),
                     chunk_states=_ptr(chunk_states), chunk_values=_ptr(chunk_values))
    lib = library(spec)
    with torch.cuda.device(dev):  # the launch goes to the current device: make it the tensors'
        lib.launch(args, _stream(dev))
    return chunk_states, chunk_values, state_out


def chain_states(w, kd, u, decay, chunk_offsets, h0=None, values=True, out=None):
    """The forward chain over every sequence's chunks, on the device's current stream.

    w, kd [chunks, Hv, 64, K] in the operand dtype; u [chunks, Hv, 64, V] fp32; decay (e^{gamma_C})
    [chunks, Hv] fp32; chunk_offsets int64 [N + 1] on the device (sequence i owns chunks
    offsets[i] .. offsets[i+1]); h0 fp32 [N, Hv, K, V] or None (zeros).
    Returns (S_c [chunks, Hv, K, V], Vn [chunks, Hv, 64, V] or None, final state [N, Hv, K, V]), fp32,
    written into `out` (those three buffers) when given."""
    return _run(STATES, w=w, kd=kd, add=u, decay=decay, chunk_offsets=chunk_offsets, state_in=h0, values=values,
                out=out)


def chain_gradients(w, kd, qd, dout, ptdo, decay, chunk_offsets, dht=None, values=True, out=None):
    """The reverse chain of the state gradient, on the device's current stream.

    w, kd, qd (D Q) [chunks, Hv, 64, K] and dout (scale dO) [chunks, Hv, 64, V] in the operand dtype;
    ptdo (scale P^T dO) [chunks, Hv, 64, V] fp32; decay, chunk_offsets as for chain_states; dht fp32
    [N, Hv, K, V] or None (zeros). Returns (dS_{c+1} [chunks, Hv, K, V], dVn [chunks, Hv, 64, V] or
    None, dh0 [N, Hv, K, V]), fp32, written into `out` when given."""
    return _run(GRADIENTS, w=w, kd=kd, add=ptdo, decay=decay, chunk_offsets=chunk_offsets, state_in=dht,
                values=values, qd=qd, dout=dout, out=out)


__all__ = ["ABI_VERSION", "ChainArgs", "ChainKernelError", "ChainLibrary", "ChainRenderer", "ChainSpec",
           "OPERAND_DTYPE", "add_tiles", "chain_gradients", "chain_states", "get_chain_library", "library",
           "offer_library", "register_library", "render_source", "spec_for"]
