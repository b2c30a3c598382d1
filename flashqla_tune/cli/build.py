"""flashqla-tune build CHECKPOINT --out PACK: calibrate, plan, compile, tune and write a kernel pack."""
from __future__ import annotations

DEFAULT_BUDGET_S = 480.0   # total tuning time when --budget is not given (a build's target is 15 min)


def add_parser(sub):
    p = sub.add_parser("build", help="checkpoint -> calibrated, compiled (and tuned, on a GPU) kernel pack")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--out", required=True, help="pack folder to write (replaced atomically)")
    p.add_argument("--tp", default="1", help="tensor-parallel degrees to carry binaries for, e.g. 1,2,4,8 (default 1)")
    p.add_argument("--no-tune", action="store_true", help="keep the default tiles (untuned sm_90a pack)")
    p.add_argument("--budget", type=float, help=f"tuning seconds in all (default {DEFAULT_BUDGET_S:g})")
    p.add_argument("--jobs", type=int, help="parallel nvcc processes (default: cores)")
    p.add_argument("--compare-anchors", action="store_true",
                   help="after tuning, time FLA and FlashQLA on the tuner's mixes too (their JIT compiles cost "
                        "minutes; `flashqla-tune bench` or `tune` compares them otherwise)")
    p.add_argument("--force", action="store_true", help="rebuild even when the pack is up to date")
    p.add_argument("--corpus", help="calibration text file or folder (default: the shipped corpus)")
    p.add_argument("--seq-len", type=int, help="calibration tokens per sequence")
    p.add_argument("--max-sequences", type=int, help="calibration sequences")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def run(args) -> int:
    from ..pack_build import build_pack, parse_tp

    for name in ("budget", "jobs", "seq_len", "max_sequences"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be positive")
    if args.no_tune and args.budget is not None:
        raise ValueError("--budget has no effect with --no-tune")
    if args.no_tune and args.compare_anchors:
        raise ValueError("--compare-anchors has no effect with --no-tune")
    rep = build_pack(args.checkpoint, args.out, parse_tp(args.tp), tune=not args.no_tune,
                     budget_s=args.budget if args.budget is not None else DEFAULT_BUDGET_S, jobs=args.jobs,
                     force=args.force, corpus=args.corpus, seq_len=args.seq_len, max_sequences=args.max_sequences,
                     progress=not args.no_progress, compare_anchors=args.compare_anchors)
    m = rep.manifest
    if rep.reused:
        print(f"{rep.pack}: {rep.reason}; nothing rebuilt")
        return 0
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in rep.seconds.items() if k != "hash")
    print(f"{rep.pack}: {m.target} pack for checkpoint {m.checkpoint_sha256[:16]} ({rep.reason}); {stages}")
    for p in m.plans:
        t = p.plan.tiles
        timing = ""
        if p.tuning and p.tuning.get("speedup_over_default"):
            timing = f", {p.tuning['speedup_over_default']:.3f}x the default tiles"
        print(f"  tp={p.tp_size} {p.form:<11} {p.plan.name}  (block_v={t.block_v} stages={t.stages} "
              f"regs={t.producer_regs}/{t.consumer_regs} ctas/SM={t.ctas_per_sm}{timing})")
    print_context_parallel(m)
    host = m.host_extension
    print(f"  C++ host path: {host.so} (torch {host.torch}, {host.python_abi})" if host is not None else
          "  C++ host path: not compiled here (the pack's eager calls take the Python host path)")
    return 0


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
