"""A kernel pack as a backend of FLA's chunk_gated_delta_rule: `flashqla_tune.register_fla_backend(PACK)`.

FLA's registry (fla.backends, fla-core >= 0.6) keeps per-op backends sorted by priority,
lowest first; FlashQLA's is 3, ours defaults to 2 so the pack is asked first. For each call
FLA runs `chunk_gated_delta_rule_verifier`; a refusal (with its reason, which FLA logs) sends
the call on to the next backend or FLA's Triton kernels. FLA calls carry no layer index, so
the pack runs with its model-wide warm-up table (per head the largest n_h over layers), guarded
like every pack call (see flashqla_tune.packed_ops). The pack's op is differentiable, so calls
that need a gradient (FLA's training path) are taken too, and so are FLA's in-kernel gate and beta
options (use_gate_in_kernel with A_log and dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval:
what FLA's GatedDeltaNet layer passes), which the pack's op applies. fla is imported only when
registering.
"""
from __future__ import annotations

import torch

from . import ops as op_checks

OP_NAME = "gated_delta_rule"
BACKEND_TYPE = "flashqla_tune"
ENV_VAR = "FLA_FLASHQLA_TUNE"          # =0 disables the backend, as FLA's own switches do
DEFAULT_PRIORITY = 2                   # ahead of FlashQLA (3)


def cuda_arch(t: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of the tensor's GPU, None for a tensor off the GPU."""
    if t.device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(t.device)


def verify_call(pack_ops, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, *,
                device_arch=cuda_arch, **kwargs) -> tuple[bool, str | None]:
    """(True, None) when the pack can run this FLA call (FLA's arguments, positional or not), else
    (False, why): the options the op refuses, with the op's reasons (ops.check_options), then the
    inputs (A_log and dt_bias of an in-kernel gate included), device and the pack's plans. Calls
    that need a gradient are taken: the pack's op is differentiable (flashqla_tune.ops registers its
    backward). Cheap, no side effects."""
    try:
        op_checks.check_options(use_beta_sigmoid_in_kernel, allow_neg_eigval, chunk_indices, cp_context, kwargs)
    except (TypeError, ValueError) as exc:  # UnsupportedError is a ValueError
        return False, str(exc)
    try:
        Hv = op_checks.check_shapes_and_types(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu,
                                              state_v_first)[3]
        if kwargs.get("use_gate_in_kernel", False):
            op_checks.check_gate_params(kwargs.get("A_log"), kwargs.get("dt_bias"), Hv, q.device)
    except (TypeError, ValueError) as exc:  # UnsupportedError is a ValueError
        return False, str(exc)
    arch = device_arch(q)
    if arch != (9, 0):
        where = "not on a CUDA GPU" if arch is None else f"on sm_{arch[0]}{arch[1]}"
        return False, f"flashqla_tune kernels run on sm_90 (H100/H200); the inputs are {where}"
    try:
        pack_ops.plan_for(q, v, state_v_first)
    except op_checks.UnsupportedError as exc:
        return False, str(exc)
    rank_hv = pack_ops.warmup_table(None).numel()
    if Hv != rank_hv:
        return False, f"call has Hv={Hv}; this pack's rank holds {rank_hv} v-heads"
    return True, None


def backend_class(pack_ops, base: type, priority: int = DEFAULT_PRIORITY, device_arch=cuda_arch) -> type:
    """A subclass of FLA's BaseBackend bound to one loaded pack (FLA instantiates it without
    arguments, so the pack travels as a class attribute)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority={priority!r} must be an int (lower runs first; FlashQLA's is 3)")

    class FlashQLATuneBackend(base):
        backend_type = BACKEND_TYPE
        package_name = None
        env_var = ENV_VAR
        default_enable = True

        def chunk_gated_delta_rule_verifier(self, *args, **kwargs):
            return verify_call(self.pack_ops, *args, device_arch=self._device_arch, **kwargs)

        def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                   allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
                                   cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs):
            # Verified already; the pack's op checks the options again. No layer index from FLA.
            return self.pack_ops.chunk_gated_delta_rule(
                q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, cp_context=cp_context, layer=None,
                **kwargs)

    FlashQLATuneBackend.priority = priority
    FlashQLATuneBackend.pack_ops = pack_ops
    FlashQLATuneBackend._device_arch = staticmethod(device_arch)
    return FlashQLATuneBackend


def register_fla_backend(pack, tp_rank: int = 0, tp_size: int = 1, *, priority: int = DEFAULT_PRIORITY,
                         fla_backends=None, pack_ops=None, device_arch=cuda_arch):
    """Load the pack (unless pack_ops is given) and register it with FLA's gated_delta_rule
    registry; returns the backend class. fla_backends defaults to the `fla.backends` module
    (fla-core >= 0.6); registering again replaces the earlier pack (same backend_type)."""
    if fla_backends is None:
        try:
            import fla.backends as fla_backends
        except ImportError as exc:
            raise ImportError(f"register_fla_backend needs FLA's backend registry (fla-core >= 0.6, which "
                              f"needs triton): {exc}") from exc
    if pack_ops is None:
        from .packed_ops import load

        pack_ops = load(pack, tp_rank, tp_size)
    cls = backend_class(pack_ops, fla_backends.BaseBackend, priority, device_arch)
    fla_backends.register(OP_NAME)(cls)
    return cls
