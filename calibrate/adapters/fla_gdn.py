"""FLA's `gated_deltanet` layout, run on the CPU with the same layer math in PyTorch.

FLA's own layers need Triton kernels, so this adapter re-states GatedDeltaNetBlock's forward
(fla/layers/gated_deltanet.py and fla/models/gated_deltanet) with plain torch ops and our
float64 chunked oracle for the recurrence:
    x -> attn_norm -> [q,k,v]_proj -> causal depthwise conv + SiLU (short conv)
      -> g = -exp(A_log) softplus(a_proj x + dt_bias), beta = sigmoid(b_proj x) (x2 with
         allow_neg_eigval) -> delta rule with in-kernel q/k L2 norm
      -> RMSNorm(o) * w * silu(g_proj x) -> o_proj -> residual; mlp_norm -> SwiGLU MLP -> residual.
Hybrid softmax-attention layers (config `attn`) run as causal GQA attention with RoPE.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...oracle import chunk_gated_delta_rule_chunked
from ...calibration_settings import CalibrationError
from .base import GDNAdapter


def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def short_conv(x, weight):
    """Causal depthwise conv over time with SiLU: x [B, T, D], weight [D, 1, W]."""
    W = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight, groups=weight.shape[0])
    return F.silu(y).transpose(1, 2)


def rope(x, theta):
    """Rotate-half RoPE over the full head dim: x [B, T, H, D]."""
    T, D = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D))
    freqs = torch.arange(T, dtype=torch.float32, device=x.device)[:, None] * inv[None]
    cos, sin = (torch.cat([f, f], -1)[None, :, None, :] for f in (freqs.cos(), freqs.sin()))
    x1, x2 = x.float().chunk(2, -1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class FLAGatedDeltaNetAdapter(GDNAdapter):
    family = "fla_gated_deltanet"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from ...model_config import load_config_json

        self.cfg = load_config_json(self.checkpoint)
        self.eps = float(self.cfg.get("norm_eps", 1e-6))
        self.use_gate = bool(self.cfg.get("use_gate", True))
        self.use_short_conv = bool(self.cfg.get("use_short_conv", True))
        self.neg_eigval = bool(self.cfg.get("allow_neg_eigval", False))
        attn = self.cfg.get("attn") or {}
        self.attn_cfg = attn[0] if isinstance(attn, list) and attn else attn
        if self.device.type != "cpu":
            self.device = torch.device("cpu")   # the oracle recurrence is the CPU path

    def _gdn_names(self, i):
        base = f"model.layers.{i}.attn."
        names = ["q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "o_proj"]
        if self.use_gate:
            names.append("g_proj")
        return base, names

    def check(self) -> None:
        s, D = self.model.spec, self.model.hidden_size
        self.weights.require("model.embeddings.weight", "token embedding")
        for i in self.model.gdn_layers:
            base, _ = self._gdn_names(i)
            for p in ("A_log", "dt_bias"):
                name = base + p
                self.weights.require(name, f"GDN layer {i} gate parameter {p}")
                if self.weights.shapes[name] != (s.num_v_heads,):
                    raise CalibrationError(
                        f"head count mismatch: {name!r} has shape {self.weights.shapes[name]} but the config "
                        f"says {s.num_v_heads} v-heads (num_v_heads)")
            self.weights.require(base + "a_proj.weight", f"GDN layer {i} gate projection", (s.num_v_heads, D))
            self.weights.require(base + "q_proj.weight", f"GDN layer {i} q projection",
                                 (s.num_qk_heads * s.head_k_dim, D))
            self.weights.require(base + "v_proj.weight", f"GDN layer {i} v projection",
                                 (s.num_v_heads * s.head_v_dim, D))

    def embed(self, input_ids):
        if not hasattr(self, "_embed"):
            self._embed = self.weights.load(["model.embeddings.weight"], "cpu", self.dtype)["model.embeddings.weight"]
        return F.embedding(input_ids, self._embed)

    def _mlp(self, w, x):
        return F.linear(F.silu(F.linear(x, w["mlp.gate_proj.weight"])) * F.linear(x, w["mlp.up_proj.weight"]),
                        w["mlp.down_proj.weight"])

    def _gdn(self, w, x):
        s = self.model.spec
        B, T, _ = x.shape
        p = lambda n: F.linear(x, w[f"attn.{n}.weight"])  # noqa: E731
        q, k, v = p("q_proj"), p("k_proj"), p("v_proj")
        if self.use_short_conv:
            q, k, v = (short_conv(t, w[f"attn.{n}_conv1d.weight"]) for t, n in ((q, "q"), (k, "k"), (v, "v")))
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        g = self.gate(w["attn.A_log"], p("a_proj"), w["attn.dt_bias"])
        beta = p("b_proj").sigmoid() * (2.0 if self.neg_eigval else 1.0)
        o, _ = chunk_gated_delta_rule_chunked(
            q.view(B, T, s.num_qk_heads, s.head_k_dim), k.view(B, T, s.num_qk_heads, s.head_k_dim),
            v.view(B, T, s.num_v_heads, s.head_v_dim), g, beta, use_qk_l2norm_in_kernel=True)
        o = rms_norm(o.to(x.dtype), w["attn.o_norm.weight"], self.eps)
        if self.use_gate:
            o = o * F.silu(p("g_proj").view(B, T, s.num_v_heads, s.head_v_dim))
        return F.linear(o.reshape(B, T, -1), w["attn.o_proj.weight"]), g

    def _attention(self, w, x):
        B, T, D = x.shape
        nh = int(self.attn_cfg.get("num_heads", 16))
        nkv = int(self.attn_cfg.get("num_kv_heads") or nh)
        if self.attn_cfg.get("window_size"):
            raise CalibrationError("FLA sliding-window attention layers are not supported on the CPU path")
        hd = D // nh
        theta = float(self.attn_cfg.get("rope_theta", 10000.0))
        lin = lambda n: F.linear(x, w[f"attn.{n}.weight"], w.get(f"attn.{n}.bias"))  # noqa: E731
        q = rope(lin("q_proj").view(B, T, nh, hd), theta)
        k = rope(lin("k_proj").view(B, T, nkv, hd), theta)
        v = lin("v_proj").view(B, T, nkv, hd)
        k, v = (t.repeat_interleave(nh // nkv, dim=2) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return F.linear(o.transpose(1, 2).reshape(B, T, D), w["attn.o_proj.weight"])

    def load_layer(self, index):
        w = self.weights.load_prefix(f"model.layers.{index}.", "cpu", self.dtype)
        for key in ("attn_norm.weight", "mlp_norm.weight", "attn.o_proj.weight", "mlp.down_proj.weight"):
            if key not in w:
                raise CalibrationError(f"checkpoint {self.checkpoint} has no tensor 'model.layers.{index}.{key}'")
        is_gdn = index in self.model.gdn_layers

        @torch.no_grad()
        def run(hidden):
            h = rms_norm(hidden, w["attn_norm.weight"], self.eps)
            if is_gdn:
                mixed, g = self._gdn(w, h)
            else:
                mixed, g = self._attention(w, h), None
            hidden = hidden + mixed
            hidden = hidden + self._mlp(w, rms_norm(hidden, w["mlp_norm.weight"], self.eps))
            return hidden, g

        return run
