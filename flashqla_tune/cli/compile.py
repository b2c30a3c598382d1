"""flashqla-tune compile: build the default plans for a spec or a checkpoint into the cache."""
from __future__ import annotations

import dataclasses
import json

DEFAULT_DTYPE, DEFAULT_STATE_LAYOUT = "bfloat16", "kv"


def add_kernel_form_arguments(p) -> None:
    """The kernels' tensor types: q/k/v dtype and state layout (`compile`, `tune` and `build`)."""
    from ..supported_shapes import SUPPORTED

    p.add_argument("--dtype", choices=SUPPORTED.qkv_dtypes,
                   help=f"q/k/v dtype (default: the checkpoint's, else {DEFAULT_DTYPE})")
    p.add_argument("--state-layout", choices=SUPPORTED.state_layouts,
                   help=f"kv: [N,Hv,K,V]; vk: [N,Hv,V,K], state_v_first (default: the layout the checkpoint "
                        f"family's GDN layer calls with, vk for FLA's layer and kv for transformers'; "
                        f"{DEFAULT_STATE_LAYOUT} without a checkpoint)")


def add_spec_arguments(p, l2norm_help: str = "normalise q and k in the kernel") -> None:
    """The arguments that name the specs to work on (a checkpoint, or heads and types); `tune` shares them."""
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (or its config.json); else give --hqk/--hv")
    p.add_argument("--hqk", type=int, help="q/k heads")
    p.add_argument("--hv", type=int, help="v heads")
    add_kernel_form_arguments(p)
    p.add_argument("--qk-l2norm", action="store_true", help=l2norm_help)


def add_parser(sub):
    p = sub.add_parser("compile", help="build the default kernel plans for a spec or a checkpoint")
    add_spec_arguments(p)
    p.add_argument("--jobs", type=int, help="parallel nvcc processes (default: cores)")
    p.add_argument("--force", action="store_true", help="rebuild even when the cache has the entry")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def with_kernel_form(spec, args):
    """spec with the --dtype and --state-layout the command line gave."""
    changes = {k: v for k, v in (("qkv_dtype", args.dtype), ("state_layout", args.state_layout)) if v is not None}
    return dataclasses.replace(spec, **changes) if changes else spec


def checkpoint_spec(checkpoint, args):
    """A checkpoint's spec with the command line's kernel form, refused (naming the value) where the
    supported-shape table has no kernel for it (a checkpoint dtype the kernels do not take, unless
    --dtype names the one to build): reads config.json only."""
    from ..model_config import read_model_config
    from ..supported_shapes import check_checkpoint_dtype, check_model, check_spec

    model = read_model_config(checkpoint)
    check_model(model, str(checkpoint))
    check_checkpoint_dtype(model, args.dtype, str(checkpoint))
    spec = with_kernel_form(model.spec, args)
    check_spec(spec, str(checkpoint))
    return spec


def specs_for(args) -> list:
    """The specs to build: a checkpoint's (plus its Hqk = Hv form for GVA models), or the flags'."""
    from ..spec import GDNSpec
    from ..supported_shapes import check_spec

    if args.checkpoint:
        if args.hqk is not None or args.hv is not None:
            raise ValueError("give either a checkpoint or --hqk/--hv, not both")
        spec = checkpoint_spec(args.checkpoint, args)
        # Callers that repeat q/k up to Hv heads before the call need the Hqk = Hv binary too.
        specs = [spec]
        if spec.num_qk_heads != spec.num_v_heads:
            specs.append(spec.with_heads(spec.num_v_heads, spec.num_v_heads))
        return specs
    if args.hqk is None or args.hv is None:
        raise ValueError("compile needs a checkpoint or both --hqk and --hv")
    spec = GDNSpec(num_qk_heads=args.hqk, num_v_heads=args.hv, qkv_dtype=args.dtype or DEFAULT_DTYPE,
                   state_layout=args.state_layout or DEFAULT_STATE_LAYOUT, qk_l2norm_in_kernel=args.qk_l2norm)
    check_spec(spec, f"--hqk {args.hqk} --hv {args.hv}")   # before any template is rendered
    return [spec]


def _kernels(resources: dict) -> dict:
    return {name: r for name, r in resources.items() if r.get("entry")}


def run(args) -> int:
    import sys

    from ..pack_build import compile_plans
    from ..plan import default_plan

    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs={args.jobs} must be at least 1")
    plans = [default_plan(s) for s in specs_for(args)]
    entries = compile_plans(plans, jobs=args.jobs, force=args.force, progress=not args.no_progress,
                            log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps([{"plan": e.plan.name, "path": str(e.path), "built": e.built,
                           "build_seconds": e.build_seconds, "resources": e.resources} for e in entries], indent=2))
        return 0
    for e in entries:
        when = f"built in {e.build_seconds:.1f} s" if e.built else "cached"
        print(f"{e.plan.name}\n  {e.path}\n  {when}")
        for name, r in _kernels(e.resources).items():
            serial = f"; WGMMA SERIALIZED by ptxas ({r['wgmma_serialized']})" if r.get("wgmma_serialized") else ""
            print(f"  {name}: {r.get('registers', '?')} registers, spill {r.get('spill_stores', 0)} B stores / "
                  f"{r.get('spill_loads', 0)} B loads, stack {r.get('stack_frame', 0)} B, "
                  f"smem {r.get('smem', 0)} B static{serial}")
    return 0
