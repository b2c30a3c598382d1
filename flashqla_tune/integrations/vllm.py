"""vLLM's GDN prefill on a kernel pack: a `vllm.general_plugins` entry point, on when
FLASHQLA_TUNE_PACK names a pack built with `--state-layout vk`.

vLLM runs the chunked GDN prefill of its Qwen3-Next / Qwen3.5 layers through one CustomOp,
`ChunkGatedDeltaRule`, which picks FlashInfer, CuTe DSL or its vendored FLA Triton kernels when
it is built. vLLM builds a custom op from the out-of-tree registry when a class is registered
there under the op's class name, so the plugin registers a subclass that keeps vLLM's choice as
its fallback and sends prefill calls to the pack. Decode and speculative verification run
other vLLM kernels (fused_sigmoid_gating_delta_rule_update and the packed decode), which the
route does not touch.

A call's layer: each GDN layer registers itself under its module name (`model.layers.<i>.
linear_attn`) in the compilation config's static forward context, which the forward context
holds as `no_compile_layers`; the op finds its own layer there on its first call, and the pack's
calibration maps the decoder-layer index to its GDN layer (`decoder_layer`).

States: vLLM gathers the prefill requests' rows of its v-first pool ([slots, Hv, V, K]) before
the call, zeroing the rows of new requests, and writes the returned final states back itself;
the route passes them with state_v_first=True.

The call-site conventions this module follows are recorded, with the sources read, in
tests/fixtures/serving_call_sites.py.
"""
from __future__ import annotations

import importlib
import inspect

from .serving_calls import (PackSource, Refusals, decoder_layer_from_name, default_load, gdn_layer_of_decoder,
                            pack_from_env, refusal_types)

OP_CLASS_NAME = "ChunkGatedDeltaRule"
CUSTOM_OP_MODULE = "vllm.model_executor.custom_op"
GDN_LAYER_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
FORWARD_CONTEXT_MODULE = "vllm.forward_context"

_P = inspect.Parameter
_REQUIRED = _P.empty
# ChunkGatedDeltaRule.forward_* (every backend's method): names, positional order and defaults
OP_FORWARD_PARAMETERS = (("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED), ("g", _REQUIRED),
                         ("beta", _REQUIRED), ("initial_state", _REQUIRED), ("output_final_state", _REQUIRED),
                         ("cu_seqlens", None), ("chunk_indices", None), ("chunk_offsets", None),
                         ("use_qk_l2norm_in_kernel", True), ("core_attn_out", None))
_SIGNATURE = inspect.Signature([_P(name, _P.POSITIONAL_OR_KEYWORD, default=default)
                                for name, default in OP_FORWARD_PARAMETERS]
                               + [_P("options", _P.VAR_KEYWORD)])

# keywords vLLM's vendored FLA function takes beyond the op's, with the value the route honours
# (scale, any number, is honoured too)
HONOURED_OPTIONS = {"head_first": False, "return_intermediate_states": False}
_WHY = {"head_first": "the inputs must be [B,T,H,D] (vLLM's own FLA copy refuses head_first=True too)",
        "return_intermediate_states": "the pack's kernels return no per-chunk states"}


def convert_call(*args, **kwargs) -> tuple[dict, object]:
    """The pack op's keyword arguments for one ChunkGatedDeltaRule call (vLLM's names and order),
    and the call's core_attn_out buffer (None if it passed none). A keyword beyond the op's
    parameters is a TypeError naming it (vLLM's own backends take none either), except FLA's
    scale, head_first and return_intermediate_states at values the pack honours."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    options = a.pop("options")
    scale = options.pop("scale", None)
    for name, honoured in HONOURED_OPTIONS.items():
        if name in options:
            value = options.pop(name)
            if value != honoured:
                raise TypeError(f"{name}={value!r} is not supported: {_WHY[name]}")
    if options:
        name = next(iter(options))
        raise TypeError(f"vLLM's GDN prefill op got an unexpected keyword argument {name!r} (it takes "
                        f"{', '.join(n for n, _ in OP_FORWARD_PARAMETERS)}; the route also honours "
                        f"{', '.join(f'{n}={v!r}' for n, v in HONOURED_OPTIONS.items())})")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale={scale!r} must be a number")
    # chunk_indices and chunk_offsets are vLLM's enumeration of cu_seqlens in 64-token chunks for
    # its Triton kernels; the pack's kernels derive theirs from cu_seqlens on the device.
    core_attn_out = a.pop("core_attn_out")
    a.pop("chunk_indices")
    a.pop("chunk_offsets")
    a["output_final_state"] = bool(a["output_final_state"])
    return dict(a, scale=scale, state_v_first=True), core_attn_out


def write_output(o, core_attn_out) -> None:
    """vLLM's contract for core_attn_out: the output's elements, flat, at the buffer's start."""
    flat = o.reshape(-1)
    if core_attn_out.numel() < flat.numel():
        raise ValueError(f"core_attn_out holds {core_attn_out.numel()} elements, the output {flat.numel()}")
    core_attn_out.view(-1)[: flat.numel()].copy_(flat)  # a view: the copy lands in the caller's buffer


def _forward_layers() -> dict:
    try:
        context = importlib.import_module(FORWARD_CONTEXT_MODULE).get_forward_context()
    except (AssertionError, AttributeError, ImportError):  # no forward running (vLLM asserts one is set)
        return {}
    return getattr(context, "no_compile_layers", None) or {}


def route_class(base: type, source: PackSource, refusals: Refusals | None = None) -> type:
    """A subclass of vLLM's ChunkGatedDeltaRule whose forward runs the pack, keeping the backend
    vLLM chose as the fallback for calls the pack refuses."""
    refusals = refusals or Refusals("flashqla_tune vLLM route")

    class FlashQLATuneChunkGatedDeltaRule(base):
        flashqla_tune_route = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.flashqla_tune_fallback = self._forward_method
            self._forward_method = self.forward_pack
            self.flashqla_tune_layer_name = None

        def layer_name(self) -> str | None:
            """This op's GDN layer's module name, found once in the forward context."""
            if self.flashqla_tune_layer_name is None:
                for name, module in _forward_layers().items():
                    if getattr(module, "chunk_gated_delta_rule", None) is self:
                        self.flashqla_tune_layer_name = name
                        break
            return self.flashqla_tune_layer_name

        def forward_pack(self, *args, **kwargs):
            try:
                op_kwargs, core_attn_out = convert_call(*args, **kwargs)
                pack_ops = source.get()
                layer = gdn_layer_of_decoder(pack_ops, decoder_layer_from_name(self.layer_name()))
                o, final_state = pack_ops.chunk_gated_delta_rule(**op_kwargs, layer=layer)
            except refusal_types() as exc:
                refusals.note(str(exc))
                return self.flashqla_tune_fallback(*args, **kwargs)
            if core_attn_out is not None:
                write_output(o, core_attn_out)
            return o, final_state

    FlashQLATuneChunkGatedDeltaRule.refusals = refusals
    FlashQLATuneChunkGatedDeltaRule.pack_source = source
    return FlashQLATuneChunkGatedDeltaRule


def _vllm_tp() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def install(pack, *, load=default_load, tp=_vllm_tp) -> type:
    """Register the route for the pack in vLLM's out-of-tree op registry (before vLLM builds the
    model). Loading plugins more than once in a process keeps the first registration; a
    different out-of-tree ChunkGatedDeltaRule registered by someone else is an error."""
    module = importlib.import_module(CUSTOM_OP_MODULE)
    custom_op = module.CustomOp
    # the registry is a module global in newer vLLM, a CustomOp class attribute in older ones
    registry = vars(module).get("op_registry_oot")
    if registry is None:
        registry = custom_op.op_registry_oot
    present = registry.get(OP_CLASS_NAME)
    if present is not None:
        if getattr(present, "flashqla_tune_route", False):
            return present
        raise RuntimeError(f"vLLM's {OP_CLASS_NAME} is already replaced by {present.__module__}."
                           f"{present.__qualname__}; flashqla_tune's route cannot be installed beside it")
    base = getattr(importlib.import_module(GDN_LAYER_MODULE), OP_CLASS_NAME)
    cls = route_class(base, PackSource(str(pack), load, tp))
    custom_op.register_oot(cls, name=OP_CLASS_NAME)
    return cls


def plugin() -> None:
    """The `vllm.general_plugins` entry point (vLLM calls it in every process it starts): routes
    GDN prefill to the pack FLASHQLA_TUNE_PACK names, and does nothing when it is unset."""
    pack = pack_from_env()
    if pack is not None:
        install(pack)
