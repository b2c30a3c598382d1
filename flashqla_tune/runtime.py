"""Run a plan's kernel library on torch tensors: buffers, the launch struct, the stream.

Libraries are opened once per process and plan (built through the cache on first use). A
call allocates its outputs and scratch from torch's caching allocator and launches on the
current stream, so it never synchronises and can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
import threading

import torch

from . import abi, warmup_tables
from .cp_cost_model import check_segment_table
from .plan import KernelPlan, default_plan
from .spec import GDNSpec

_libraries: dict[KernelPlan, object] = {}
_registered: dict[str, KernelPlan] = {}  # plans with a library from a pack, by registered name
_segment_tables: dict[str, tuple[int, ...]] = {}  # a pack's CP segment table, by registered name
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def default_plan_for(spec: GDNSpec) -> KernelPlan:
    """The default plan of a spec, built once per process (plan validation is not free per call)."""
    return default_plan(spec)


def register_library(plan: KernelPlan, lib, name: str | None = None,
                     segment_lengths: tuple[int, ...] | None = None) -> str:
    """Use an already opened library (e.g. from a kernel pack) for plan, so nothing is built, and
    make the plan findable for the op (plan_by_name) under `name` (default plan.name), with the
    pack's CP segment table if it has one. Returns the name."""
    name = name or plan.name
    with _lock:
        _libraries.setdefault(plan, lib)
        _registered[name] = plan
        if segment_lengths is not None:
            _segment_tables[name] = check_segment_table(segment_lengths)
    return name


def segment_lengths_for(name: str) -> tuple[int, ...] | None:
    """The segment table registered with a pack's plan, or None (the cost model decides per call)."""
    return _segment_tables.get(name)


def plan_by_name(name: str) -> KernelPlan:
    try:
        return _registered[name]
    except KeyError:
        raise KeyError(f"plan {name} is not loaded from any pack in this process") from None


def library(plan: KernelPlan):
    """The loaded library of a plan; built (or taken from the cache) on first use."""
    lib = _libraries.get(plan)
    if lib is None:
        from .loader import load_kernel  # imported lazily: building needs nvcc, loading needs a GPU

        with _lock:
            lib = _libraries.get(plan)
            if lib is None:
                lib = _libraries[plan] = load_kernel(plan)
    return lib


PREP_SCHEDULES = {"auto": 0, "serial": 1, "overlap": 2}  # csrc/gdn_abi.h FQT_PREP_*
TMA_ALIGNMENT = 16  # bytes: cuTensorMapEncodeTiled refuses a global address off a 16-byte boundary


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t contiguous and starting on a 16-byte boundary, as the TMA descriptors of q, k and v need
    it. A contiguous view whose storage offset is not a multiple of 16 bytes is copied: the driver
    refuses its address, and with CUTLASS's check compiled out (NDEBUG) the kernel would then
    load through a descriptor that was never written."""
    t = t.contiguous()
    return t if t.data_ptr() % TMA_ALIGNMENT == 0 else t.clone()


def forward(plan: KernelPlan, q, k, v, g, beta, cu_seqlens, initial_state, scale, output_final_state,
            use_qk_l2norm, out: torch.Tensor | None = None, final_out: torch.Tensor | None = None,
            prep_schedule: str = "auto", warmup: tuple[int, ...] | None = None,
            warmup_eps: float = warmup_tables.DEFAULT_EPS, segment_lengths: tuple[int, ...] | None = None,
            longest_tokens: int = 0, a_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None):
    """Packed inputs ([1, T, H, D], cu_seqlens int64 [N+1] on the device) -> (o, final_state).

    final_state is an empty tensor when not asked for (custom ops cannot return None). Tests
    pass NaN-filled `out` / `final_out` buffers to prove every element is written. prep_schedule
    forces how the prep and sequential kernels share the GPU ("serial" or "overlap"; results are
    bitwise equal), for tests and benchmarks; "auto" picks by the sequential grid's size.
    warmup (checked by warmup_tables.normalise) turns on context parallelism where its segment table
    splits (segment_lengths, else the cost model's for this table); the prep schedule is then serial.
    longest_tokens, the longest sequence when the host knows it (0: unknown), lets a call of short
    sequences skip the CP kernels. A plan built with FLA's in-kernel options (spec.gate_options) takes
    g and beta raw; with gate_in_kernel it needs a_log, and dt_bias (or None), [Hv] on the device
    (ops.check_gate_params checks them); a plan without the in-kernel gate takes neither."""
    T, Hv = v.shape[1], v.shape[2]
    N = cu_seqlens.shape[0] - 1
    K, V = q.shape[3], v.shape[3]
    layout_vk = plan.spec.state_layout == "vk"
    state_shape = (N, Hv, V, K) if layout_vk else (N, Hv, K, V)
    q, k, v = tma_ready(q), tma_ready(k), tma_ready(v)
    g = _as(g, torch.float32)
    beta = _as(beta, torch.float32)
    cu_seqlens = _as(cu_seqlens, torch.int64)
    h0 = None if initial_state is None else _as(initial_state, torch.float32)
    if plan.spec.gate_in_kernel != (a_log is not None) or (dt_bias is not None and a_log is None):
        raise ValueError(f"plan {plan.name} {'computes' if plan.spec.gate_in_kernel else 'does not compute'} the gate "
                         f"in the kernel, but the call passes A_log={'a tensor' if a_log is not None else None}, "
                         f"dt_bias={'a tensor' if dt_bias is not None else None}")
    a_log = None if a_log is None else _as(a_log, torch.float32)
    dt_bias = None if dt_bias is None else _as(dt_bias, torch.float32)
    for name, t in (("A_log", a_log), ("dt_bias", dt_bias)):  # the kernels read Hv floats of each
        if t is not None and (t.numel() != Hv or t.device != v.device):
            raise ValueError(f"{name} has {t.numel()} elements on {t.device}; plan {plan.name} reads [Hv]={Hv} "
                             f"floats on {v.device}")
    o = torch.empty_like(v) if out is None else out
    final = final_out if final_out is not None else torch.empty(
        state_shape if output_final_state else (0,), dtype=torch.float32, device=v.device)
    if T == 0:
        if output_final_state:
            final.copy_(h0) if h0 is not None else final.zero_()
        return o, final
    schedule = PREP_SCHEDULES.get(prep_schedule)
    if schedule is None:
        raise ValueError(f"prep_schedule={prep_schedule!r} must be one of {sorted(PREP_SCHEDULES)}")
    lib = library(plan)
    cp = None if warmup is None else warmup_tables.tables_for(warmup, plan, v.device, warmup_eps, segment_lengths)
    segments = 0 if cp is None else warmup_tables.call_segments(cp, T, N, warmup_tables.segment_state_bytes(Hv, K, V),
                                                                 longest_tokens)
    if segments == 0:
        cp = None  # one exact chain per sequence
    workspace = torch.empty(lib.workspace_bytes(T, N, segments), dtype=torch.uint8, device=v.device)
    args = abi.FqtGdnFwdArgs(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), g=g.data_ptr(), beta=beta.data_ptr(),
        cu_seqlens=cu_seqlens.data_ptr(), initial_state=None if h0 is None else h0.data_ptr(),
        final_state=final.data_ptr() if output_final_state else None, o=o.data_ptr(),
        workspace=workspace.data_ptr(), total_tokens=T, num_seqs=N, scale=float(scale),
        use_qk_l2norm=int(bool(use_qk_l2norm)), prep_schedule=schedule,
        warmup=None if cp is None else cp.warmup.data_ptr(),
        segment_chunks=None if cp is None else cp.segment_chunks.data_ptr(), max_segments=segments,
        log_eps=0.0 if cp is None else cp.log_eps, exact_heads=0 if cp is None else cp.exact_heads,
        a_log=None if a_log is None else a_log.data_ptr(), dt_bias=None if dt_bias is None else dt_bias.data_ptr())
    lib.launch(args, current_stream_handle(v.device))
    return o, final


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype and contiguous, without a conversion call when it already is (eager host time)."""
    return t.contiguous() if t.dtype == dtype else t.to(dtype).contiguous()


def current_stream_handle(device) -> int:
    """torch's current CUDA stream on device, as the cudaStream_t the library launches on. The raw
    getter skips building a torch.cuda.Stream object, a visible share of an eager call's host time."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream
