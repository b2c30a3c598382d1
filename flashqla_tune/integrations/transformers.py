"""A transformers model's GDN prefill on a kernel pack, with no FLA installed:
`route = flashqla_tune.integrations.transformers.use_pack(model, pack)`.

How transformers (5.x) reaches the kernel. Each family's modeling module defines a module-level
`torch_chunk_gated_delta_rule`, decorated at import by `use_kernel_func_from_hub_with_fallback(
"chunk_gated_delta_rule", "fla")`: the decorator settles what that name runs (with the `kernels`
package installed and the model kernelized, the hub's kernels-community/fla function; else an
installed FLA's `fla.ops.gated_delta_rule.chunk_gated_delta_rule`, resolved at import; else the
PyTorch loop) and drops every keyword the chosen function does not take. The GatedDeltaNet
layer's forward calls that name as
`(query, key, value, g=, beta=, initial_state=, output_final_state=, use_qk_l2norm_in_kernel=True,
cu_seqlens=, **model_kwargs)`: q, k [B,T,Hqk,K] unrepeated, v [B,T,Hv,V], g [B,T,Hv] fp32 log
decay, beta [B,T,Hv] after its sigmoid, initial_state the cache's [B,Hv,K,V] state or None,
output_final_state whether a cache is kept, cu_seqlens the model's `cu_seq_lens_q` (packed
sequences) and model_kwargs the rest of the model's keyword plumbing (TransformersKwargs). Those
are the op's layouts (flashqla_tune.ops), so the arguments pass as they are. Single-token decode
with a cached state calls `torch_recurrent_gated_delta_rule` instead, which the route leaves alone.

The route replaces the family module's chunk function by a dispatcher, and wraps the forward of
each GDN layer of this model (on the instance) so the dispatcher knows which layer calls:
a call from a routed layer runs `pack.chunk_gated_delta_rule(..., layer=i)`, i being the GDN-layer
index (0..num_gdn-1) that the pack's calibration records for the layer's decoder index
(`decoder_layer` in the artifact; in the shipped model decoder layer 4 is GDN layer 3); any other
call (another model of the family, a layer of this one after the route is closed) runs what
transformers chose. The families routed are those of model_config's registry whose layers call
transformers' chunk function (GDNFamily.transformers_layers), plus any `register_family` adds. A
route is refused, by what is wrong, for a family not registered, a pack built for another
checkpoint (checkpoint sha256 against the pack manifest's) or for other GDN layers. A call with an
argument the route cannot honour is refused by the argument's name: chunk_size other than 64,
seq_idx without cu_seqlens, and FLA's options the op refuses (flashqla_tune.ops.check_options); the
model's keyword plumbing is dropped, as transformers drops it for every implementation it may choose.

Models of FLA's own layout (`gated_deltanet`, FLA's layers) call FLA's op, not transformers':
they keep the FLA backend, `flashqla_tune.register_fla_backend(PACK)` (flashqla_tune.fla_backend).

transformers is imported only when a route is made; nothing here compiles.
"""
from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..hub_dispatch import torch_function_behind
from ..model_config import families as model_families
from ..pack import PackError

CHUNK_FUNCTION = "torch_chunk_gated_delta_rule"


# The named arguments of the families' PyTorch GDN function that the route takes as q, k, v, g, beta
_BOUND_ARGUMENTS = ("query", "key", "value", "g", "beta")


class RouteError(ValueError):
    """The model cannot be routed onto the pack: family not registered, or layers that do not match."""


@dataclass(frozen=True)
class Family:
    """Where a family's transformers code keeps its GDN layer and the chunk function it calls."""
    modeling: str                     # the modeling module, e.g. transformers.models.qwen3_5.modeling_qwen3_5
    layer_class: str                  # its GatedDeltaNet module class
    function: str = CHUNK_FUNCTION    # the module-level name the layer's forward calls for chunked prefill


def _registered_families() -> dict[str, Family]:
    """model_type -> its family's code, for every family of model_config's registry whose GDN layer
    calls transformers' chunk function (GDNFamily.transformers_layers)."""
    return {model_type: Family(modeling, layer_class)
            for fam in model_families() if fam.calls == "transformers"
            for model_type, (modeling, layer_class) in fam.transformers_layers.items()}


def _fla_layout_types() -> tuple[str, ...]:
    """The model types whose GDN layers call FLA's op (FLA's own layout)."""
    return tuple(t for fam in model_families() if fam.calls == "fla" for t in fam.model_types)


# model_type (config.model_type of the model handed to use_pack) -> its family's code: the registry's
# families as this module is imported, and any register_family adds.
FAMILIES: dict[str, Family] = _registered_families()


def register_family(model_type: str, modeling: str, layer_class: str, function: str = CHUNK_FUNCTION) -> None:
    """Let use_pack route models of `model_type`: their GDN layers are instances of `layer_class`
    in module `modeling`, whose forward calls the module-level `function` for chunked prefill with
    transformers' Qwen arguments (see this module's docstring)."""
    FAMILIES[model_type] = Family(modeling, layer_class, function)


# The route and GDN-layer index of the layer whose forward is running, read by the dispatcher.
_CALLER: contextvars.ContextVar = contextvars.ContextVar("flashqla_tune_transformers_caller", default=None)
_LOCK = threading.Lock()
_PATCHES: dict[tuple[str, str], "_Patch"] = {}          # (module, function) -> the installed dispatcher
_ROUTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # GDN module -> its open route


@dataclass
class _Patch:
    module: object
    name: str
    original: object      # what transformers chose for the name
    dispatcher: object
    signature: inspect.Signature   # the PyTorch function's, whose named arguments a routed call binds
    users: int = 0


def _call_signature(family: Family, original) -> inspect.Signature:
    """The signature a call of `original` (the family's chunk function as transformers left it) is
    bound by: its own, or, for a dispatch object that takes (*args, **kwargs) (the `kernels`
    library's module around the PyTorch function), the PyTorch function's behind it. RouteError
    where neither names the arguments the route binds."""
    signature = inspect.signature(inspect.unwrap(original))
    if any(n not in signature.parameters for n in _BOUND_ARGUMENTS):
        behind = torch_function_behind(family.function, original, family.modeling)
        if behind is not None:
            signature = inspect.signature(behind)
    missing = [n for n in _BOUND_ARGUMENTS if n not in signature.parameters]
    if missing:
        raise RouteError(f"{family.modeling}.{family.function} takes {signature}, not the named arguments "
                         f"{missing} the route binds: this transformers ({_transformers_version()}) calls its "
                         f"GDN function another way")
    return signature


def _dispatcher(original):
    @functools.wraps(original)
    def chunk_gated_delta_rule(*args, **kwargs):
        caller = _CALLER.get()
        if caller is None:
            return original(*args, **kwargs)
        route, layer = caller
        return route._run(layer, args, kwargs)

    return chunk_gated_delta_rule


def _install(family: Family, module) -> _Patch:
    key = (family.modeling, family.function)
    patch = _PATCHES.get(key)
    if patch is None or getattr(module, family.function, None) is not patch.dispatcher:
        original = getattr(module, family.function, None)
        if not callable(original):
            raise RouteError(f"{family.modeling} has no function {family.function!r}: this transformers "
                             f"({_transformers_version()}) calls its GDN kernel another way")
        patch = _Patch(module, family.function, original, _dispatcher(original), _call_signature(family, original))
        setattr(module, family.function, patch.dispatcher)
        _PATCHES[key] = patch
    patch.users += 1
    return patch


def _uninstall(patch: _Patch) -> None:
    patch.users -= 1
    if patch.users > 0:
        return
    if getattr(patch.module, patch.name, None) is patch.dispatcher:
        setattr(patch.module, patch.name, patch.original)
    for key, p in list(_PATCHES.items()):
        if p is patch:
            del _PATCHES[key]


def _transformers_version() -> str:
    try:
        import transformers
        return transformers.__version__
    except ImportError:
        return "not installed"


# FLA's argument names beyond transformers' own that a caller of the routed function may pass: they
# go to the pack's op, which honours them or refuses them by name (flashqla_tune.ops.check_options).
# Every other keyword is the model's plumbing (TransformersKwargs, use_cache, ...), which transformers
# drops for every implementation it may have chosen, FLA's included; the route drops it too.
_OP_ARGUMENTS = ("scale", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "cu_seqlens_cpu",
                 "chunk_indices", "cp_context", "use_gate_in_kernel", "A_log", "dt_bias", "head_first",
                 "transpose_state_layout")


class PackRoute:
    """An open route of one model's GDN layers onto a pack. `close()` (or leaving its `with`
    block) puts back the layers' forwards and, once no route of the family is open, the family's
    chunk function. `layers` maps decoder-layer index -> GDN-layer index; `calls` counts the calls
    that reached the pack per GDN layer."""

    def __init__(self, model, pack_ops, family: Family, layers: dict[int, int], modules: list):
        self.model_type = model.config.model_type
        self.pack = pack_ops
        self.family = family
        self.layers = dict(layers)
        self.calls = {gdn: 0 for gdn in sorted(layers.values())}
        self._modules = modules
        self._forwards: dict[int, tuple] = {}
        self._patch = None
        self._open = False
        self._signature = None

    # --- opening and closing ------------------------------------------------------------
    def _open_on(self, module) -> None:
        with _LOCK:
            busy = [m.layer_idx for m in self._modules if m in _ROUTED]
            if busy:
                raise RouteError(f"decoder layer(s) {busy} of this model are routed already: close that route "
                                 f"first (route.close())")
            self._patch = _install(self.family, module)
            self._signature = self._patch.signature
            for m in self._modules:
                self._wrap(m)
                _ROUTED[m] = self
            self._open = True

    def _wrap(self, module) -> None:
        had = "forward" in module.__dict__
        previous = module.forward
        layer = self.layers[module.layer_idx]
        route = self

        @functools.wraps(previous)
        def forward(*args, **kwargs):
            if not route._open:
                return previous(*args, **kwargs)
            token = _CALLER.set((route, layer))
            try:
                return previous(*args, **kwargs)
            finally:
                _CALLER.reset(token)

        module.forward = forward
        self._forwards[id(module)] = (module, had, previous, forward)

    def close(self) -> None:
        """Restore what use_pack replaced; closing twice is harmless. A layer whose forward was
        wrapped again after use_pack keeps that wrapper, and ours inside it passes calls through."""
        with _LOCK:
            if not self._open:
                return
            self._open = False
            for module, had, previous, ours in self._forwards.values():
                if module.__dict__.get("forward") is ours:
                    if had:
                        module.forward = previous
                    else:
                        del module.forward
                if _ROUTED.get(module) is self:
                    del _ROUTED[module]
            self._forwards.clear()
            _uninstall(self._patch)

    restore = close

    @property
    def is_open(self) -> bool:
        return self._open

    def __enter__(self) -> "PackRoute":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._open else "closed"
        return f"PackRoute({self.model_type}, {len(self.layers)} GDN layers -> {self.pack!r}, {state})"

    # --- a routed call ------------------------------------------------------------------
    def _run(self, layer: int, args: tuple, kwargs: dict):
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"GDN layer {layer}: the routed {self.family.function} cannot take this call: "
                            f"{exc}") from None
        arguments = dict(bound.arguments)
        extra = {}
        for name, p in self._signature.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                extra = dict(arguments.pop(name, {}))
        op_kwargs = self._convert(layer, arguments, extra)
        try:
            out = self.pack.chunk_gated_delta_rule(**op_kwargs, layer=layer)
        except (TypeError, ValueError, NotImplementedError) as exc:
            if hasattr(exc, "add_note"):
                decoder = next(d for d, g in self.layers.items() if g == layer)
                exc.add_note(f"(in the pack route of GDN layer {layer}, decoder layer {decoder})")
            raise
        self.calls[layer] += 1
        return out

    def _convert(self, layer: int, arguments: dict, extra: dict) -> dict:
        """transformers' call -> the op's keywords. Refuses by name what the route cannot honour
        (chunk_size other than 64, seq_idx without cu_seqlens); FLA's options go to the op, which
        refuses its unsupported ones by name; the model's plumbing is dropped."""
        from ..ops import CHUNK_SIZE, UnsupportedError

        # q, k, v are views of the layer's conv output with the token stride 1; a contiguous copy (the
        # copy the op's Python path would make) lets the op's C++ host path take the call
        op = {name: _contiguous(arguments.pop(source)) for name, source in zip(("q", "k", "v", "g", "beta"),
                                                                               _BOUND_ARGUMENTS)}
        chunk_size = arguments.pop("chunk_size", CHUNK_SIZE)
        if isinstance(chunk_size, bool) or chunk_size != CHUNK_SIZE:
            raise UnsupportedError(f"chunk_size={chunk_size!r} is not supported by the pack route: the kernels "
                                   f"run {CHUNK_SIZE}-token chunks")
        for name in ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel"):
            if name in arguments:
                op[name] = arguments.pop(name)
        extra.update(arguments)   # a named parameter of a family's function beyond the Qwen ones
        cu_seqlens = extra.pop("cu_seqlens", None)
        seq_idx = extra.pop("seq_idx", None)
        if seq_idx is not None and cu_seqlens is None:
            raise UnsupportedError("seq_idx without cu_seqlens is not supported by the pack route: pass the "
                                   "packed sequences' offsets as cu_seqlens (transformers' cu_seq_lens_q)")
        if cu_seqlens is not None:
            op["cu_seqlens"] = cu_seqlens
        op.update((name, value) for name, value in extra.items() if name in _OP_ARGUMENTS)
        return op


def _contiguous(t):
    return t.contiguous() if hasattr(t, "contiguous") else t


def _family_of(model) -> Family:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in _fla_layout_types():
        raise RouteError(f"model_type={model_type!r} is FLA's own layout: its layers call FLA's op, not "
                         f"transformers'; use flashqla_tune.register_fla_backend(PACK) for it")
    raise RouteError(f"model_type={model_type!r} is not a family the transformers route knows (registered: "
                     f"{', '.join(sorted(FAMILIES))}); flashqla_tune.integrations.transformers.register_family "
                     f"adds one")


def _checkpoint_folder(model, checkpoint) -> Path:
    if checkpoint is None:
        name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
        folder = Path(name) if name else None
        if folder is None or not folder.is_dir():
            raise PackError(f"cannot tell which checkpoint the model's weights are: its name_or_path {name!r} is "
                            f"not a local folder; pass checkpoint=FOLDER (the folder the pack was built from)")
        return folder
    folder = Path(checkpoint)
    if not folder.is_dir():
        raise PackError(f"checkpoint={str(checkpoint)!r} is not a folder")
    return folder


def check_checkpoint(pack_ops, folder: Path) -> str:
    """The folder's checkpoint sha256 (config and weights, cached by size and mtime as the build's
    hash is); raises PackError when the pack was built for another checkpoint."""
    from ..content_hash import checkpoint_hash
    from ..calibration_settings import CalibrationError

    try:
        sha = checkpoint_hash(folder)
    except CalibrationError as exc:
        raise PackError(f"cannot hash checkpoint {folder}: {exc}") from exc
    want = pack_ops.manifest.checkpoint_sha256
    if sha != want:
        raise PackError(f"pack {getattr(pack_ops, 'pack', '?')} was built for checkpoint {want[:16]} "
                        f"({pack_ops.manifest.checkpoint_path}), not for {folder} ({sha[:16]}): build a pack for "
                        f"this checkpoint (flashqla-tune build {folder})")
    return sha


def _gdn_layers(model, pack_ops, family: Family, module) -> tuple[dict[int, int], list]:
    cls = getattr(module, family.layer_class, None)
    if not isinstance(cls, type):
        raise RouteError(f"{family.modeling} has no class {family.layer_class!r} "
                         f"(transformers {_transformers_version()})")
    modules = [m for m in model.modules() if isinstance(m, cls)]
    by_decoder = {}
    for m in modules:
        index = getattr(m, "layer_idx", None)
        if not isinstance(index, int) or index in by_decoder:
            raise RouteError(f"GDN module {type(m).__name__} has layer_idx {index!r}: expected one distinct "
                             f"decoder-layer index per GDN layer")
        by_decoder[index] = m
    calibrated = {ls.decoder_layer: ls.layer for ls in pack_ops.calibration.layers}
    if sorted(by_decoder) != sorted(calibrated):
        raise RouteError(f"the model's GDN layers sit at decoder layers {sorted(by_decoder)}, the pack's "
                         f"calibration at {sorted(calibrated)}: the pack is for another model")
    return calibrated, [by_decoder[i] for i in sorted(by_decoder)]


def use_pack(model, pack, *, checkpoint=None, tp_rank: int = 0, tp_size: int = 1) -> PackRoute:
    """Route `model`'s GDN chunked prefill onto a kernel pack; returns an open PackRoute (close() it
    or use it as a context manager to undo).

    model: a transformers model of a registered family (FAMILIES, from model_config's registry:
    Qwen3-Next, Qwen3.5 and its MoE, dense or text-only, and OLMo-Hybrid), on an sm_90 GPU in bf16 or
    fp16 when it runs. pack: what
    `flashqla_tune.load(PACK)` returns, or a pack folder (loaded with tp_rank/tp_size).
    checkpoint: the checkpoint folder of the model's weights (default: model.name_or_path); its
    sha256 must be the one the pack was built for. Each routed call runs
    `pack.chunk_gated_delta_rule(..., layer=i)` with the calling layer's own calibration; decode
    steps (transformers' recurrent function) stay on transformers' path. Models of FLA's own
    layout keep the FLA backend (flashqla_tune.register_fla_backend)."""
    family = _family_of(model)
    if isinstance(pack, (str, Path)):
        from ..packed_ops import load

        pack = load(pack, tp_rank, tp_size)
    check_checkpoint(pack, _checkpoint_folder(model, checkpoint))
    module = importlib.import_module(family.modeling)
    layers, modules = _gdn_layers(model, pack, family, module)
    route = PackRoute(model, pack, family, layers, modules)
    route._open_on(module)
    return route


__all__ = ["CHUNK_FUNCTION", "FAMILIES", "Family", "PackRoute", "RouteError", "check_checkpoint",
           "register_family", "use_pack"]
