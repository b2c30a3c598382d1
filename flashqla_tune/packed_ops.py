"""Run-time import of a kernel pack: `ops = flashqla_tune.load(PACK, tp_rank=0, tp_size=1)`.

Loading reads the manifest, checks that the pack fits this GPU, checks the binaries' hashes
and opens them with ctypes: nothing is compiled. A pack is code: opening a library runs its
constructors. The hashes sit in the pack's own manifest, so they catch a damaged copy, not files
replaced together with it; `load(PACK, trusted_keys=[...])` checks an Ed25519 signature (pack_signing) over the
manifest and every binary before anything is opened, and refuses an unsigned or wrongly signed pack.

`ops.chunk_gated_delta_rule(..., layer=i)` takes the op's arguments (flashqla_tune.ops, FLA's
names and order), picks the pack's plan for the call's head configuration and layer i's
calibration row (i counts the model's GDN layers from 0; layer=None takes the model-wide table:
per head the largest n_h over the layers, -1 when any layer chains that head exactly).

Warm-up context parallelism: the warm-up tables are sliced per rank, checked against the call's
heads and passed to the kernels as the op's `warmup` (with the calibration's eps), so long
sequences run as parallel segments; the kernels' guard chains exactly wherever the input does
not decay as the calibration predicted.

Tensor parallelism: rank r of tp_size holds q/k heads [r*Hqk/tp, (r+1)*Hqk/tp) and v-heads
[r*Hv/tp, (r+1)*Hv/tp), and the same slice of every calibration row.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import warnings
from pathlib import Path

import torch

from . import environment, host_path, loader, ops, runtime, warmup_tables
from .pack import (CALIBRATION, MANIFEST, NATIVE, Manifest, PackError, PackPlan, check_binaries, check_calibration,
                   parse_manifest, read_manifest)
from .plan import KernelPlan, kernel_spec

logger = logging.getLogger("flashqla_tune")

_AUTO = object()
_PACK_KEYWORDS = {name: "a pack's calls take the warm-up table and eps from its calibration: pass layer="
                  for name in ("warmup", "warmup_eps")}


def check_target(manifest: Manifest, gpu, pack) -> None:
    """Refuse a pack this GPU cannot run or was not tuned on; warn on a driver change."""
    if manifest.tuned:
        want = f"{manifest.gpu['name']} ({manifest.gpu['arch']})"
        if gpu is None:
            raise PackError(f"pack {pack} is tuned for {want}; this machine has no CUDA GPU")
        if gpu.name != manifest.gpu["name"] or gpu.arch != manifest.gpu["arch"]:
            raise PackError(f"pack {pack} is tuned for {want}, but this GPU is {gpu.name} ({gpu.arch}); "
                            f"rebuild the pack here (flashqla-tune build) or use an untuned one")
        if manifest.gpu.get("driver") and gpu.driver and gpu.driver != manifest.gpu["driver"]:
            warnings.warn(f"pack {pack} was tuned under driver {manifest.gpu['driver']}, this machine runs "
                          f"{gpu.driver}; timings may differ (results do not)", RuntimeWarning, stacklevel=3)
    elif gpu is not None and gpu.capability != (9, 0):
        raise PackError(f"pack {pack} is {manifest.target} and needs an sm_90 GPU; this GPU is "
                        f"{gpu.name} ({gpu.arch})")


def _describe(spec) -> str:
    return f"Hqk={spec.num_qk_heads}/Hv={spec.num_v_heads} K={spec.head_k_dim} V={spec.head_v_dim} " \
           f"{spec.qkv_dtype} state {spec.state_layout}"


_PACK_TAGS = itertools.count(1)


class PackOps:
    """The ops of one pack for one tensor-parallel rank."""

    def __init__(self, pack: Path, manifest: Manifest, tp_rank: int, tp_size: int, plans: list[PackPlan],
                 calibration, libraries: dict, registered: dict):
        self.pack, self.manifest, self.tp_rank, self.tp_size = pack, manifest, tp_rank, tp_size
        self.plans = plans
        self.calibration = calibration
        self.libraries = libraries
        self.registered = registered  # plan name -> the name the op knows it by (runtime.register_library)
        hv = manifest.spec.num_v_heads // tp_size
        self.v_heads = range(tp_rank * hv, (tp_rank + 1) * hv)
        sl = slice(self.v_heads.start, self.v_heads.stop)
        self._layer_tables = [torch.tensor(layer.warmup_table[sl], dtype=torch.int32) for layer in calibration.layers]
        self._model_table = torch.tensor(calibration.model_table()[sl], dtype=torch.int32)
        # the same tables as tuples, for the C++ host path's call keys (host_path.signature)
        self._table_values = {None: tuple(self._model_table.tolist())}
        self._table_values.update((i, tuple(t.tolist())) for i, t in enumerate(self._layer_tables))
        self.warmup_eps = float(calibration.settings.eps)  # the guard's bound is the calibration's
        self._host_tag = f"pack #{next(_PACK_TAGS)}"  # this object's calls' key part (ids can be reused)
        self._bound_calls: dict[tuple, ops.BoundCall] = {}  # by (layer, heads, head dims, dtype, state layout)

    @property
    def num_layers(self) -> int:
        return len(self._layer_tables)

    def warmup_table(self, layer: int | None = None) -> torch.Tensor:
        """The rank's per-v-head warm-up chunk counts (-1 = exact) for a GDN layer, or the
        model-wide table for layer=None (CPU int32; the calls pass it to the kernels as `warmup`)."""
        if layer is None:
            return self._model_table
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r}: the pack's model has GDN layers 0..{self.num_layers - 1} "
                             f"(counting GDN layers only), or pass layer=None for the model-wide table")
        return self._layer_tables[layer]

    def configurations(self) -> list[str]:
        return [f"{_describe(p.plan.spec)} ({p.form}, tp={p.tp_size})" for p in self.plans]

    def plan_for(self, q, v, state_v_first: bool) -> KernelPlan:
        want = kernel_spec(ops.call_spec(q, v, state_v_first))
        for p in self.plans:
            if p.plan.spec == want:
                return p.plan
        raise ops.UnsupportedError(f"pack {self.pack} (rank {self.tp_rank} of {self.tp_size}) has no kernel for "
                                   f"this call's {_describe(want)}; it has: {'; '.join(self.configurations())}")

    def bound_call(self, q, v, state_v_first: bool, layer: int | None = None) -> ops.BoundCall:
        """The pack's binding for a call's heads and GDN layer (after ops.check_inputs): its plan for
        the heads, the layer's warm-up table (the rank's slice) and the calibration's eps. Built once
        per signature in eager calls; raises where the pack has no kernel or table for the call."""
        signature = None
        if (layer is None or type(layer) is int) and not torch.compiler.is_compiling():
            signature = (layer, q.shape[2], v.shape[2], q.shape[3], v.shape[3], q.dtype, bool(state_v_first))
            bound = self._bound_calls.get(signature)
            if bound is not None:
                return bound
        Hv = v.shape[2]
        table = self.warmup_table(layer)
        if table.numel() != Hv:
            raise ValueError(f"call has Hv={Hv} v-heads but rank {self.tp_rank} of {self.tp_size} holds "
                             f"{table.numel()} (v-heads {self.v_heads.start}..{self.v_heads.stop - 1} of the model's "
                             f"{self.manifest.spec.num_v_heads})")
        plan = self.plan_for(q, v, state_v_first)
        bound = ops.BoundCall(ops.call_spec(q, v, state_v_first), self.registered[plan.name],
                              warmup_tables.normalise(table, Hv), self.warmup_eps)
        if signature is not None:
            self._bound_calls[signature] = bound
        return bound

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                               allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               chunk_indices=None, cp_context=None, *, layer: int | None = None, **kwargs):
        """flashqla_tune.ops.chunk_gated_delta_rule on the pack's plan for this call's heads, with
        the op's arguments and options (ops.check_options refuses the same ones, by name) and
        layer (keyword only) in place of warmup/warmup_eps: the table and eps are the calibration's.
        Returns (o [B,T,Hv,V], final_state fp32 or None), differentiable as the op's are (autograd
        through q, k, v, g, beta and initial_state, with gradients for o and the final state).
        FLA's in-kernel gate and beta options are applied in PyTorch with the kernels' formulas
        (ops.gates_in_torch, differentiable: autograd reaches A_log and dt_bias) before the pack's
        plans, which take precomputed gates, run."""
        if (kwargs or use_beta_sigmoid_in_kernel is not False or allow_neg_eigval is not False
                or chunk_indices is not None or cp_context is not None):
            ops.check_options(use_beta_sigmoid_in_kernel, allow_neg_eigval, chunk_indices, cp_context, kwargs,
                              _PACK_KEYWORDS)
            options = ops.gate_options_of(use_beta_sigmoid_in_kernel, allow_neg_eigval, kwargs)
            if options != ops.NO_GATE_OPTIONS:
                Hv = ops.check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first)[3]
                A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
                if options[0]:
                    ops.check_gate_params(A_log, dt_bias, Hv, q.device)
                g, beta = ops.gates_in_torch(g, beta, A_log, dt_bias, options)
        ops.check_scale(scale)  # the C++ host path takes scale as it is
        values = self._table_values.get(layer) if type(layer) is not bool else None
        key = ops.host_key(q, v, state_v_first, values, self.warmup_eps, self._host_tag) if values else None
        fast = host_path.forward(key, q, k, v, g, beta, scale, initial_state, output_final_state,
                                 use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu)
        if fast is not None:
            return fast
        ops.check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first)
        bound = self.bound_call(q, v, state_v_first, layer)
        return bound(key, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     cu_seqlens, cu_seqlens_cpu)

    def __repr__(self) -> str:
        return (f"PackOps({self.pack}, rank {self.tp_rank}/{self.tp_size}, {self.manifest.target}, "
                f"{len(self.plans)} plan(s))")


def load(pack, tp_rank: int = 0, tp_size: int = 1, *, gpu=_AUTO, open_library=loader.open_library,
         trusted_keys=None) -> PackOps:
    """Open a pack for one rank. gpu defaults to this machine's (environment.gpu_info());
    open_library is the ctypes opener (injectable for tests). trusted_keys (Ed25519 public keys:
    key objects, raw or PEM bytes, PEM text or paths): the pack must carry a signature by one of
    them over its current manifest, binaries and calibration, checked before any library is
    opened (pack_signing.PackSignatureError, a PackError, otherwise). None: no signature check,
    so load only packs from a source you trust."""
    from .calibration_artifact import load_calibration
    from .calibration_settings import CalibrationError

    pack = Path(pack)
    manifest = read_manifest(pack)
    if trusted_keys is not None:
        from .pack_signing import verify_pack

        # The manifest in use is parsed from the very bytes the signature check hashes.
        raw = (pack / MANIFEST).read_bytes()
        manifest = parse_manifest(raw, pack / MANIFEST)
        verify_pack(pack, trusted_keys, manifest, raw)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size not in manifest.tp_sizes:
        raise PackError(f"tp_size={tp_size!r}: pack {pack} was built for tensor-parallel degrees "
                        f"{list(manifest.tp_sizes)} (flashqla-tune build --tp ...)")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise PackError(f"tp_rank={tp_rank!r} must be in 0..{tp_size - 1} for tp_size={tp_size}")
    check_target(manifest, environment.gpu_info() if gpu is _AUTO else gpu, pack)
    plans = [p for p in manifest.plans if p.tp_size == tp_size]
    if not any(p.form == NATIVE for p in plans):
        raise PackError(f"pack {pack} lists no plan of the model's own heads for tp_size={tp_size}")
    check_binaries(pack, manifest, plans)
    try:
        cal = load_calibration(check_calibration(pack, manifest), checkpoint_sha256=manifest.checkpoint_sha256)
    except CalibrationError as exc:
        raise PackError(f"pack {pack}: {CALIBRATION}: {exc}") from exc
    hv = manifest.spec.num_v_heads
    if len(cal.layers) != manifest.num_gdn_layers or any(len(layer.heads) != hv for layer in cal.layers):
        raise PackError(f"pack {pack}: the calibration has {len(cal.layers)} layers of "
                        f"{[len(layer.heads) for layer in cal.layers]} heads; the model has "
                        f"{manifest.num_gdn_layers} GDN layers of Hv={hv}")
    libraries, registered = {}, {}
    for p in plans:
        try:
            lib = open_library(pack / p.so, p.plan)
        except loader.StaleKernelError as exc:
            raise PackError(f"pack {pack}: {exc}") from exc
        libraries[p.plan.name] = lib
        registered[p.plan.name] = runtime.register_library(p.plan, lib, _registered_name(p), p.segment_chunks)
    # the eager op's C++ host path: the pack's prebuilt extension where it fits this torch and Python,
    # else one warning and the Python path for this pack's calls (nothing is compiled for them)
    host_path.use_pack_extension(pack, manifest.host_extension)
    _offer_backward(pack, manifest)
    return PackOps(pack, manifest, tp_rank, tp_size, plans, cal, libraries, registered)


def _offer_backward(pack: Path, manifest: Manifest) -> None:
    """Each of the pack's prebuilt backward kernel libraries (chain, prep, chunk) becomes the one this
    process's backward uses for its kind (opened, its sha256 checked again, on first use). A library
    built for another ABI or spec than this flashqla_tune asks for, or of a kind it uses none of for
    these head dims, is passed over with one warning (the backward then builds its own of that kind,
    or runs that part in torch)."""
    if not manifest.backward:
        return
    from .backward import libraries

    K, V = manifest.spec.head_k_dim, manifest.spec.head_v_dim
    for record in manifest.backward:
        module = libraries.module(record.kind)
        try:
            want = module.spec_for(K, V)
        except ValueError as exc:
            logger.warning("pack %s: its backward %s kernels (%s) are not used: %s; its backward runs that part "
                           "in torch", pack, record.kind, record.spec, exc)
            continue
        if record.abi_version != module.ABI_VERSION or record.spec != want.to_dict():
            logger.warning("pack %s: its backward %s kernels (ABI %s, %s) are not the ones this flashqla_tune uses "
                           "(ABI %s, %s); its backward builds them on first use", pack, record.kind,
                           record.abi_version, record.spec, module.ABI_VERSION, want.to_dict())
            continue
        module.LIBRARIES.offer(want, pack / record.so, record.sha256)


def _registered_name(p) -> str:
    """The plan's name for the op: qualified by the pack's segment table, so two packs sharing a
    binary but not a table (another calibration or GPU) each keep theirs."""
    if p.segment_chunks is None:
        return p.plan.name
    digest = hashlib.sha256(",".join(map(str, p.segment_chunks)).encode()).hexdigest()[:12]
    return f"{p.plan.name}@cp-{digest}"
