"""flashqla-tune info [CHECKPOINT]: the environment, and a checkpoint's GDN layers."""
from __future__ import annotations

import json

from .. import environment
from ..model_config import read_model_config


def add_parser(sub):
    p = sub.add_parser("info", help="show GPU, nvcc, CUTLASS and cache; with a checkpoint, its GDNSpec per layer")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (or its config.json)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def run(args) -> int:
    env = environment.describe()
    model = read_model_config(args.checkpoint) if args.checkpoint else None
    if args.json:
        out = {"environment": env}
        if model is not None:
            out["model"] = {"family": model.family, "model_type": model.model_type,
                            "num_layers": model.num_layers, "gdn_layers": list(model.gdn_layers),
                            "spec": model.spec.to_dict(), "spec_name": model.spec.name}
        print(json.dumps(out, indent=2))
        return 0
    gpu = env["gpu"]
    print(f"torch     {env['torch']}")
    print("gpu       " + (f"{gpu['name']} ({gpu['arch']}, {gpu['sm_count']} SMs, driver {gpu['driver']})"
                          if gpu else "none (kernels can be built here, not run)"))
    nvcc, cutlass = env["nvcc"], env["cutlass"]
    print("nvcc      " + (f"{nvcc['version']} at {nvcc['path']}" if "version" in nvcc else nvcc["error"]))
    print("cutlass   " + (f"{cutlass['version']} headers at {cutlass['include']}" if "version" in cutlass
                          else cutlass["error"]))
    print(f"cache     {env['cache']}")
    if model is not None:
        s = model.spec
        print(f"\ncheckpoint {args.checkpoint}: {model.family} ({model.model_type}), "
              f"{model.num_gdn_layers} GDN of {model.num_layers} layers")
        print(f"  spec {s.name}: Hqk={s.num_qk_heads} Hv={s.num_v_heads} K={s.head_k_dim} V={s.head_v_dim} "
              f"C={s.chunk_size} gate={s.gate_kind} qkv={s.qkv_dtype} state={s.state_layout} "
              f"beta<={s.beta_max} l2norm_in_kernel={s.qk_l2norm_in_kernel}")
        print("  layer  kind    spec")
        gdn = set(model.gdn_layers)
        for i in range(model.num_layers):
            print(f"  {i:5d}  {'GDN ' if i in gdn else 'attn'}    {s.name if i in gdn else '-'}")
    return 0
