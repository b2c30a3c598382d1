"""JIT warm-up in parallel processes, one per head configuration. FlashQLA's TileLang kernels
are compiled per head count (H is a compile-time constant) and FLA's Triton kernels per shape;
both keep compiled binaries in an on-disk cache, so compiling every configuration at once on
the host's cores before the timed run (one process) saves most of the compile wall time.
Run as: python -m flashqla_tune.bench.prewarm --heads 16/64 --seqlens 1x32768 ... --impl fla"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from ..measure.cases import format_seqlens, select_cases
from ..measure.impls import call, load_impls
from ..measure.inputs import make_inputs


def prewarm_parallel(head_configs, seqlens, impl_names, timeout_s: float, log=print) -> str:
    """Start one process per head configuration; wait; return a one-line summary."""
    if not head_configs or not impl_names:
        return "nothing to prewarm"
    t0 = time.perf_counter()
    procs = []
    for hq, hv in head_configs:
        cmd = [sys.executable, "-m", "flashqla_tune.bench.prewarm", "--heads", f"{hq}/{hv}"]
        for s in seqlens:
            cmd += ["--seqlens", format_seqlens(tuple(s))]
        for name in impl_names:
            cmd += ["--impl", name]
        # FLA writes its Triton autotune picks to disk by default (FLA_CACHE_RESULTS=1); picks made
        # while 8 processes share the GPU are wrong for the timed run, so only binaries are cached.
        env = {**os.environ, "FLA_CACHE_RESULTS": "0"}
        procs.append((f"{hq}/{hv}", subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True, env=env)))
    failed = wait_for(procs, t0 + timeout_s, log)
    took = time.perf_counter() - t0
    return (f"{len(procs)} processes, {took:.0f} s wall" + (f"; problems: {', '.join(failed)}" if failed else ""))


def wait_for(procs, deadline: float, log, tail: int | None = None) -> list[str]:
    """Waits for (label, Popen with stdout piped) pairs until `deadline` (time.perf_counter), kills
    what outlives it, logs each one's output as `[prewarm LABEL] line` (its last `tail` lines when
    given) and returns the problems ("LABEL timed out", "LABEL rc=N")."""
    problems = []
    for label, proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            problems.append(f"{label} timed out")
        if proc.returncode:
            problems.append(f"{label} rc={proc.returncode}")
        lines = (out or "").splitlines()
        for line in lines[-tail:] if tail else lines:
            log(f"[prewarm {label}] {line}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashqla_tune.bench.prewarm")
    ap.add_argument("--heads", action="append", required=True)
    ap.add_argument("--seqlens", action="append")
    ap.add_argument("--impl", action="append", required=True)
    args = ap.parse_args(argv)
    impls, skipped = load_impls(args.impl)
    for name, why in skipped.items():
        print(f"skip {name}: {why}")
    with torch.no_grad():
        for case in select_cases(args.heads, args.seqlens):
            x = make_inputs(case, "cuda")
            for impl in impls:
                t0 = time.perf_counter()
                try:
                    call(impl, x)
                    torch.cuda.synchronize()
                    print(f"{case.name} {impl.name} first call {time.perf_counter() - t0:.1f} s", flush=True)
                except Exception as exc:
                    print(f"{case.name} {impl.name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
