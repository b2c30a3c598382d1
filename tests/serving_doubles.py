"""Test doubles for the serving routes (never used outside tests): stand-ins of the vLLM and
SGLang pieces the routes touch, shaped as tests/fixtures/serving_call_sites.py records them and
installed into sys.modules only through a test's monkeypatch, and a pack test double whose op
runs the float64 oracle."""
from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from pathlib import Path

import torch

from flashqla_tune import ops
from flashqla_tune.integrations import sglang as sglang_route
from flashqla_tune.integrations import vllm as vllm_route
from flashqla_tune.oracle import recurrent_gated_delta_rule

_spec = importlib.util.spec_from_file_location(
    "serving_call_sites", Path(__file__).resolve().parent / "fixtures" / "serving_call_sites.py")
SITES = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(SITES)


class PackOpsDouble:
    """Stands in for flashqla_tune.load(PACK): the calibration's decoder_layer map (GDN layer l
    sits at decoder layer 2l + 1), the plans' state layouts, and an op that runs the float64
    oracle and records each call's keyword arguments."""

    def __init__(self, layers=3, layouts=("vk",), refuse=None):
        self.calibration = types.SimpleNamespace(
            layers=[types.SimpleNamespace(layer=i, decoder_layer=2 * i + 1) for i in range(layers)])
        self.plans = [types.SimpleNamespace(plan=types.SimpleNamespace(spec=types.SimpleNamespace(state_layout=s)))
                      for s in layouts]
        self.calls = []
        self.refuse = refuse

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *, layer=None,
                               **options):
        self.calls.append(dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               state_v_first=state_v_first, cu_seqlens=cu_seqlens, layer=layer, **options))
        if self.refuse:
            raise ops.UnsupportedError(self.refuse)
        assert not options, options
        o, final = recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                              use_qk_l2norm_in_kernel, state_v_first, cu_seqlens)
        return o.to(q.dtype), None if final is None else final.float()


def loader_of(pack_ops):
    def load(pack, tp_rank, tp_size):
        load.seen.append((pack, tp_rank, tp_size))
        return pack_ops
    load.seen = []
    return load


def _params(records):
    return [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              default=inspect.Parameter.empty if d == SITES.REQUIRED else d) for n, d in records]


def install_vllm_stand_ins(monkeypatch, registry_on="module"):
    """vLLM's pieces the route touches, shaped as the fixture records them: CustomOp with its
    out-of-tree registry keyed by class name (a module global as in newer vLLM, or with
    registry_on="class" a class attribute as in older ones), ChunkGatedDeltaRule with its backend
    methods (the FlashInfer one records its calls), and the forward context's no_compile_layers."""
    custom_op = types.ModuleType(vllm_route.CUSTOM_OP_MODULE)
    op_registry_oot: dict = {}

    class CustomOp(torch.nn.Module):
        op_registry: dict = {}

        def __new__(cls, *args, **kwargs):
            return super().__new__(op_registry_oot.get(cls.__name__, cls))

        def __init__(self):
            super().__init__()
            self._forward_method = self.forward_cuda

        def forward(self, *args, **kwargs):
            return self._forward_method(*args, **kwargs)

        @classmethod
        def register(cls, name):
            def decorate(op_cls):
                op_cls.name = name
                cls.op_registry[name] = op_cls
                return op_cls
            return decorate

        @classmethod
        def register_oot(cls, op_cls=None, name=None):
            assert name not in op_registry_oot, f"Duplicate op name: {name}"
            op_cls.name = name
            op_registry_oot[name] = op_cls
            return op_cls

    if registry_on == "module":
        custom_op.op_registry_oot = op_registry_oot
    else:
        CustomOp.op_registry_oot = op_registry_oot
    custom_op.CustomOp = CustomOp
    layer_module = types.ModuleType(vllm_route.GDN_LAYER_MODULE)
    fallback_calls = []
    signature = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
                                  + _params(SITES.VLLM["op"]["parameters"]))

    @CustomOp.register(SITES.VLLM["op"]["registered_as"])
    class ChunkGatedDeltaRule(CustomOp):
        def forward_cuda(self, *args, **kwargs):
            fallback_calls.append(signature.bind(self, *args, **kwargs).arguments)
            return "flashinfer-output", "flashinfer-state"

    layer_module.ChunkGatedDeltaRule = ChunkGatedDeltaRule
    forward_context = types.ModuleType(vllm_route.FORWARD_CONTEXT_MODULE)
    forward_context.layers = {}
    forward_context.get_forward_context = lambda: types.SimpleNamespace(no_compile_layers=forward_context.layers)
    for name, module in ((vllm_route.CUSTOM_OP_MODULE, custom_op), (vllm_route.GDN_LAYER_MODULE, layer_module),
                         (vllm_route.FORWARD_CONTEXT_MODULE, forward_context)):
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(CustomOp=CustomOp, ChunkGatedDeltaRule=ChunkGatedDeltaRule, registry=op_registry_oot,
                                 fallback_calls=fallback_calls, forward_context=forward_context)


def gdn_layer(fake, name):
    """A vLLM GDN layer stand-in registered under its module name, holding its op."""
    layer = types.SimpleNamespace(prefix=name, chunk_gated_delta_rule=fake.ChunkGatedDeltaRule())
    fake.forward_context.layers[name] = layer
    return layer


def install_sglang_stand_ins(monkeypatch):
    """SGLang's GDN backend as the fixture records it: a dispatcher whose extend slot holds the
    kernel the prefill backend chose (a Triton stand-in that records its calls), decode and
    verify kernels beside it, and forward_extend calling dispatcher.extend with keywords."""
    module = types.ModuleType(sglang_route.BACKEND_MODULE)

    class TritonKernelStandIn:
        supports_packed_decode = True

        def __init__(self):
            self.calls = []

        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, inplace_update=True,
                   **kwargs):
            self.calls.append(("extend", kwargs))
            return "triton-output", None, None

        def decode(self, *args, **kwargs):
            self.calls.append(("decode", kwargs))
            return "triton-decode"

    class GDNKernelDispatcher:
        def __init__(self, slot):
            kernel = TritonKernelStandIn()
            self.decode_kernel, self.verify_kernel = kernel, kernel
            setattr(self, slot, kernel)
            self.slot = slot

        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kwargs):
            return getattr(self, self.slot).extend(q, k, v, g, beta, ssm_states=ssm_states,
                                                   cache_indices=cache_indices, query_start_loc=query_start_loc,
                                                   **kwargs)

        def decode(self, *args, **kwargs):
            return self.decode_kernel.decode(*args, **kwargs)

    class GDNAttnBackend:
        def __init__(self, slot="extend_kernel"):
            self.kernel_dispatcher = GDNKernelDispatcher(slot)

        def forward_extend(self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
            """SGLang's extend: conv and gating done (the stand-in takes them from forward_batch)."""
            x = forward_batch
            core_attn_out, last_state, h = self.kernel_dispatcher.extend(
                q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, ssm_states=x.pool, cache_indices=x.cache_indices,
                query_start_loc=x.query_start_loc, **x.extra)
            forward_batch.returned = (last_state, h)
            return core_attn_out

    module.GDNAttnBackend, module.GDNKernelDispatcher = GDNAttnBackend, GDNKernelDispatcher
    monkeypatch.setitem(sys.modules, sglang_route.BACKEND_MODULE, module)
    original = GDNAttnBackend.forward_extend
    monkeypatch.setattr(GDNAttnBackend, "forward_extend", original)  # restored at teardown, whatever installs
    return types.SimpleNamespace(GDNAttnBackend=GDNAttnBackend, original=original)
