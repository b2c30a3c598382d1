"""Implementations the scoreboard (and the tuner, for its FLA and FlashQLA anchors) can time, each
wrapped to the op's signature:
fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
   use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None)
-> (o, final_state). Loaders import lazily; an implementation whose package is missing is
skipped with the reason, never a failure of the whole run."""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .torch_chunked import chunk_gated_delta_rule_torch


@dataclass(frozen=True)
class Impl:
    name: str
    fn: Callable
    cu_dtype: torch.dtype  # which cu_seqlens tensor the library wants (ours: int64, what its kernels read;
                           # given int32, our op converts it on the device in every call)
    version: str | None = None
    note: str = ""
    # A peer whose conventions differ from the op's (gate domain, state layout): prepare maps a
    # protocol input set (and the cu_seqlens call picked) to the library's form once per set,
    # run_prepared times only the library's call on it (see call). fn stays the op-signature
    # wrapper that converts in every call.
    prepare: Callable | None = None
    run_prepared: Callable | None = None


def _load_torch():
    return Impl("torch", chunk_gated_delta_rule_torch, torch.int64, torch.__version__,
                "chunked algorithm in fp32 PyTorch (batched over chunks; sequential state loop)")


def _load_fla():
    # Read at FLA's import: without it FLA dispatches to FlashQLA and its column is FlashQLA.
    if "fla" not in sys.modules:
        os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    import fla
    from fla import backends
    if not getattr(backends, "_DISPATCH_DISABLED", False):
        raise ImportError("fla was imported before FLA_DISABLE_BACKEND_DISPATCH=1 was set; its column "
                          "would time FlashQLA")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return Impl("fla", chunk_gated_delta_rule, torch.int64, getattr(fla, "__version__", None),
                "Triton kernels, backend dispatch disabled")


def _load_flashqla():
    import flash_qla

    def fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None):
        # FlashQLA has no cu_seqlens_cpu; its metadata caches are keyed by cu_seqlens' identity.
        return flash_qla.chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens, state_v_first=state_v_first)
    return Impl("flashqla", fn, torch.int64, getattr(flash_qla, "__version__", None),
                "TileLang kernels, auto CP on, high-level API")


def _ours():
    from flashqla_tune import host_path
    from flashqla_tune.ops import chunk_gated_delta_rule
    import flashqla_tune
    if torch.cuda.is_available():
        try:  # eager timings take the C++ host path from a row's second call, not after a background build
            host_path.extension()
        except host_path.HostPathError as exc:
            warnings.warn(f"{exc}: our eager timings are the Python host path's", RuntimeWarning, stacklevel=2)
    return chunk_gated_delta_rule, getattr(flashqla_tune, "__version__", None)


def _load_flashqla_tune():
    fn, version = _ours()
    return Impl("flashqla_tune", fn, torch.int64, version,
                "our op, default plan, default guarded warm-up window (context parallel where the cost model splits)")


def _load_flashqla_tune_single_chain():
    from flashqla_tune import ops
    _, version = _ours()

    def fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None):
        ops.check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first)
        return ops.run_checked(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                               state_v_first, cu_seqlens, plan_name="", warmup=None)
    return Impl("flashqla_tune_single_chain", fn, torch.int64, version,
                "our kernels without context parallelism: one exact chain per sequence")


def _with_warmup(name: str, table_of: Callable[[int], tuple[int, ...]], note: str) -> Impl:
    ours, version = _ours()

    def fn(q, k, v, g, beta, **kw):
        return ours(q, k, v, g, beta, warmup=table_of(v.shape[2]), **kw)
    return Impl(name, fn, torch.int64, version, note)


def _load_flashqla_tune_warmup():
    from .inputs import protocol_warmup_table
    return _with_warmup("flashqla_tune_warmup", protocol_warmup_table,
                        "our op, context parallel, warm-up from a calibration of the protocol's gates")


def _load_flashqla_tune_exact_cp():
    return _with_warmup("flashqla_tune_exact_cp", lambda hv: (-1,) * hv,
                        "our op, context parallel, every boundary chained exactly (warmup all -1)")


def _peer(name: str, loaded, cu_dtype: torch.dtype, linear_gate: bool, note: str) -> Impl:
    from . import peer_flashinfer

    fn, native, version = loaded

    def prepare(x, cu):
        return peer_flashinfer.prepare(x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, cu_seqlens=cu,
                                       linear_gate=linear_gate)
    return Impl(name, fn, cu_dtype, version, note, prepare=prepare, run_prepared=native)


def _load_flashinfer():
    from . import peer_flashinfer
    return _peer("flashinfer", peer_flashinfer.load_flashinfer(), torch.int32, True,
                 "flashinfer.gdn_prefill.chunk_gated_delta_rule as vLLM calls it (backend auto, use_cp auto: "
                 "CuTe-DSL SM90 kernels); exp(g) and the [N,H,V,K] h0 made once per input set outside the "
                 "timed call, the state returned as a transposed view")


def _load_cudnn():
    from . import peer_flashinfer
    return _peer("cudnn", peer_flashinfer.load_cudnn(), torch.int32, False,
                 "cudnn.linear_attention.gated_delta_net (log-domain g); the [N,H,V,K] h0 made once per "
                 "input set outside the timed call, the state returned as a transposed view")


# Order = column order in the report.
LOADERS: dict[str, Callable[[], Impl]] = {
    "fla": _load_fla,
    "flashqla": _load_flashqla,
    "flashinfer": _load_flashinfer,
    "cudnn": _load_cudnn,
    "torch": _load_torch,
    "flashqla_tune": _load_flashqla_tune,
    "flashqla_tune_single_chain": _load_flashqla_tune_single_chain,
    "flashqla_tune_warmup": _load_flashqla_tune_warmup,
    "flashqla_tune_exact_cp": _load_flashqla_tune_exact_cp,
}


def load_impls(names=None) -> tuple[list[Impl], dict[str, str]]:
    """(loaded implementations, {name: why skipped}) for the names asked (all by default)."""
    names = list(names) if names else list(LOADERS)
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; known: {list(LOADERS)}")
    loaded, skipped = [], {}
    for name in names:
        try:
            loaded.append(LOADERS[name]())
        except Exception as exc:  # any import-time failure (no GPU, missing package) is a skip
            skipped[name] = f"{type(exc).__name__}: {exc}"
    return loaded, skipped


def call(impl: Impl, x, output_final_state: bool = True):
    """Run impl on a CaseInputs set with the protocol's arguments. A peer with prepare gets the
    set in its own form, made at the set's first call (a warm-up, never a timed one) and kept in
    x.extra, so the timed call is the library's alone."""
    cu = x.cu_seqlens if impl.cu_dtype == torch.int32 else x.cu_seqlens_long
    if impl.prepare is not None:
        key = f"prepared:{impl.name}"
        if key not in x.extra:
            x.extra[key] = impl.prepare(x, cu)
        return impl.run_prepared(x.extra[key], output_final_state)
    return impl.fn(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu, cu_seqlens_cpu=x.cu_seqlens_cpu)
