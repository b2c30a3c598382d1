"""flashqla-tune build CHECKPOINT --out PACK: calibrate, plan, compile, tune and write a kernel pack.

It takes `calibrate`'s flags (add_calibration_arguments) and `compile`'s kernel form (--dtype,
--state-layout), or --calibration FILE to use a finished calibration of the same checkpoint."""
from __future__ import annotations

import json

from .calibrate import (add_calibration_arguments, calibration_run_options, calibration_settings,
                        check_calibration_sizes, given_calibration_flags)
from .compile import add_kernel_form_arguments, checkpoint_spec

DEFAULT_BUDGET_S = 480.0   # total tuning time when --budget is not given (a build's target is 15 min)


def add_parser(sub):
    p = sub.add_parser("build", help="checkpoint -> calibrated, compiled (and tuned, on a GPU) kernel pack")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--out", required=True, help="pack folder to write (replaced atomically)")
    p.add_argument("--tp", default="1", help="tensor-parallel degrees to carry binaries for, e.g. 1,2,4,8 (default 1)")
    add_kernel_form_arguments(p)
    p.add_argument("--no-tune", action="store_true", help="keep the default tiles (untuned sm_90a pack)")
    p.add_argument("--budget", type=float, help=f"tuning seconds in all (default {DEFAULT_BUDGET_S:g})")
    p.add_argument("--jobs", type=int, help="parallel nvcc processes (default: cores)")
    p.add_argument("--compare-anchors", action="store_true",
                   help="after tuning, time FLA and FlashQLA on the tuner's mixes too (their JIT compiles cost "
                        "minutes; `flashqla-tune bench` or `tune` compares them otherwise)")
    p.add_argument("--force", action="store_true", help="rebuild even when the pack is up to date")
    p.add_argument("--rehash", action="store_true",
                   help="hash every checkpoint file's content again instead of trusting a digest remembered for its "
                        "size and mtime (a tuned build always does)")
    p.add_argument("--calibration", metavar="FILE",
                   help="a finished calibration artifact (calibration.json) of this checkpoint to use instead of "
                        "calibrating; the calibration flags below do not apply then")
    add_calibration_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars or compile lines")
    p.add_argument("--json", action="store_true", help="print the build report as JSON instead of text")
    p.add_argument("--sign", metavar="KEY",
                   help="sign the pack with this Ed25519 private key (flashqla-tune keygen) into PACK/signature.json")
    return p


def run(args) -> int:
    for name in ("budget", "jobs"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be positive")
    check_calibration_sizes(args)
    if args.no_tune and args.budget is not None:
        raise ValueError("--budget has no effect with --no-tune")
    if args.no_tune and args.compare_anchors:
        raise ValueError("--compare-anchors has no effect with --no-tune")
    if args.calibration is not None and given_calibration_flags(args):
        raise ValueError(f"{', '.join(given_calibration_flags(args))}: no effect with --calibration (the "
                         f"artifact's corpus and settings apply; calibrate again to change them)")
    settings = None if args.calibration is not None else calibration_settings(args)
    if args.checkpoint is not None:
        checkpoint_spec(args.checkpoint, args)  # config.json against the supported-shape table, before any import
    signing_key = None
    if args.sign is not None:  # a key that cannot sign is refused before the build's work
        from ..pack_signing import load_private_key

        signing_key = load_private_key(args.sign)
    from ..pack_build import build_pack, parse_tp

    rep = build_pack(args.checkpoint, args.out, parse_tp(args.tp), tune=not args.no_tune,
                     budget_s=args.budget if args.budget is not None else DEFAULT_BUDGET_S, jobs=args.jobs,
                     force=args.force, rehash=args.rehash, corpus=args.corpus, progress=not args.no_progress,
                     compare_anchors=args.compare_anchors, settings=settings, calibration=args.calibration,
                     qkv_dtype=args.dtype, state_layout=args.state_layout, **calibration_run_options(args))
    signature = sign_built_pack(rep, args.sign, signing_key) if signing_key is not None else None
    if args.json:
        print(json.dumps({**report_dict(rep), "signature": None if signature is None else str(signature)}, indent=2))
        return 0
    m = rep.manifest
    if rep.reused:
        print(f"{rep.pack}: {rep.reason}; nothing rebuilt" + (f"; signed ({signature})" if signature else ""))
        return 0
    if signature is not None:
        print(f"{rep.pack}: signed ({signature})")
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in rep.seconds.items() if k != "hash")
    print(f"{rep.pack}: {m.target} pack for checkpoint {m.checkpoint_sha256[:16]} ({rep.reason}); {stages}")
    print_plans(m)
    print_context_parallel(m)
    host = m.host_extension
    print(f"  C++ host path: {host.so} (torch {host.torch}, {host.python_abi})" if host is not None else
          "  C++ host path: not compiled here (the pack's eager calls take the Python host path)")
    from .info import print_backward

    print_backward(m)
    return 0


def sign_built_pack(rep, key_path, key):
    """Sign the pack build_pack returned. A pack that was reused as up to date is signed only when
    it already carries a valid signature of this key: its recorded hashes sit in its own folder, so
    they cannot show that nobody replaced its files since this key last signed them."""
    from ..pack_signing import PackSignatureError, sign_pack, verify_pack

    if rep.reused:
        try:
            verify_pack(rep.pack, [key.public_key()], rep.manifest)
        except PackSignatureError as exc:
            raise PackSignatureError(f"{exc}. The pack was found up to date by its own recorded hashes, which "
                                     f"cannot show it was not replaced; rebuild it to sign it: flashqla-tune build "
                                     f"--force --sign {key_path}") from None
    return sign_pack(rep.pack, key_path)


def report_dict(rep) -> dict:
    """The build's outcome for --json: the pack, whether it was reused and why, seconds per stage,
    and the manifest as the pack stores it."""
    return {"pack": str(rep.pack), "reused": rep.reused, "reason": rep.reason,
            "seconds": {k: round(v, 3) for k, v in rep.seconds.items()}, "target": rep.manifest.target,
            "manifest": rep.manifest.to_dict()}


def print_plans(manifest) -> None:
    for p in manifest.plans:
        t = p.plan.tiles
        timing = ""
        if p.tuning and p.tuning.get("speedup_over_default"):
            timing = f", {p.tuning['speedup_over_default']:.3f}x the default tiles"
        print(f"  tp={p.tp_size} {p.form:<11} {p.plan.name}  (block_v={t.block_v} stages={t.stages} "
              f"regs={t.producer_regs}/{t.consumer_regs} ctas/SM={t.ctas_per_sm}{timing})")


def print_context_parallel(manifest) -> None:
    """The CP split each plan's segment table (stored in the pack) applies."""
    from ..warmup_tables import describe_splits

    if manifest.tuned:
        source = (f"the cost model on the pooled calibration for {manifest.gpu['name']}'s "
                  f"{manifest.gpu['sm_count']} SMs, refined by timing it there")
    else:
        source = "the pooled calibration, for an H200's 132 SMs"
    print(f"  context parallel (segment tables from {source}):")
    for p in manifest.plans:
        if p.segment_chunks is not None:
            print(f"    tp={p.tp_size} {p.form:<11} {describe_splits(p.segment_chunks)}")
