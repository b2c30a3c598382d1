"""flashqla-tune bench: the scoreboard (DESIGN.md, "Benchmark protocol") against FLA, FlashQLA,
FlashInfer, cuDNN (listed with the reason where it does not run) and a plain PyTorch baseline;
writes a markdown table and a JSON file."""
from __future__ import annotations

import argparse

from ..measure.cases import ROW_SETS


def add_parser(sub):
    p = sub.add_parser("bench", help="time implementations of the op on the protocol's cases (needs a GPU)",
                       description=" ".join(__doc__.split()))
    p.add_argument("--impl", action="append", metavar="NAME",
                   help="implementation to time (repeatable; default: every one that imports): fla, "
                        "flashqla, flashinfer (FlashInfer's GDN prefill as vLLM calls it), cudnn (cuDNN "
                        "frontend's GDN; skipped with cuDNN's reason where no engine serves the GPU), torch, "
                        "flashqla_tune (the op's default: guarded default window), "
                        "flashqla_tune_single_chain (no context parallelism), flashqla_tune_warmup (context "
                        "parallel, calibrated warm-up), flashqla_tune_exact_cp (context parallel, warmup all -1)")
    p.add_argument("--heads", action="append", metavar="HQK/HV", help="head configuration (repeatable), e.g. 16/64")
    p.add_argument("--seqlens", action="append", metavar="MIX", help="length mix (repeatable), e.g. 1x32768, 28672+4096")
    p.add_argument("--rows", choices=ROW_SETS, default="protocol",
                   help="row set: protocol (the default: the protocol's 8 head configurations x 10 length "
                        "mixes, the tuner's mix), all (with the users' head configurations 2/4, 4/8, 16/128, "
                        "32/32 and the scoreboard-only lengths 1x65536, 1x131072), users (the rows of all that "
                        "protocol lacks); --heads and --seqlens replace the set's lists")
    p.add_argument("--quick", action="store_true", help="a quick subset: 2/8 and 16/64 on 1x2048, 1x32768, 1024+7168")
    p.add_argument("--out", metavar="DIR", help="folder for scoreboard.md and scoreboard.json")
    p.add_argument("--stem", default="scoreboard", help="output file name stem (default: scoreboard)")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True, help="CUDA-graph replay timing")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="eager timing")
    p.add_argument("--accuracy-max-tokens", type=int, default=8192, metavar="N",
                   help="measure accuracy on cases of at most N tokens (0: never; default 8192)")
    p.add_argument("--budget-s", type=float, metavar="S",
                   help="start no new case S seconds after the start (prewarm included)")
    p.add_argument("--prewarm", action="store_true",
                   help="compile FLA/FlashQLA kernels for every head configuration in parallel processes first")
    p.add_argument("--sample-budget-s", type=float, default=0.3, metavar="S",
                   help="time spent per measurement beyond the 10-sample minimum (default 0.3)")
    p.add_argument("--join", action="append", metavar="JSON",
                   help="no timing (no GPU needed): join scoreboard JSON files of disjoint rows (repeatable, two "
                        "or more) into one scoreboard with one summary, written to --out as --stem")
    p.add_argument("--torch-max-tokens", type=int, metavar="N",
                   help="time the PyTorch baseline only on rows of at most N tokens (short device budgets)")
    return p


def run(args) -> int:
    if args.join:
        return _join(args)
    import time

    import torch

    from ..bench import report, runner
    from ..measure import floor
    from ..measure.cases import select_cases
    from ..measure.impls import load_impls
    from ..measure.timing import CudaTimer

    modes = tuple(m for m, on in (("graph", args.graph), ("eager", args.eager)) if on)
    if not modes:
        raise ValueError("both --no-graph and --no-eager given: nothing to time")
    cases = select_cases(args.heads, args.seqlens, args.quick, args.rows)
    if not torch.cuda.is_available():
        raise RuntimeError("flashqla-tune bench needs a CUDA GPU (torch.cuda.is_available() is False)")
    impls, skipped = load_impls(args.impl)
    for name, why in skipped.items():
        print(f"[bench] skipping {name}: {why}", flush=True)
    if not impls:
        raise RuntimeError(f"no implementation could be loaded: {skipped}")
    t0 = time.perf_counter()
    prewarm = None
    if args.prewarm:
        from ..bench.prewarm import prewarm_parallel
        heads = sorted({(c.num_qk_heads, c.num_v_heads) for c in cases})
        lens = sorted({c.seqlens for c in cases})
        names = [i.name for i in impls if i.name in ("fla", "flashqla")]
        ours = [i.name for i in impls if i.name.startswith("flashqla_tune")]
        # Our plans build in one parallel ninja run beside the anchors' compile processes.
        builder = _start_plan_build(heads) if ours else None
        prewarm = prewarm_parallel(heads, lens, names, timeout_s=args.budget_s or 600)
        if builder is not None:  # a hung nvcc must not outlive the run's budget
            builder.join(timeout=None if args.budget_s is None else max(1.0, args.budget_s - (time.perf_counter() - t0)))
            prewarm += f"; our plans: {builder.outcome}"
        print(f"[bench] prewarm: {prewarm}", flush=True)
    ceilings = floor.measure_ceilings()
    print(f"[bench] ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    results = runner.run(cases, impls, skipped, CudaTimer(budget_s=args.sample_budget_s), modes=modes,
                         ceilings=ceilings, accuracy_max_tokens=args.accuracy_max_tokens,
                         budget_s=None if args.budget_s is None else args.budget_s - (time.perf_counter() - t0),
                         out_dir=args.out, stem=args.stem,
                         log=lambda m: print(m, flush=True), prewarm=prewarm,
                         impl_max_tokens=None if args.torch_max_tokens is None else {"torch": args.torch_max_tokens})
    print(report.render_markdown(results))
    return 0


def _join(args) -> int:
    import json
    from pathlib import Path

    from ..bench import report

    if not args.out:
        raise ValueError("--join writes a scoreboard: give --out DIR")
    parts = []
    for name in args.join:
        try:
            parts.append(json.loads(Path(name).read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--join {name}: not a readable scoreboard JSON ({exc})") from exc
    joined = report.join(parts, args.join)
    md, _ = report.write(joined, args.out, args.stem)
    print(md.read_text())
    return 0


def _start_plan_build(heads):
    """Build the default plan of every head configuration (bf16, the [N,Hv,K,V] state layout of
    the protocol) in a thread; .outcome says how it went once joined."""
    import threading
    import time

    from ..cache import get_kernels
    from ..ops import _spec
    from ..runtime import default_plan_for

    def build():
        t0 = time.perf_counter()
        try:  # a configuration without a valid plan fails on its own rows, not here
            plans = []
            for hq, hv in heads:
                try:
                    plans.append(default_plan_for(_spec(hq, hv, 128, 128, True, False)))
                except ValueError:
                    pass
            get_kernels(plans)
            thread.outcome = f"{len(plans)} built or cached in {time.perf_counter() - t0:.0f} s"
        except Exception as exc:  # the timed run builds (and reports) whatever failed here
            thread.outcome = f"build failed ({type(exc).__name__}: {str(exc)[:200]})"

    thread = threading.Thread(target=build, daemon=True)
    thread.outcome = "not finished"
    thread.start()
    return thread


def main(argv=None) -> int:
    """`python -m flashqla_tune.cli.bench ...`: the bench command alone, so a device script does not
    depend on importing every other subcommand."""
    import sys

    parser = argparse.ArgumentParser(prog="flashqla-tune")
    add_parser(parser.add_subparsers(dest="command", required=True)).set_defaults(_run=run)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
