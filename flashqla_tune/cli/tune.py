"""flashqla-tune tune: Optuna search over the tile parameters of a checkpoint's (or a spec's)
plans on this GPU; the study persists in the cache, so a rerun resumes it."""
from __future__ import annotations

from .compile import add_spec_arguments, specs_for


def add_parser(sub):
    p = sub.add_parser("tune", help="tune tile parameters on this GPU (resumable Optuna study per spec and GPU)")
    add_spec_arguments(p, l2norm_help="(kept for spec parity; the binary is the same)")
    p.add_argument("--budget", type=float, default=600.0,
                   help="seconds per spec, checked between build batches (default 600)")
    p.add_argument("--trials", type=int, help="at most this many configs built and measured per spec and call")
    p.add_argument("--jobs", type=int, help="parallel nvcc processes = trials per build batch (default: cores)")
    p.add_argument("--seed", type=int, help="sampler seed (reproducible only for a lone worker)")
    p.add_argument("--study-dir", help="folder of the journal files (default: <cache>/tuning); share it "
                                       "between workers on several GPUs or machines")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args) -> int:
    from ..tune.driver import require_tuning_gpu, tune_spec
    from ..tune.report import table

    for name in ("budget", "trials", "jobs"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name}={value} must be positive")
    specs = specs_for(args)
    gpu = require_tuning_gpu()
    for spec in specs:
        res = tune_spec(spec, gpu.name, budget_s=args.budget, max_trials=args.trials, jobs=args.jobs,
                        seed=args.seed, root=args.study_dir, progress=not args.no_progress)
        print(table(res))
    return 0
