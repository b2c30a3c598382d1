"""flashqla_tune.ops.chunk_gated_delta_rule: the GDN forward on the Hopper kernels.

FLA's argument names and positional order (options it cannot honour are refused by name:
check_options). Every check here runs on the host without synchronising
the GPU; cu_seqlens values are checked only when cu_seqlens_cpu is given (the kernels clamp
offsets, so they never go out of bounds whatever cu_seqlens holds). A cu_seqlens_cpu that
disagrees with cu_seqlens is not detected (that would synchronise): the kernels read cu_seqlens,
and the host copy only decides whether the context-parallel kernels may be skipped, so a wrong
copy costs speed, never results or memory safety. The call is a
torch.library custom op with a fake implementation, so torch.compile traces through it, and
its forward is CUDA-graph capturable. The op is differentiable w.r.t. q, k, v, g, beta and
initial_state, with gradients for o and the final state (backward.autograd; double backward
raises); a call that autograd records takes the custom op, which saves the inputs for it. FLA's
in-kernel gate and beta options (use_gate_in_kernel with A_log and dt_bias,
use_beta_sigmoid_in_kernel, allow_neg_eigval) run in the prep kernel through a custom op of their
own, gdn_fwd_gated, forward only: a call with them that needs a gradient computes them in PyTorch
first (gates_in_torch) and takes gdn_fwd, so autograd differentiates them.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from . import host_path, runtime, warmup_tables
from .backward import autograd as gdn_autograd
from .plan import KernelPlan
from .segment_policy import MAX_SEQUENCES, MAX_TOKENS
from .spec import GDNSpec
from .supported_shapes import CHUNK_SIZE, SUPPORTED, head_dims_problem, heads_problem

# The supported-shape table's dtypes (supported_shapes.py) as torch dtypes
SUPPORTED_QKV_DTYPES = tuple(getattr(torch, name) for name in SUPPORTED.qkv_dtypes)
SUPPORTED_GATE_DTYPES = tuple(getattr(torch, name) for name in SUPPORTED.gate_dtypes)


class UnsupportedError(ValueError):
    """The call asks for something the compiled kernels do not implement."""


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first):
    """Host-side checks of a call (no GPU synchronisation); returns (B, T, Hqk, Hv, N)."""
    sizes = check_shapes_and_types(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first)
    device = q.device
    if device.type != "cuda":
        raise ValueError(f"inputs must be on a CUDA device, got {device}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("cu_seqlens", cu_seqlens)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")
    return sizes


def check_shapes_and_types(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first):
    """Everything check_inputs checks except where the tensors live (the FLA verifier reuses it)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B,T,H,D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q shape {tuple(q.shape)} != k shape {tuple(k.shape)}")
    B, T, Hqk, K = q.shape
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v shape {tuple(v.shape)} does not match q's [B,T]=({B},{T})")
    Hv, V = v.shape[2], v.shape[3]
    if problem := heads_problem(Hqk, Hv):
        raise ValueError(problem)
    if problem := head_dims_problem(K, V):
        raise UnsupportedError(problem)
    if q.dtype not in SUPPORTED_QKV_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UnsupportedError(f"q, k, v must share one dtype of {'/'.join(SUPPORTED.qkv_dtypes)}; got {q.dtype}, "
                               f"{k.dtype}, {v.dtype}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, Hv):
            raise ValueError(f"{name} shape {tuple(t.shape)}, expected [B,T,Hv]=({B},{T},{Hv}) "
                             f"(per-key-channel gates come with the porting work)")
        if t.dtype not in SUPPORTED_GATE_DTYPES:
            raise UnsupportedError(f"{name} dtype {t.dtype} is not supported ({' or '.join(SUPPORTED.gate_dtypes)}; "
                                   f"the op upcasts them to float32)")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"varlen (cu_seqlens given) needs batch size 1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor of N+1 >= 2 offsets, got "
                             f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        if cu_seqlens_cpu is not None:
            _check_offsets(cu_seqlens_cpu, cu_seqlens.numel(), T)
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu given without cu_seqlens")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if N > MAX_SEQUENCES:
        raise UnsupportedError(f"{N} sequences in one call; the kernels take at most {MAX_SEQUENCES}")
    if B * T > MAX_TOKENS:
        raise UnsupportedError(f"{B * T} tokens in one call; the kernels take at most {MAX_TOKENS}")
    if initial_state is not None:
        want = (N, Hv, V, K) if state_v_first else (N, Hv, K, V)
        if tuple(initial_state.shape) != want:
            layout = "[N,Hv,V,K] (state_v_first)" if state_v_first else "[N,Hv,K,V]"
            raise ValueError(f"initial_state shape {tuple(initial_state.shape)}, expected {layout} = {want}")
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must be floating point, got {initial_state.dtype}")
    return B, T, Hqk, Hv, N


def _check_offsets(cu_cpu, expected_len, total_tokens):
    """cu_seqlens_cpu's offsets: integers (an integer tensor, or a list of ints), 0 first, non-decreasing,
    ending at or before T. Rows past the last offset belong to no sequence (the op leaves them unwritten)."""
    if isinstance(cu_cpu, torch.Tensor):
        if cu_cpu.is_floating_point() or cu_cpu.is_complex() or cu_cpu.dtype == torch.bool:
            raise ValueError(f"cu_seqlens_cpu must hold integer offsets, got a {cu_cpu.dtype} tensor")
        values = cu_cpu.tolist()
    else:
        values = list(cu_cpu)
        for i, x in enumerate(values):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise ValueError(f"cu_seqlens_cpu[{i}]={x!r} is not an integer offset")
    if len(values) != expected_len:
        raise ValueError(f"cu_seqlens_cpu has {len(values)} entries but cu_seqlens has {expected_len}")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(f"cu_seqlens must be non-decreasing: cu_seqlens[{i}]={values[i]} < "
                             f"cu_seqlens[{i - 1}]={values[i - 1]}")
    if values[-1] > total_tokens:
        raise ValueError(f"cu_seqlens ends at {values[-1]} but the inputs hold only T={total_tokens} tokens")


# FLA's keyword options the op takes, with the one value each can honour
FLA_KEYWORD_OPTIONS = {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None, "chunk_size": CHUNK_SIZE}

_KNOWN_ELSEWHERE = {
    "transpose_state_layout": "FLA's deprecated name of state_v_first: pass state_v_first",
    "head_first": "FLA removed it: the layout is always [B,T,H,D]",
}


def check_options(use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, chunk_indices=None, cp_context=None,
                  kwargs=None, extra_known: dict[str, str] | None = None) -> None:
    """Refuse, by name and value, an FLA option the kernels cannot honour (no GPU work, no sync).
    kwargs holds the call's keyword options beyond the signature; extra_known maps a keyword a
    caller of this op might pass to why it is refused there (a pack's op refuses warmup so).
    FLA's in-kernel gate and beta options (use_gate_in_kernel with A_log and dt_bias,
    use_beta_sigmoid_in_kernel, allow_neg_eigval) are honoured; only their inconsistent uses are
    refused."""
    kwargs = kwargs or {}
    use_gate_in_kernel = kwargs.get("use_gate_in_kernel", False)
    for name, flag in (("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel), ("allow_neg_eigval", allow_neg_eigval)):
        if type(flag) is not bool:  # e.g. a call in another order: its state_v_first or cu_seqlens landed here
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}; the positional order is FLA's: "
                            f"(..., use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, "
                            f"state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_indices, cp_context)")
    if type(use_gate_in_kernel) is not bool:
        raise TypeError(f"use_gate_in_kernel must be a bool, got {type(use_gate_in_kernel).__name__} "
                        f"{use_gate_in_kernel!r}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise UnsupportedError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in FLA: it "
                               "makes the in-kernel beta 2 sigmoid(b)); with beta already computed, pass it scaled "
                               "and allow_neg_eigval=False")
    if cp_context is not None:
        raise UnsupportedError(f"cp_context={type(cp_context).__name__} is not supported: the kernels run "
                               f"no inter-GPU context parallelism (pass cp_context=None)")
    if use_gate_in_kernel:
        if kwargs.get("A_log") is None:
            raise ValueError("use_gate_in_kernel=True needs A_log (the [Hv] decay parameter of "
                             "g = -exp(A_log) * softplus(g + dt_bias)); got A_log=None")
    else:
        for name in ("A_log", "dt_bias"):
            if kwargs.get(name) is not None:
                raise UnsupportedError(f"{name} (a {type(kwargs[name]).__name__}) was given with "
                                       f"use_gate_in_kernel=False, where it would be ignored: pass "
                                       f"use_gate_in_kernel=True to compute g from it, or {name}=None")
    if "chunk_size" in kwargs:
        size = kwargs["chunk_size"]
        if isinstance(size, bool) or not isinstance(size, int) or size != CHUNK_SIZE:
            raise UnsupportedError(f"chunk_size={size!r} is not supported: the kernels run {CHUNK_SIZE}-token "
                                   f"chunks (chunk_size={CHUNK_SIZE} only)")
    if chunk_indices is not None:
        if not isinstance(chunk_indices, torch.Tensor):
            raise TypeError(f"chunk_indices must be None or FLA's [NT,2] tensor of (sequence, chunk) rows, got "
                            f"{type(chunk_indices).__name__}")
        if chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
            raise ValueError(f"chunk_indices shape {tuple(chunk_indices.shape)}, expected FLA's [NT,2] "
                             f"(sequence, chunk) rows")
    unknown = [name for name in kwargs if name not in FLA_KEYWORD_OPTIONS]
    if unknown:
        why = {**_KNOWN_ELSEWHERE, **(extra_known or {})}
        name = unknown[0]
        reason = why.get(name, f"the keyword options beyond the signature are {', '.join(FLA_KEYWORD_OPTIONS)}")
        raise TypeError(f"chunk_gated_delta_rule() got an unexpected keyword argument {name!r} ({reason})")


def gate_options_of(use_beta_sigmoid_in_kernel, allow_neg_eigval, kwargs) -> tuple[bool, bool, bool]:
    """A checked call's (use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)."""
    return bool(kwargs.get("use_gate_in_kernel", False)), bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval)


GATE_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_gate_params(A_log, dt_bias, num_v_heads: int, device: torch.device | None) -> None:
    """A_log and dt_bias (dt_bias may be None) of an in-kernel gate: 1-D [Hv] float tensors, on the
    inputs' device (device None: not checked, as the FLA verifier's shape-only check does)."""
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is None and name == "dt_bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [Hv]=({num_v_heads},), got {type(t).__name__}")
        if tuple(t.shape) != (num_v_heads,):
            raise ValueError(f"{name} shape {tuple(t.shape)}, expected [Hv]=({num_v_heads},) (one value per v-head)")
        if t.dtype not in GATE_PARAM_DTYPES:
            raise UnsupportedError(f"{name} dtype {t.dtype} is not supported (float32, bfloat16 or float16; the "
                                   f"op upcasts it to float32)")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")


def gates_in_torch(g, beta, A_log, dt_bias, gate_options: tuple[bool, bool, bool]):
    """FLA's in-kernel gate and beta computed in PyTorch, fp32, the formulas the kernels apply
    (csrc/gdn_gate_options.cuh): g = -exp(A_log) * softplus(g + dt_bias) (softplus returns x above
    20, as FLA's and torch's), beta = sigmoid(b), times 2 with allow_neg_eigval. Autograd
    differentiates it, so calls that need a gradient run it before the custom op."""
    gate_in_kernel, beta_sigmoid, neg_eigval = gate_options
    if gate_in_kernel:
        x = g.float() if dt_bias is None else g.float() + dt_bias.float()
        g = -A_log.float().exp() * F.softplus(x)
    if beta_sigmoid:
        beta = torch.sigmoid(beta.float())
        if neg_eigval:
            beta = 2.0 * beta
    return g, beta


def check_scale(scale) -> None:
    """scale multiplies q k^T: None (K ** -0.5) or a finite real number."""
    if scale is None:
        return
    try:
        value = float(scale)
    except (TypeError, ValueError):
        value = None
    if isinstance(scale, (bool, str, bytes)) or value is None:
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(value):
        raise ValueError(f"scale={scale!r} must be a finite number")


def needs_grad(*tensors) -> bool:
    """True when autograd records this call: grad mode is on and an input requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_gpu(device):
    _check_gpu_index(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _check_gpu_index(index: int) -> None:
    """Per device, once: a GPU's architecture does not change while the process runs."""
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(index)
        raise UnsupportedError(f"{name} is sm_{major}{minor}; the kernels are built for sm_90a (H100/H200)")


NO_GATE_OPTIONS = (False, False, False)


def call_spec(q, v, state_v_first, gate_options: tuple[bool, bool, bool] = NO_GATE_OPTIONS) -> GDNSpec:
    """The kernel-shaping spec of a call (what picks the binary); gate_options: gate_options_of's."""
    return _spec(q.shape[2], v.shape[2], q.shape[3], v.shape[3], q.dtype == torch.bfloat16, bool(state_v_first),
                 *gate_options)


@functools.lru_cache(maxsize=None)
def _spec(hqk, hv, k, v, bf16, vk, gate_in_kernel=False, beta_sigmoid=False, neg_eigval=False) -> GDNSpec:
    return GDNSpec(num_qk_heads=hqk, num_v_heads=hv, head_k_dim=k, head_v_dim=v,
                   qkv_dtype="bfloat16" if bf16 else "float16", state_layout="vk" if vk else "kv",
                   gate_in_kernel=bool(gate_in_kernel), beta_sigmoid_in_kernel=bool(beta_sigmoid),
                   allow_neg_eigval=bool(neg_eigval))


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, *, warmup=None, warmup_eps=warmup_tables.DEFAULT_EPS, **kwargs):
    """Returns (o [B,T,Hv,V] in q's dtype, final_state fp32 [N,Hv,K,V] / [N,Hv,V,K] or None).

    FLA's chunk_gated_delta_rule arguments, names and positional order. FLA's keyword options
    arrive through kwargs: chunk_size=64 (the kernels' chunk length; any other value is refused),
    use_gate_in_kernel, A_log, dt_bias. FLA's in-kernel options, computed in the prep kernel (and
    the CP guard) in fp32 from the raw inputs (csrc/gdn_gate_options.cuh):
    use_gate_in_kernel=True with A_log [Hv] (and optionally dt_bias [Hv]) takes g raw and uses
    g = -exp(A_log) * softplus(g + dt_bias); use_beta_sigmoid_in_kernel=True takes beta raw and
    uses sigmoid(beta); allow_neg_eigval=True (only with the sigmoid, as in FLA) uses
    2 sigmoid(beta). Calls that need a gradient compute the same formulas in PyTorch before the
    custom op (gates_in_torch), so autograd reaches A_log, dt_bias and the raw g and beta. Refused
    by name before any GPU work (check_options): A_log or dt_bias without use_gate_in_kernel,
    a cp_context (no inter-GPU context parallelism), and any other keyword (a TypeError).
    chunk_indices is FLA's [NT,2] table of (sequence, chunk) rows, derived from cu_seqlens and the
    chunk size; the kernels derive the same chunks from cu_seqlens on the device, so it is checked
    for form and not read.

    warmup (keyword only): per v-head warm-up windows in chunks (a CPU int tensor or a list; -1
    chains that head exactly), usually a calibration's table. With it, long sequences are cut into
    segments that run in parallel (context parallelism); a segment of a warm-up head starts from the
    state of its window run from zero, which is used only where the input's gates decay below
    warmup_eps over the window (and 0 <= beta ||k||^2 <= 2, checked per token on the beta the chunks
    use, so allow_neg_eigval's beta in (0, 2) without a unit-norm k chains exactly where the bound
    fails); everywhere else the state is chained
    exactly. Without it, every head gets the default window (warmup_tables.DEFAULT_WINDOW_CHUNKS),
    still guarded; all -1 is exact chaining. Whether and where a sequence is cut depends only on its
    own length (the cost model's table), so short sequences and many-head calls run as one chain each.

    Differentiable w.r.t. q, k, v, g, beta and initial_state, given the gradients of o and of the final
    state (GVA: dq and dk sum over each q/k head's v-heads; use_qk_l2norm_in_kernel is differentiated
    through the normalisation). The backward recomputes the chunk states from the saved inputs
    (backward.autograd); double backward raises.

    With cu_seqlens, rows of o past cu_seqlens[-1] belong to no sequence and are left unwritten.
    scale must be finite, and cu_seqlens_cpu (when given) integer offsets. At K = V the two state
    layouts have the same shape, so state_v_first cannot be checked against initial_state there:
    the flag is taken as given.

    Eager calls go through the C++ host path (host_path) once a call of the same signature has run
    here and the extension is loaded (it builds in the background); it launches the same library
    with the same arguments."""
    gate_options = NO_GATE_OPTIONS
    if (kwargs or use_beta_sigmoid_in_kernel is not False or allow_neg_eigval is not False
            or chunk_indices is not None or cp_context is not None):
        check_options(use_beta_sigmoid_in_kernel, allow_neg_eigval, chunk_indices, cp_context, kwargs)
        gate_options = gate_options_of(use_beta_sigmoid_in_kernel, allow_neg_eigval, kwargs)
    check_scale(scale)
    if gate_options != NO_GATE_OPTIONS:
        return _call_with_gate_options(q, k, v, g, beta, scale, initial_state, output_final_state,
                                       use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, cu_seqlens_cpu, warmup,
                                       warmup_eps, gate_options, kwargs.get("A_log"), kwargs.get("dt_bias"))
    key = host_key(q, v, state_v_first, warmup, warmup_eps, "")
    fast = host_path.forward(key, q, k, v, g, beta, scale, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu)
    if fast is not None:
        return fast
    Hv = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first)[3]
    table = warmup_tables.default_table(Hv) if warmup is None else warmup_tables.normalise(warmup, Hv)
    bound = BoundCall(call_spec(q, v, state_v_first), "", table, warmup_eps)
    return bound(key, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 cu_seqlens, cu_seqlens_cpu)


def _call_with_gate_options(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                            state_v_first, cu_seqlens, cu_seqlens_cpu, warmup, warmup_eps, gate_options, A_log,
                            dt_bias):
    """The op with FLA's in-kernel gate or beta options (checked by check_options). On the Python host
    path only (the C++ one takes no gate parameters). A call that autograd records computes g and
    beta in PyTorch (gates_in_torch) and runs the precomputed-gate kernels, so the custom op's
    backward sees the gates it differentiates and autograd carries on to A_log, dt_bias and the raw
    inputs; any other runs the plan built with the options, which computes them in the kernel."""
    Hv = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first)[3]
    if gate_options[0]:
        check_gate_params(A_log, dt_bias, Hv, q.device)
    table = warmup_tables.default_table(Hv) if warmup is None else warmup_tables.normalise(warmup, Hv)
    longest = longest_sequence_tokens(q.shape[1], cu_seqlens, cu_seqlens_cpu)
    if needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        g, beta = gates_in_torch(g, beta, A_log, dt_bias, gate_options)
        return run_checked(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           bool(state_v_first), cu_seqlens, plan_name="", warmup=list(table), warmup_eps=warmup_eps,
                           longest_tokens=longest,
                           sequence_tokens=uniform_sequence_tokens(q.shape[1], cu_seqlens, cu_seqlens_cpu))
    return run_checked(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       bool(state_v_first), cu_seqlens, plan_name="", warmup=list(table), warmup_eps=warmup_eps,
                       longest_tokens=longest, gate_options=gate_options, A_log=A_log, dt_bias=dt_bias)


def host_key(q, v, state_v_first, warmup, warmup_eps, plan_name: str):
    """The C++ host path's key for an eager call, or None where only the Python path runs (tracing,
    fake or subclassed tensors, tensors off the GPU, the path switched off)."""
    if type(q) is not torch.Tensor or type(v) is not torch.Tensor or not q.is_cuda or q.dim() != 4 or v.dim() != 4:
        return None
    if torch.compiler.is_compiling() or not host_path.enabled():
        return None
    return host_path.signature(q, v, state_v_first, warmup, warmup_eps, plan_name)


@dataclass
class BoundCall:
    """A call bound to its kernels: what a call signature settles before its tensors are looked at.
    A plain dataclass: the op builds one while torch.compile traces it, and dynamo (torch 2.11)
    cannot trace the object.__setattr__ of a frozen dataclass's __init__.
    The op's two entry points check their arguments, build one and call it (this module's
    chunk_gated_delta_rule from its `warmup` argument, a pack's from its calibration: packed_ops).
    The plan and the CP segment table are found by name in runtime's registry, so the custom op's
    implementation, which a traced graph can only hand tensors, scalars, strings and int lists,
    rebuilds the same binding from the same plan name, table and eps."""
    spec: GDNSpec                    # the call's heads, head dims, dtype and state layout
    plan_name: str                   # "" for the spec's default plan, else the name a pack registered
    warmup: tuple[int, ...] | None   # checked (warmup_tables.normalise); None: one exact chain per sequence
    warmup_eps: float                # the guard's bound

    @property
    def plan(self) -> KernelPlan:
        """The kernels that run the call (runtime caches both lookups)."""
        return runtime.plan_by_name(self.plan_name) if self.plan_name else runtime.default_plan_for(self.spec)

    @property
    def segment_lengths(self) -> tuple[int, ...] | None:
        """A pack's CP segment table; None: the cost model's for the warm-up table."""
        return runtime.segment_lengths_for(self.plan_name) if self.plan_name else None

    def __call__(self, key, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 cu_seqlens, cu_seqlens_cpu):
        """The op after check_inputs, on the Python path; afterwards the C++ host path may take the
        signature's later calls (key: host_key's answer)."""
        result = run_checked(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             self.spec.state_layout == "vk", cu_seqlens, plan_name=self.plan_name,
                             warmup=None if self.warmup is None else list(self.warmup), warmup_eps=self.warmup_eps,
                             longest_tokens=longest_sequence_tokens(q.shape[1], cu_seqlens, cu_seqlens_cpu),
                             sequence_tokens=uniform_sequence_tokens(q.shape[1], cu_seqlens, cu_seqlens_cpu))
        self.remember_host_context(key, q.device)
        return result

    def forward(self, q, k, v, g, beta, cu_seqlens, initial_state, scale, output_final_state, use_qk_l2norm,
                longest_tokens: int = 0, a_log=None, dt_bias=None):
        """Packed inputs (run_checked's) -> (o, final_state) through runtime.forward (a_log, dt_bias: an
        in-kernel gate's parameters, for a spec with gate_in_kernel)."""
        return runtime.forward(self.plan, q, k, v, g, beta, cu_seqlens, initial_state, scale, output_final_state,
                               use_qk_l2norm, warmup=self.warmup, warmup_eps=self.warmup_eps,
                               segment_lengths=self.segment_lengths, longest_tokens=longest_tokens,
                               a_log=a_log, dt_bias=dt_bias)

    def remember_host_context(self, key, device: torch.device) -> None:
        """After a call succeeded on the Python path: let the next call of its signature take the C++
        path (the plan, library and tables are the ones this call used, all cached by now)."""
        if key is None or self.warmup is None or host_path.known(key):
            return
        plan = self.plan
        tables = warmup_tables.tables_for(self.warmup, plan, device, self.warmup_eps, self.segment_lengths)
        host_path.remember(key, plan, runtime.library(plan), tables, device,
                           may_build=not self.plan_name)  # a pack's call never compiles


def longest_sequence_tokens(T: int, cu_seqlens, cu_seqlens_cpu) -> int:
    """The longest sequence of a call as the host knows it without a device sync: T for batch
    rows, the largest offset step of cu_seqlens_cpu, else 0 (unknown). It only lets a call whose
    sequences are all too short to split skip the CP kernels (warmup_tables.call_segments); a split
    call's workspace is still sized from T, so a cu_seqlens_cpu that disagrees with cu_seqlens
    costs speed, never memory safety."""
    if cu_seqlens is None:
        return T
    if cu_seqlens_cpu is None:
        return 0
    values = cu_seqlens_cpu.tolist() if isinstance(cu_seqlens_cpu, torch.Tensor) else list(cu_seqlens_cpu)
    return max(int(b) - int(a) for a, b in zip(values, values[1:]))


def uniform_sequence_tokens(T: int, cu_seqlens, cu_seqlens_cpu) -> int:
    """The one length every sequence of a call has, as the host knows it without a device sync,
    where it is a positive multiple of 64 and the sequences fill all T token rows: T for batch rows,
    else cu_seqlens_cpu's where its steps are all equal and it ends at T; 0 otherwise or unknown.
    The backward then takes an identity chunk grid (backward.chunked_torch.uniform_chunk_grid)."""
    if cu_seqlens is None:
        return T if T > 0 and T % CHUNK_SIZE == 0 else 0
    if cu_seqlens_cpu is None:
        return 0
    values = [int(x) for x in (cu_seqlens_cpu.tolist() if isinstance(cu_seqlens_cpu, torch.Tensor)
                               else cu_seqlens_cpu)]
    steps = {b - a for a, b in zip(values, values[1:])}
    if len(steps) != 1 or values[0] != 0 or values[-1] != T:
        return 0
    length = steps.pop()
    return length if length > 0 and length % CHUNK_SIZE == 0 else 0


def run_checked(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens, plan_name: str, warmup: list[int] | None = None,
                warmup_eps: float = warmup_tables.DEFAULT_EPS, longest_tokens: int = 0,
                gate_options: tuple[bool, bool, bool] = NO_GATE_OPTIONS, A_log=None, dt_bias=None,
                sequence_tokens: int = 0):
    """The op after check_inputs: pack the batch as varlen and call the custom op. plan_name ""
    runs the default plan for the call's heads; otherwise a plan registered by a kernel pack.
    warmup is a checked table (warmup_tables.normalise) or None; longest_tokens is
    longest_sequence_tokens' answer (0: unknown), sequence_tokens uniform_sequence_tokens' (for the
    backward; 0: not known). gate_options other than NO_GATE_OPTIONS run the
    default plan built with FLA's in-kernel options (gdn_fwd_gated, which has no backward: such a
    call must not need a gradient; _call_with_gate_options sees to it), with A_log and dt_bias."""
    B, T, Hqk = q.shape[:3]
    Hv = v.shape[2]
    check_scale(scale)
    check_gpu(q.device)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is None:
        # Batch rows are independent sequences of length T: pack them as varlen on the device.
        cu = torch.arange(0, (B + 1) * T, T, device=q.device, dtype=torch.int64)
    else:
        cu = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)
    if B != 1:  # pack the batch rows as one varlen row (views; B = 1 is packed already)
        q, k, v = q.reshape(1, B * T, Hqk, -1), k.reshape(1, B * T, Hqk, -1), v.reshape(1, B * T, Hv, -1)
        g, beta = g.reshape(1, B * T, Hv), beta.reshape(1, B * T, Hv)
    args = (q, k, v, g, beta, cu, initial_state, float(scale), bool(output_final_state),
            bool(use_qk_l2norm_in_kernel), bool(state_v_first), plan_name, warmup, float(warmup_eps),
            int(longest_tokens))
    differentiable = needs_grad(q, k, v, g, beta, initial_state)
    if gate_options != NO_GATE_OPTIONS:
        if differentiable or needs_grad(A_log, dt_bias):
            raise RuntimeError("a call with in-kernel gate or beta options that needs a gradient must compute them "
                               "in PyTorch first (ops.gates_in_torch); the kernels that apply them have no backward")
        if plan_name:
            raise UnsupportedError(f"plan {plan_name} (a pack's) is built without in-kernel gate or beta options")
        gated = (*args[:7], A_log, dt_bias, *args[7:], *gate_options)
        o, final = (torch.ops.flashqla_tune.gdn_fwd_gated if needs_custom_op(q) else gdn_fwd_gated_impl)(*gated)
        return (o if B == 1 else o.reshape(B, T, Hv, -1)), (final if output_final_state else None)
    o, final = (torch.ops.flashqla_tune.gdn_fwd if differentiable or needs_custom_op(q) else gdn_fwd_impl)(
        *args, int(sequence_tokens))
    return (o if B == 1 else o.reshape(B, T, Hv, -1)), (final if output_final_state else None)


def needs_custom_op(q: torch.Tensor) -> bool:
    """True while torch.compile / export trace or under fake tensors: they need the registered op and
    its fake implementation. Eager calls that autograd does not record skip the custom op's dispatch
    (its autograd wrapper and dynamo-disable context cost tens of microseconds per call) and run the
    same implementation directly; calls that need a gradient always take the op (run_checked)."""
    # A plain torch.Tensor is never fake: skip is_fake on the common eager path.
    return torch.compiler.is_compiling() or (type(q) is not torch.Tensor and is_fake(q))


def gdn_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None, scale: float,
                 output_final_state: bool, use_qk_l2norm: bool, state_v_first: bool,
                 plan_name: str, warmup: list[int] | None, warmup_eps: float,
                 longest_tokens: int, sequence_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The binding is rebuilt here, not passed from the Python wrapper, so torch.compile only sees
    # tensors, scalars, a string and a list of ints. sequence_tokens is for the backward alone
    # (setup_context keeps it).
    bound = BoundCall(call_spec(q, v, state_v_first), plan_name, None if warmup is None else tuple(warmup), warmup_eps)
    return bound.forward(q, k, v, g, beta, cu_seqlens, initial_state, scale, output_final_state, use_qk_l2norm,
                         longest_tokens)


_gdn_fwd_op = torch.library.custom_op("flashqla_tune::gdn_fwd", mutates_args=())(gdn_fwd_impl)


@_gdn_fwd_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, scale, output_final_state, use_qk_l2norm, state_v_first,
      plan_name, warmup, warmup_eps, longest_tokens, sequence_tokens):
    N = cu_seqlens.shape[0] - 1
    Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
    o = q.new_empty(v.shape)
    shape = (N, Hv, V, K) if state_v_first else (N, Hv, K, V)
    final = q.new_empty(shape if output_final_state else (0,), dtype=torch.float32)
    return o, final


# Differentiable: the forward saves its inputs, the backward recomputes the chunk states
# (backward.autograd); double backward raises.
_gdn_fwd_op.register_autograd(gdn_autograd.backward, setup_context=gdn_autograd.setup_context)


def gdn_fwd_gated_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None, a_log: torch.Tensor | None,
                       dt_bias: torch.Tensor | None, scale: float, output_final_state: bool, use_qk_l2norm: bool,
                       state_v_first: bool, plan_name: str, warmup: list[int] | None, warmup_eps: float,
                       longest_tokens: int, gate_in_kernel: bool, beta_sigmoid_in_kernel: bool,
                       allow_neg_eigval: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gdn_fwd_impl with FLA's in-kernel gate and beta options: g and beta raw, the default plan built
    with the options. Forward only (no autograd is registered: a call that needs a gradient computes
    the gates in PyTorch and takes gdn_fwd)."""
    options = (bool(gate_in_kernel), bool(beta_sigmoid_in_kernel), bool(allow_neg_eigval))
    bound = BoundCall(call_spec(q, v, state_v_first, options), plan_name,
                      None if warmup is None else tuple(warmup), warmup_eps)
    return bound.forward(q, k, v, g, beta, cu_seqlens, initial_state, scale, output_final_state, use_qk_l2norm,
                         longest_tokens, a_log=a_log, dt_bias=dt_bias)


_gdn_fwd_gated_op = torch.library.custom_op("flashqla_tune::gdn_fwd_gated", mutates_args=())(gdn_fwd_gated_impl)


@_gdn_fwd_gated_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, a_log, dt_bias, scale, output_final_state, use_qk_l2norm,
      state_v_first, plan_name, warmup, warmup_eps, longest_tokens, gate_in_kernel, beta_sigmoid_in_kernel,
      allow_neg_eigval):
    N = cu_seqlens.shape[0] - 1
    Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
    shape = (N, Hv, V, K) if state_v_first else (N, Hv, K, V)
    return q.new_empty(v.shape), q.new_empty(shape if output_final_state else (0,), dtype=torch.float32)
