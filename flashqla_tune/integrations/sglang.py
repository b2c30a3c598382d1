"""SGLang's GDN prefill on a kernel pack: `install(PACK)` in each process that runs the model, or
`FLASHQLA_TUNE_PACK=PACK python -m flashqla_tune.integrations.sglang <launch_server args>`.

SGLang's GDN attention backend (`GDNAttnBackend`) sends every extend (prefill) call through its
kernel dispatcher's extend kernel, the one `--linear-attn-prefill-backend` chose (Triton,
FlashInfer, ...); decode, packed decode and speculative verification go to the decode and
verify kernels. The route wraps `GDNAttnBackend.forward_extend`: on a backend's first extend it
puts a pack kernel in the dispatcher's extend slot, with the chosen kernel kept as its fallback,
and around each call it tells that kernel which layer is running (`layer.layer_id`, SGLang's
decoder-layer index, mapped to the pack's GDN layer by the calibration's `decoder_layer`).
Decode and verification keep SGLang's kernels.

States: SGLang passes the whole v-first state pool ([slots, Hv, V, K]) and one slot index per
request, and expects the extend kernel to update the slots in place (its FLA Triton kernel
does). The route gathers the slots as initial states, runs the pack with state_v_first=True and
writes the final states back in the pool's dtype; a negative slot (padding) reads zeros and writes
nothing. q and k arrive unnormalised: SGLang's Triton
extend L2-normalises them in the kernel, and so does the route.

The call-site conventions this module follows are recorded, with the sources read, in
tests/fixtures/serving_call_sites.py.
"""
from __future__ import annotations

import importlib
import sys

import torch

from .serving_calls import (PackSource, Refusals, UnsupportedCall, default_load, gdn_layer_of_decoder, pack_from_env,
                            refusal_types)

BACKEND_MODULE = "sglang.srt.layers.attention.linear.gdn_backend"
BACKEND_CLASS = "GDNAttnBackend"
# the dispatcher's extend-kernel attribute: GDNKernelDispatcher in gdn_backend.py, then the
# older one in gdn_kernel_dispatcher.py
EXTEND_SLOTS = ("extend_kernel", "_extend_kernel")
# keywords an extend call may add (the Triton extend takes the first; the second is its fixed
# convention), with the values a call without them means
EXTEND_OPTIONS = {"inplace_update": True, "use_qk_l2norm_in_kernel": True}


def convert_extend(q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **options):
    """The pack op's keyword arguments for one SGLang extend call, and whether the final states go
    back into the pool (inplace_update). Raises UnsupportedCall naming what the pack cannot honour."""
    inplace_update = options.pop("inplace_update", True)
    if type(inplace_update) is not bool:
        raise UnsupportedCall(f"inplace_update={inplace_update!r} must be a bool")
    l2norm = options.pop("use_qk_l2norm_in_kernel", True)
    if options:
        name = next(iter(options))
        raise UnsupportedCall(f"{name}={_describe(options[name])} is not an argument of SGLang's GDN extend call "
                              f"the route knows (it takes q, k, v, g, beta, ssm_states, cache_indices, "
                              f"query_start_loc, {', '.join(EXTEND_OPTIONS)})")
    if query_start_loc is None:
        raise UnsupportedCall("query_start_loc=None: the route needs the requests' token offsets")
    if cache_indices is None or cache_indices.dim() != 1:
        raise UnsupportedCall(f"cache_indices={_describe(cache_indices)}: one pool slot per request expected")
    if cache_indices.numel() != query_start_loc.numel() - 1:
        raise UnsupportedCall(f"cache_indices has {cache_indices.numel()} slots for {query_start_loc.numel() - 1} "
                              f"requests in query_start_loc")
    Hv, V, K = v.shape[-2], v.shape[-1], q.shape[-1]
    if ssm_states.dim() != 4 or tuple(ssm_states.shape[1:]) != (Hv, V, K):
        raise UnsupportedCall(f"ssm_states shape {tuple(ssm_states.shape)}: a v-first pool [slots, Hv, V, K] = "
                              f"[slots, {Hv}, {V}, {K}] expected")
    # fused_gdn_gating returns [1, T, Hv]; a [T, Hv] gate or beta gets its batch dimension back
    g = g.unsqueeze(0) if g.dim() == 2 else g
    beta = beta.unsqueeze(0) if beta.dim() == 2 else beta
    call = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=gather_states(ssm_states, cache_indices),
                output_final_state=True, use_qk_l2norm_in_kernel=bool(l2norm), state_v_first=True,
                cu_seqlens=query_start_loc)
    return call, inplace_update


# A negative slot (SGLang's PAD_SLOT_ID, -1) marks a padding request: it starts from a zero state and
# its final state goes nowhere. Indexing the pool with it would read and overwrite the pool's last
# slot, another request's state. Both helpers stay on the device (no sync, capturable).
def gather_states(ssm_states, cache_indices):
    """The requests' initial states from the pool; zero for padding slots."""
    valid = (cache_indices >= 0).view(-1, 1, 1, 1)
    states = ssm_states[cache_indices.clamp(min=0)]
    return torch.where(valid, states, torch.zeros((), dtype=states.dtype, device=states.device))


def scatter_states(ssm_states, cache_indices, final_state) -> None:
    """Writes the requests' final states into their pool slots; padding slots write nothing.

    One index_put writes every row. A padding row is pointed at the slot of the first real request
    with that request's own state (or, with no real request, at slot 0 with slot 0's own value), so
    duplicate indices always carry equal values and the write is deterministic."""
    if cache_indices.numel() == 0:
        return
    valid = cache_indices >= 0
    slots = cache_indices.clamp(min=0)
    new = final_state.to(ssm_states.dtype)
    # one-element index tensors throughout: indexing with a 0-dim tensor would read it on the host
    first = valid.to(torch.int32).argmax().view(1)  # 0 when no request is real
    pad_slot = slots.index_select(0, first)
    pad_state = torch.where(valid.index_select(0, first).view(1, 1, 1, 1), new.index_select(0, first),
                            ssm_states.index_select(0, pad_slot))
    slots = torch.where(valid, slots, pad_slot)
    ssm_states[slots] = torch.where(valid.view(-1, 1, 1, 1), new, pad_state)


def _describe(value) -> str:
    shape = getattr(value, "shape", None)
    return f"a tensor {tuple(shape)}" if shape is not None else repr(value)


class PackExtendKernel:
    """Stands in the dispatcher's extend slot: extend() runs the pack for the layer the backend
    is running, anything else (and a refused call) goes to the kernel SGLang chose."""

    flashqla_tune_route = True

    def __init__(self, fallback, source: PackSource, refusals: Refusals):
        self.fallback, self.source, self.refusals = fallback, source, refusals
        self.layer_id = None  # set by the wrapped forward_extend around each call

    def __getattr__(self, name):  # decode/verify attributes, flags such as supports_packed_decode
        return getattr(self.fallback, name)

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **options):
        try:
            call, inplace_update = convert_extend(q, k, v, g, beta, ssm_states=ssm_states,
                                                  cache_indices=cache_indices, query_start_loc=query_start_loc,
                                                  **dict(options))
            pack_ops = self.source.get()
            layer = gdn_layer_of_decoder(pack_ops, self.layer_id)
            o, final_state = pack_ops.chunk_gated_delta_rule(**call, layer=layer)
        except refusal_types() as exc:
            self.refusals.note(str(exc))
            return self.fallback.extend(q, k, v, g, beta, ssm_states=ssm_states, cache_indices=cache_indices,
                                        query_start_loc=query_start_loc, **options)
        if inplace_update:
            scatter_states(ssm_states, cache_indices, final_state)
        # (output, last state, per-chunk states): the pool holds the last states already, and the
        # pack exposes no per-chunk states (SGLang then skips its mid-sequence state tracking)
        return o, None, None


def _extend_slot(dispatcher) -> str:
    for name in EXTEND_SLOTS:
        if hasattr(dispatcher, name):
            return name
    raise RuntimeError(f"SGLang's GDN kernel dispatcher ({type(dispatcher).__name__}) has none of "
                       f"{EXTEND_SLOTS}: this SGLang version is not one the route knows")


def route_kernel(backend, source: PackSource, refusals: Refusals) -> PackExtendKernel:
    """The backend's pack kernel, put into its dispatcher's extend slot on first use."""
    dispatcher = backend.kernel_dispatcher
    slot = _extend_slot(dispatcher)
    kernel = getattr(dispatcher, slot)
    if not getattr(kernel, "flashqla_tune_route", False):
        kernel = PackExtendKernel(kernel, source, refusals)
        setattr(dispatcher, slot, kernel)
    return kernel


def install(pack, *, load=default_load, tp=None):
    """Wrap SGLang's GDNAttnBackend.forward_extend so extend calls run on the pack (before or after
    the backend is built; idempotent). tp() -> (rank, size) defaults to SGLang's attention
    tensor-parallel group. Returns the Refusals record of the calls handed back to SGLang's kernel."""
    backend_cls = getattr(importlib.import_module(BACKEND_MODULE), BACKEND_CLASS)
    present = backend_cls.forward_extend
    if getattr(present, "flashqla_tune_route", False):
        return present.refusals
    source = PackSource(str(pack), load, tp or _sglang_tp)
    refusals = Refusals("flashqla_tune SGLang route")

    def forward_extend(self, layer, forward_batch, *args, **kwargs):
        kernel = route_kernel(self, source, refusals)
        kernel.layer_id = getattr(layer, "layer_id", None)
        try:
            return present(self, layer, forward_batch, *args, **kwargs)
        finally:
            kernel.layer_id = None

    forward_extend.flashqla_tune_route = True
    forward_extend.flashqla_tune_original = present
    forward_extend.refusals = refusals
    forward_extend.__doc__ = present.__doc__
    backend_cls.forward_extend = forward_extend
    return refusals


def uninstall() -> None:
    """Put SGLang's own forward_extend back (backends built meanwhile keep their pack kernel)."""
    backend_cls = getattr(importlib.import_module(BACKEND_MODULE), BACKEND_CLASS)
    original = getattr(backend_cls.forward_extend, "flashqla_tune_original", None)
    if original is not None:
        backend_cls.forward_extend = original


def _sglang_tp() -> tuple[int, int]:
    """The rank's place in the attention tensor-parallel group, by which SGLang's GDN layers split
    their heads (it differs from the model's TP group under data-parallel attention)."""
    from sglang.srt.layers.dp_attention import get_attention_tp_rank, get_attention_tp_size

    return get_attention_tp_rank(), get_attention_tp_size()


def install_from_env() -> bool:
    """install() for the pack FLASHQLA_TUNE_PACK names; False (nothing done) when it is unset."""
    pack = pack_from_env()
    if pack is None:
        return False
    install(pack)
    return True


def main(argv=None) -> None:
    """`python -m flashqla_tune.integrations.sglang ARGS`: SGLang's launch_server with the route on.
    SGLang starts its scheduler processes with multiprocessing's spawn, which imports this module
    again in each of them as `__mp_main__`; the line at the bottom installs the route there."""
    import runpy

    if not install_from_env():
        raise SystemExit("set FLASHQLA_TUNE_PACK to a pack built with --state-layout vk")
    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    # alter_sys=False keeps this module as __main__, the module spawned processes import again
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # a process spawned by the launcher above
    install_from_env()
