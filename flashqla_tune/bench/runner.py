"""Runs the scoreboard: per case, make the rotated protocol inputs once, then time every
implementation in each mode, take the floor and (on the smaller cases) accuracy. Results are
written after every case so a run cut short still leaves its rows."""
from __future__ import annotations

import gc
import time

import torch

from ..measure import accuracy, environment, floor
from ..measure.cases import Case
from ..measure.impls import Impl, call
from ..measure.inputs import make_rotation
from ..measure.timing import rotation_count
from . import report

PROTOCOL = ("q, k L2-normalised bf16; v bf16; g = logsigmoid(randn)/16 fp32, 25% of v-heads (fixed seed) "
            "g = 0; beta = sigmoid(randn) fp32; h0 fp32; K = V = 128; varlen B = 1; output_final_state on; "
            "scale 1/sqrt(128); FLA with FLA_DISABLE_BACKEND_DISPATCH=1; under torch.no_grad()")

NOT_REACHED = report.NOT_REACHED


def run(cases: list[Case], impls: list[Impl], skipped: dict[str, str], timer, *, modes=("graph", "eager"),
        device="cuda", ceilings: dict | None = None, accuracy_max_tokens: int = 8192,
        rotation_cap_bytes: int = 4 << 30, budget_s: float | None = None, out_dir=None,
        stem: str = "scoreboard", log=print, prewarm: str | None = None,
        impl_max_tokens: dict[str, int] | None = None) -> dict:
    """impl_max_tokens: {impl: N} runs that implementation only on rows of at most N tokens (for
    a short device budget: the PyTorch baseline is the slow one)."""
    env = environment.describe() if torch.cuda.is_available() else environment.describe(None)
    l2 = (env.get("gpu") or {}).get("l2_bytes") or 0
    results = {
        "meta": {"environment": env, "ceilings": ceilings, "modes": list(modes), "protocol": PROTOCOL,
                 "flops_per_token_head": floor.flops_per_chunk_head() / floor.CHUNK,
                 "l2_bytes": l2, "rotation_cap_bytes": rotation_cap_bytes, "prewarm": prewarm},
        "impls": {**{i.name: {"available": True, "version": i.version, "note": i.note} for i in impls},
                  **{n: {"available": False, "reason": r} for n, r in skipped.items()}},
        # Every row is listed from the start as not reached, so the table written after each row
        # still names the rows a run killed from outside (a device call's time limit) never ran.
        "rows": [{"heads": case.heads, "seqlens": case.seqlens_label, "lengths": list(case.seqlens),
                  "tokens": case.total_tokens, "times": {}, "error": NOT_REACHED} for case in cases],
    }
    t_start = time.perf_counter()
    with torch.no_grad():
        for idx, case in enumerate(cases):
            row = results["rows"][idx]
            del row["error"]
            if budget_s is not None and time.perf_counter() - t_start > budget_s:
                row["error"] = f"not run: the run's budget of {budget_s:.0f} s was spent"
                continue
            try:
                limits = impl_max_tokens or {}
                here = [i for i in impls if case.total_tokens <= limits.get(i.name, case.total_tokens)]
                for i in impls:
                    if i not in here:
                        row["times"][i.name] = {m: {"median_ms": None, "n": 0, "error": (
                            f"not run: rows over {limits[i.name]} tokens skipped for {i.name}")} for m in modes}
                _run_case(case, here, timer, modes, device, ceilings, l2, rotation_cap_bytes,
                          accuracy_max_tokens, row, log)
            except Exception as exc:  # one bad case (e.g. out of memory) must not lose the rest
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"[bench] {case.name}: {row['error']}")
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            log(f"[bench] {idx + 1}/{len(cases)} {case.name} {_summary(row, modes)} "
                f"({time.perf_counter() - t_start:.0f} s)")
            if out_dir is not None:
                report.write(results, out_dir, stem)
    results["meta"]["wall_s"] = time.perf_counter() - t_start
    if out_dir is not None:
        report.write(results, out_dir, stem)
    return results


def _run_case(case, impls, timer, modes, device, ceilings, l2, cap, acc_max_tokens, row, log):
    probe = make_rotation(case, 1, device)
    r = rotation_count(probe[0].nbytes(), l2, cap) if l2 else 1
    # All sets share one cu_seqlens object: FlashQLA's caches are keyed by identity.
    cu = (probe[0].cu_seqlens, probe[0].cu_seqlens_long, probe[0].cu_seqlens_cpu)
    sets = probe + (make_rotation(case, r - 1, device, seed=1, cu=cu) if r > 1 else [])
    row["rotation"] = len(sets)
    row["set_bytes"] = probe[0].nbytes()
    if ceilings:
        row["floor"] = floor.case_floor(case, ceilings)
    for impl in impls:
        times = row["times"].setdefault(impl.name, {})
        fn = lambda x, impl=impl: call(impl, x)  # noqa: E731
        t0 = time.perf_counter()
        try:
            timer.warmup(fn, sets)
        except Exception as exc:
            msg = f"warm-up failed: {type(exc).__name__}: {str(exc)[:300]}"
            for mode in modes:
                times[mode] = {"median_ms": None, "n": 0, "error": msg}
            log(f"[bench] {case.name} {impl.name}: {msg}")
            continue
        times["warmup_s"] = time.perf_counter() - t0
        for mode in modes:
            times[mode] = getattr(timer, mode)(fn, sets).to_dict()
    if case.total_tokens <= acc_max_tokens:
        row["accuracy"] = accuracy.measure(impls, sets[0])
    del sets, probe


def _summary(row, modes) -> str:
    parts = []
    for impl, t in row["times"].items():
        vals = "/".join("-" if not t.get(m) or t[m].get("median_ms") is None else f"{t[m]['median_ms']:.3f}"
                        for m in modes)
        parts.append(f"{impl}={vals}")
    return " ".join(parts)
