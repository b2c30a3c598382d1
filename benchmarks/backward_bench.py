"""Forward plus backward of one GDN layer's op: the saving forward, then the backward, for ours,
FlashQLA and FLA on the protocol's inputs, in one process.

    python3 -P benchmarks/backward_bench.py OUT_DIR [--heads 2/8 --heads 16/16 ...] [--seqlens 1x2048 ...]
        [--impl flashqla_tune --impl flashqla --impl fla] [--fla-dispatch tilelang|off]
        [--accuracy-max-tokens 4096] [--budget-s 420] [--sample-budget-s 0.3] [--prewarm] [--graph]
        [--no-layer] [--profile]                         (repository root; h200_steps.sh backward-bench)
    python3 benchmarks/backward_bench.py OUT_DIR --join PART.json --join PART.json ...   (no GPU)

Rows: the scoreboard's ten length mixes (measure.cases.SEQLENS) at each --heads (default 2/8,
16/16, 16/32, 16/64), inputs as measure.inputs makes them (bf16 q/k/v, fp32 g/beta/h0, varlen),
with a bf16 output gradient and an fp32 final-state gradient drawn beside each input set. A step
is: gradients cleared, the forward with q, k, v, g, beta and h0 requiring grad and the final state
returned, then autograd's backward from (do, dht). Per implementation and row:
- eager step time, the median of synchronised steps (measure.timing.CudaTimer.eager) over the
  row's input sets;
- the step's peak memory: torch.cuda.max_memory_allocated() after a reset, less what was
  allocated before the step (inputs and gradients from earlier steps are freed first); and what
  was still allocated when the row started (earlier rows' leftovers: a leak shows here);
- on rows of at most --accuracy-max-tokens tokens, the relative L2 of dq, dk, dv, dg, dbeta and
  dh0 against float64 autograd of the chunked float64 forward (oracle.gradients, form "chunked"),
  with the gradient ceilings (CEILING: below 2e-2; 5e-2 for dbeta and dg);
- the reason, when a library is missing or fails on the row (the row goes on without it).
Also the one-layer figure: 16/32 heads on 1x32768, ms and tokens per second of the step (the
row's own numbers when it is in the grid, else timed after the grid). --graph adds the median
CUDA-graph replay of our step, its offsets on the device only (a failed capture is reported,
never fatal). --profile writes OUT_DIR/backward_profile.txt: torch.profiler's operators and
kernels by self CUDA time over one eager step of ours on the first row, after warm-up steps (the
aten:: rows are the torch work between our kernels). --budget-s stops starting rows in time for the tables to be written; --prewarm
first runs every row's step once per head configuration in parallel processes (JIT compiles:
FlashQLA's TileLang kernels per head count, FLA's Triton kernels, our plans).

FLA: the forward and backward of fla.ops.gated_delta_rule.chunk_gated_delta_rule. On Hopper with
Triton >= 3.4 and < 3.7.1 FLA's Triton chunk_bwd_dqkwg raises for gated inputs unless its TileLang
backend serves that kernel, which needs FLA's backend dispatch. --fla-dispatch tilelang (the
default) keeps dispatch on with the FlashQLA backend disabled (FLA_FLASH_QLA=0), so the column is
FLA's Triton kernels with that one kernel from FLA's TileLang backend, never FlashQLA (checked);
--fla-dispatch off sets FLA_DISABLE_BACKEND_DISPATCH=1 (the forward scoreboard's protocol), with
which such a Triton raises and the column is skipped with FLA's own reason.

Writes OUT_DIR/backward_bench.json and OUT_DIR/backward_bench.md (speedup = peer ms / ours ms per
row, geomean over the rows where both ran, rows where ours is slower, memory against the lower
of the peers that ran). Exit 0 when every row started ran ours with gradients below the ceilings,
1 when not, 2 without an sm_90 GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RESULT = "backward_bench.json"
TABLE = "backward_bench.md"
OURS = "flashqla_tune"
PEERS = ("flashqla", "fla")
IMPLS = (OURS, *PEERS)
DEFAULT_HEADS = ("2/8", "16/16", "16/32", "16/64")
LAYER_HEADS, LAYER_SEQLENS = "16/32", (32768,)
GRADIENTS = ("q", "k", "v", "g", "beta", "initial_state")
GRAD_NAMES = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
CEILING = {"dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dh0": 2e-2, "dg": 5e-2, "dbeta": 5e-2}
SETS_PER_ROW = 2


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder for backward_bench.json and .md")
    p.add_argument("--heads", action="append", help=f"h_qk/h_v (repeatable; default {' '.join(DEFAULT_HEADS)})")
    p.add_argument("--seqlens", action="append", help="a length mix, e.g. 1x32768 or 28672+4096 (repeatable; "
                                                      "default the scoreboard's ten)")
    p.add_argument("--impl", action="append", choices=IMPLS, help=f"implementations (default {' '.join(IMPLS)})")
    p.add_argument("--fla-dispatch", choices=("tilelang", "off"), default="tilelang",
                   help="FLA's backend dispatch: on with the FlashQLA backend disabled (default), or off")
    p.add_argument("--accuracy-max-tokens", type=int, default=4096,
                   help="check gradients against float64 on rows of at most this many tokens (0: none)")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no new row after this many seconds")
    p.add_argument("--sample-budget-s", type=float, default=0.3, help="timing budget per implementation and row")
    p.add_argument("--seed", type=int, default=0, help="first input set's seed")
    p.add_argument("--prewarm", action="store_true", help="JIT-compile every row's step first, one process per head")
    p.add_argument("--graph", action="store_true", help="also time our step as a CUDA-graph replay")
    p.add_argument("--profile", action="store_true", help="profile one eager step of ours (backward_profile.txt)")
    p.add_argument("--no-layer", action="store_true", help="skip the 16/32 1x32768 one-layer figure")
    p.add_argument("--join", action="append", metavar="JSON",
                   help="(no GPU) join the rows of two or more backward_bench.json into OUT_DIR's tables")
    p.add_argument("--prewarm-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from flashqla_tune.measure.cases import parse_heads, parse_seqlens

    try:
        args.heads = [parse_heads(h) for h in (args.heads or DEFAULT_HEADS)]
        args.seqlens = [parse_seqlens(s) for s in args.seqlens] if args.seqlens else None
    except ValueError as exc:
        p.error(str(exc))
    args.impl = list(dict.fromkeys(args.impl or IMPLS))
    if args.budget_s <= 0 or args.sample_budget_s <= 0 or args.accuracy_max_tokens < 0:
        p.error("--budget-s and --sample-budget-s must be positive, --accuracy-max-tokens not negative")
    return args


# --- the tables (pure functions, CPU-tested) -----------------------------------------------------
def speedup(ours_ms, peer_ms):
    """peer ms / ours ms (above 1: ours faster); None unless both are positive numbers."""
    if not ours_ms or not peer_ms or ours_ms <= 0 or peer_ms <= 0:
        return None
    return peer_ms / ours_ms


def geomean(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(rows: list[dict], ours: str = OURS, peers=PEERS) -> dict:
    """Per peer: the speedups per row, their geomean, the rows where ours is slower; and the rows
    whose step peak memory of ours exceeds the lower of the peers that ran there."""
    out = {}
    for peer in peers:
        pairs = [(r["name"], speedup(r["impls"].get(ours, {}).get("ms"), r["impls"].get(peer, {}).get("ms")))
                 for r in rows]
        pairs = [(n, s) for n, s in pairs if s is not None]
        out[peer] = {"rows": len(pairs), "geomean_speedup": geomean([s for _, s in pairs]),
                     "min_speedup": min((s for _, s in pairs), default=None),
                     "rows_ours_slower": [n for n, s in pairs if s < 1.0]}
    over = []
    for r in rows:
        mine = r["impls"].get(ours, {}).get("step_peak_bytes")
        theirs = [r["impls"][p]["step_peak_bytes"] for p in peers
                  if r["impls"].get(p, {}).get("step_peak_bytes") is not None]
        if mine is not None and theirs and mine > min(theirs):
            over.append(r["name"])
    out["memory_rows_above_lower_peer"] = over
    return out


def _ms(x):
    return f"{x:.3f}" if x is not None else "-"


def _ratio(x):
    return f"{x:.2f}x" if x is not None else "-"


def _mib(x):
    return f"{x / 2**20:.0f}" if x is not None else "-"


def markdown(result: dict) -> str:
    impls = result["impls"]
    peers = [p for p in PEERS if p in impls]
    head = (["row"] + [f"{n} ms" for n in impls] + [f"{p}/ours" for p in peers]
            + [f"{n} MiB" for n in impls] + ([f"{OURS} worst grad err"] if OURS in impls else []))
    lines = [f"# Forward + backward, eager ({(result.get('gpu') or {}).get('name', 'no GPU')})", "",
             f"- date {result['date']}, commit {result.get('commit')}", f"- versions: {result.get('versions')}",
             "- implementations: " + "; ".join(f"{n} ({v})" for n, v in result.get("notes", {}).items()),
             "- step: the saving forward (final state out), then the backward from (do, dht); "
             "X/ours = X's ms / our ms (above 1: ours faster); "
             "MiB = the step's peak above what was allocated before it",
             ""]
    if result.get("skipped"):
        lines += [f"- skipped: {n}: {why}" for n, why in result["skipped"].items()] + [""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [r["name"]] + [_ms(r["impls"].get(n, {}).get("ms")) for n in impls]
        cells += [_ratio(speedup(r["impls"].get(OURS, {}).get("ms"), r["impls"].get(p, {}).get("ms"))) for p in peers]
        cells += [_mib(r["impls"].get(n, {}).get("step_peak_bytes")) for n in impls]
        if OURS in impls:
            errs = r["impls"].get(OURS, {}).get("grad_errors")
            cells.append(f"{max(errs.values()):.2e}" if errs else "-")
        lines.append("| " + " | ".join(cells) + " |")
    s = result.get("summary", {})
    lines += ["", "## Summary", ""]
    for p in peers:
        q = s.get(p, {})
        lines.append(f"- {p}/ours geomean {_ratio(q.get('geomean_speedup'))} over {q.get('rows', 0)} rows, "
                     f"lowest {_ratio(q.get('min_speedup'))}; rows where ours is slower: "
                     f"{', '.join(q.get('rows_ours_slower', [])) or 'none'}")
    lines.append(f"- rows where our step's peak memory is above the lower peer's: "
                 f"{', '.join(s.get('memory_rows_above_lower_peer', [])) or 'none'}")
    if result.get("layer"):
        lines += ["", "## One GDN layer, 16/32 heads, 1x32768", "", "| impl | ms | tokens/s |", "|---|---|---|"]
        for n, v in result["layer"].items():
            lines.append(f"| {n} | {_ms(v.get('ms'))} | {v['tokens_per_s']:.3g} |" if v.get("ms")
                         else f"| {n} | - | {v.get('error', '-')} |")
    if result.get("graph"):
        g = result["graph"]
        lines += ["", f"- our step as a CUDA-graph replay: {g}"]
    failures = [f"{r['name']} {n}: {v['error']}" for r in result["rows"]
                for n, v in r["impls"].items() if v.get("error")]
    if failures:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")[:300]


# --- the implementations ---------------------------------------------------------------------
@dataclass(frozen=True)
class StepImpl:
    """A differentiable implementation at FLA's signature: fn(q, k, v, g, beta, scale=, initial_state=,
    output_final_state=, cu_seqlens=, cu_seqlens_cpu=) -> (o, final_state)."""
    name: str
    fn: object
    version: str | None
    note: str
    takes_cu_seqlens_cpu: bool = True


def set_fla_environment(mode: str) -> None:
    """What FLA reads at import (dispatch) and per call (its backends' switches)."""
    if mode == "off":
        os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    else:
        os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "0"
        os.environ["FLA_FLASH_QLA"] = "0"


def load_ours() -> StepImpl:
    import flashqla_tune
    from flashqla_tune.ops import chunk_gated_delta_rule
    return StepImpl(OURS, chunk_gated_delta_rule, flashqla_tune.__version__,
                    "our op, default plan; forward kernels, registered backward")


def load_flashqla() -> StepImpl:
    import flash_qla
    return StepImpl("flashqla", flash_qla.chunk_gated_delta_rule, getattr(flash_qla, "__version__", None),
                    "flash_qla.chunk_gated_delta_rule (TileLang forward and backward, auto CP)",
                    takes_cu_seqlens_cpu=False)


def load_fla(mode: str) -> StepImpl:
    if "fla" in sys.modules:
        raise ImportError("fla was imported before its backend environment was set")
    set_fla_environment(mode)
    import fla
    from fla import backends
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    disabled = getattr(backends, "_DISPATCH_DISABLED", None)
    if mode == "off":
        if disabled is not True:
            raise ImportError("FLA's backend dispatch is not disabled: the column would not be FLA's Triton path")
        note = "Triton kernels, backend dispatch disabled"
    else:
        from fla.ops.gated_delta_rule.backends.flash_qla import FlashQLABackend
        if disabled or FlashQLABackend().is_enabled():
            raise ImportError("FLA's FlashQLA backend is enabled: the column would be FlashQLA")
        try:
            from fla.ops.common.backends.tilelang import CommonTileLangBackend
            tilelang = "serves" if CommonTileLangBackend.is_available() and CommonTileLangBackend().is_enabled() \
                else "is unavailable or disabled for"
        except ImportError as exc:
            tilelang = f"cannot be imported ({exc}) for"
        note = (f"Triton kernels, backend dispatch on with FLA_FLASH_QLA=0; FLA's TileLang backend {tilelang} "
                "chunk_bwd_dqkwg")
    return StepImpl("fla", chunk_gated_delta_rule, getattr(fla, "__version__", None), note)


def load(names, fla_mode: str) -> tuple[list[StepImpl], dict[str, str]]:
    loaded, skipped = [], {}
    for name in names:
        try:
            loaded.append(load_ours() if name == OURS else load_flashqla() if name == "flashqla"
                          else load_fla(fla_mode))
        except Exception as exc:  # a missing or refusing library is a skip, never the run's failure
            skipped[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return loaded, skipped


# --- one row -------------------------------------------------------------------------------------
def make_sets(case, device, seed: int, count: int = SETS_PER_ROW):
    """Protocol input sets (shared offsets), with leaves that require grad and (do, dht) in x.extra."""
    import torch

    from flashqla_tune.measure.inputs import make_rotation

    sets = make_rotation(case, count, device, seed)
    for i, x in enumerate(sets):
        for name in GRADIENTS:
            getattr(x, name).requires_grad_(True)
        gen = torch.Generator(device=device).manual_seed(10_000 + seed + i)
        x.extra["do"] = torch.randn(x.v.shape, generator=gen, device=device).to(x.v.dtype)
        x.extra["dht"] = torch.randn(x.initial_state.shape, generator=gen, device=device)
    return sets


def step(impl: StepImpl, x, host_offsets: bool = True, batch_rows: bool = False) -> None:
    """Gradients cleared, the saving forward, the backward from (do, dht). host_offsets: the offsets'
    host copy (cu_seqlens_cpu) is passed too where the implementation takes it. batch_rows: sequences
    of one length that the op takes in whole chunks (ops.uniform_sequence_tokens) go in as batch rows
    [N, L, ...] without offsets (a fixed-length training batch), the same sequences and gradients."""
    import torch

    from flashqla_tune.ops import uniform_sequence_tokens

    for name in GRADIENTS:
        getattr(x, name).grad = None
    length = uniform_sequence_tokens(x.q.shape[1], x.cu_seqlens_long, x.cu_seqlens_cpu) if batch_rows else 0
    if length:
        n = x.q.shape[1] // length
        rows = [t.reshape(n, length, *t.shape[2:]) for t in (x.q, x.k, x.v, x.g, x.beta)]
        o, final = impl.fn(*rows, scale=x.scale, initial_state=x.initial_state, output_final_state=True)
        torch.autograd.backward([o, final], [x.extra["do"].reshape(o.shape), x.extra["dht"]])
        return
    kw = {"cu_seqlens_cpu": x.cu_seqlens_cpu} if impl.takes_cu_seqlens_cpu and host_offsets else {}
    o, final = impl.fn(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.initial_state,
                       output_final_state=True, cu_seqlens=x.cu_seqlens_long, **kw)
    torch.autograd.backward([o, final], [x.extra["do"], x.extra["dht"]])


def oracle_gradients(x) -> dict:
    from flashqla_tune.oracle.gradients import recurrent_gated_delta_rule_gradients

    ref = recurrent_gated_delta_rule_gradients(
        x.q, x.k, x.v, x.g, x.beta, x.extra["do"], dht=x.extra["dht"], scale=x.scale, initial_state=x.initial_state,
        cu_seqlens=x.cu_seqlens_long, form="chunked")
    return {GRAD_NAMES[n]: getattr(ref, GRAD_NAMES[n]) for n in GRADIENTS}


def gradient_errors(x, ref: dict) -> dict:
    from flashqla_tune.measure.accuracy import rel_l2

    out = {}
    for n in GRADIENTS:
        grad = getattr(x, n).grad
        finite = grad is not None and bool(grad.isfinite().all())
        out[GRAD_NAMES[n]] = rel_l2(grad, ref[GRAD_NAMES[n]]) if finite else math.inf
    return out


def step_peak_bytes(impl: StepImpl, x, cuda: bool):
    """The step's peak allocation above what was allocated before it (None off the GPU)."""
    import torch

    if not cuda:
        step(impl, x)
        return None
    for name in GRADIENTS:
        getattr(x, name).grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(impl, x)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def allocated_bytes(cuda: bool):
    """torch's allocated device memory after a garbage collection (None off the GPU)."""
    import gc

    import torch

    if not cuda:
        return None
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def run_row(case, impls, timer, seed: int, accuracy_max_tokens: int, cuda: bool, log) -> dict:
    """One row: every implementation's eager step time, peak memory and (short rows) gradient errors."""
    held = allocated_bytes(cuda)   # what earlier rows left allocated: zero unless something leaks
    sets = make_sets(case, "cuda" if cuda else "cpu", seed)
    ref = oracle_gradients(sets[0]) if 0 < case.total_tokens <= accuracy_max_tokens else None
    row = {"name": case.name, "heads": case.heads, "seqlens": list(case.seqlens), "tokens": case.total_tokens,
           "allocated_before_row_bytes": held, "impls": {}}
    for impl in impls:
        entry = {}
        try:
            for x in sets:   # warm-up: JIT compiles, caches keyed by the offsets' identity
                step(impl, x)
            entry["step_peak_bytes"] = step_peak_bytes(impl, sets[0], cuda)
            if ref is not None:
                entry["grad_errors"] = gradient_errors(sets[0], ref)
                entry["grad_errors_within_ceilings"] = all(entry["grad_errors"][n] < CEILING[n] for n in CEILING)
            t = timer.eager(lambda x: step(impl, x), sets)
            if t.error:
                raise RuntimeError(t.error)
            entry.update({"ms": t.median_ms, "samples": len(t.samples), "min_ms": min(t.samples),
                          "tokens_per_s": case.total_tokens / (t.median_ms / 1e3)})
        except Exception as exc:
            entry = {"error": short(exc)}
            if cuda:
                entry["allocated_at_error_bytes"] = allocated_bytes(cuda)
        row["impls"][impl.name] = entry
        log(f"{case.name:24s} {impl.name:14s} " + (f"{entry['ms']:.3f} ms, peak "
            f"{(entry['step_peak_bytes'] or 0) / 2**20:.0f} MiB" if "ms" in entry else entry["error"])
            + (f", worst grad err {max(entry['grad_errors'].values()):.2e}" if entry.get("grad_errors") else "")
            + (f", {held / 2**20:.0f} MiB held before the row" if held else ""))
        for x in sets:
            for name in GRADIENTS:
                getattr(x, name).grad = None
    del sets
    return row


def graph_ms(impl: StepImpl, case, seed: int) -> dict:
    """Our step captured in one CUDA graph over the row's sets, replayed (a failed capture is reported).
    The captured step has its offsets on the device alone, as a captured training step has them: a
    host tensor's copy to the device cannot be captured; a row whose sequences all have one length
    is captured as batch rows without offsets, as a fixed-length training step is (step's batch_rows)."""
    from flashqla_tune.measure.timing import CudaTimer

    sets = make_sets(case, "cuda", seed)
    timer = CudaTimer(budget_s=0.3)
    try:
        timer.warmup(lambda x: step(impl, x, host_offsets=False, batch_rows=True), sets)
        t = timer.graph(lambda x: step(impl, x, host_offsets=False, batch_rows=True), sets)
    except Exception as exc:
        return {"row": case.name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"row": case.name, "ms": t.median_ms, "error": t.error}


PROFILE = "backward_profile.txt"


def profile_step(impl: StepImpl, case, seed: int, path: Path) -> str:
    """One eager step of `impl` under torch.profiler after three warm-up steps: its operators and
    kernels by self CUDA time into `path`. Returns a line for the log."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = make_sets(case, "cuda", seed, count=1)[0]
    for _ in range(3):
        step(impl, x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(impl, x)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    path.write_text(f"== {impl.name} {case.name}: one eager step, by self CUDA time\n{table}\n")
    return f"profile of one step of {impl.name} on {case.name} -> {path}"


def prewarm(heads, seqlens, impl_names, fla_mode: str, timeout_s: float, log) -> str:
    """One child process per head configuration runs each row's step once (compiles, in parallel)."""
    from flashqla_tune.bench.prewarm import wait_for

    t0 = time.perf_counter()
    procs = []
    for hq, hv in heads:
        cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "/tmp", "--prewarm-child", "--heads", f"{hq}/{hv}",
               "--fla-dispatch", fla_mode]
        for s in seqlens:
            cmd += ["--seqlens", "+".join(map(str, s))]
        for name in impl_names:
            cmd += ["--impl", name]
        procs.append((f"{hq}/{hv}", subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                     env={**os.environ, "FLA_CACHE_RESULTS": "0"})))
    problems = wait_for(procs, t0 + timeout_s, log, tail=20)
    took = f"{len(procs)} processes, {time.perf_counter() - t0:.0f} s"
    return took + (f"; {', '.join(problems)}" if problems else "")


def prewarm_child(args) -> int:
    from flashqla_tune.measure.cases import Case, SEQLENS

    impls, skipped = load(args.impl, args.fla_dispatch)
    for name, why in skipped.items():
        print(f"skip {name}: {why}", flush=True)
    for hq, hv in args.heads:
        for seqlens in args.seqlens or SEQLENS:
            x = make_sets(Case(hq, hv, tuple(seqlens)), "cuda", args.seed, count=1)[0]
            for impl in impls:
                t0 = time.perf_counter()
                try:
                    step(impl, x)
                    __import__("torch").cuda.synchronize()
                    print(f"{hq}/{hv} {'+'.join(map(str, seqlens))} {impl.name} {time.perf_counter() - t0:.1f} s",
                          flush=True)
                except Exception as exc:
                    print(f"{hq}/{hv} {impl.name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            del x
    return 0


def join(paths, out: Path) -> int:
    """One result from the parts' rows (each row once, first part first), summarized again."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    result = dict(parts[0])
    result["parts"] = [{"path": str(p), "date": r.get("date"), "commit": r.get("commit"), "status": r.get("status")}
                       for p, r in zip(paths, parts)]
    seen, rows = set(), []
    for r in parts:
        for row in r["rows"]:
            if row["name"] not in seen:
                seen.add(row["name"])
                rows.append(row)
    result["rows"] = rows
    result["impls"] = list(dict.fromkeys(n for r in parts for n in r.get("impls", [])))
    result["notes"] = {k: v for r in parts for k, v in r.get("notes", {}).items()}
    result["skipped"] = {k: v for r in parts for k, v in r.get("skipped", {}).items()}
    result["rows_not_started"] = [n for r in parts for n in r.get("rows_not_started", []) if n not in seen]
    result["layer"] = next((r["layer"] for r in parts if r.get("layer")), None)
    result["failures"] = [f for r in parts for f in r.get("failures", [])]
    result["summary"] = summarize(rows)
    result["status"] = "joined: " + "; ".join(r.get("status", "?") for r in parts)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT).write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / TABLE).write_text(markdown(result))
    print(f"joined {len(parts)} parts, {len(rows)} rows -> {out / RESULT}, {out / TABLE}")
    return 0 if not result["failures"] else 1


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.prewarm_child:
        return prewarm_child(args)
    if args.join:
        return join(args.join, Path(args.out_dir))
    import torch

    from flashqla_tune.measure.cases import SEQLENS, Case
    from flashqla_tune.measure.environment import describe
    from flashqla_tune.measure.timing import CudaTimer

    t0 = time.perf_counter()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = describe()
    result = {"script": "benchmarks/backward_bench.py", "args": {k: v for k, v in vars(args).items()},
              "commit": commit(), "date": info["date"], "gpu": info["gpu"], "driver": info["driver"],
              "versions": info["versions"], "ceilings": CEILING, "rows": [], "skipped": {}}

    def finish(status: str, code: int) -> int:
        result["status"] = status
        result["seconds"] = round(time.perf_counter() - t0, 1)
        (out / RESULT).write_text(json.dumps(result, indent=1, default=str) + "\n")
        (out / TABLE).write_text(markdown(result))
        print(f"{status} -> {out / RESULT}, {out / TABLE}", flush=True)
        return code

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        where = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
        result["impls"], result["notes"] = [], {}
        return finish(f"not run: our op's step needs an sm_90 GPU ({where})", 2)
    impls, result["skipped"] = load(args.impl, args.fla_dispatch)
    result["impls"] = [i.name for i in impls]
    result["notes"] = {i.name: f"{i.version}: {i.note}" for i in impls}
    result["versions"] = describe()["versions"]   # again: the libraries are imported now
    for name, why in result["skipped"].items():
        log(f"skipping {name}: {why}")
    cases = [Case(hq, hv, tuple(s)) for hq, hv in args.heads for s in (args.seqlens or SEQLENS)]
    if args.prewarm:
        result["prewarm"] = prewarm(args.heads, list(args.seqlens or SEQLENS), [i.name for i in impls],
                                    args.fla_dispatch, args.budget_s / 2, log)
        log(f"prewarm: {result['prewarm']}")
    timer = CudaTimer(budget_s=args.sample_budget_s)
    not_started = []
    for case in cases:
        if time.perf_counter() - t0 > args.budget_s:
            not_started.append(case.name)
            continue
        result["rows"].append(run_row(case, impls, timer, args.seed, args.accuracy_max_tokens, True, log))
        result["summary"] = summarize(result["rows"])
        (out / RESULT).write_text(json.dumps(result, indent=1, default=str) + "\n")
    result["rows_not_started"] = not_started
    result["summary"] = summarize(result["rows"])

    if not args.no_layer:
        layer = Case(*map(int, LAYER_HEADS.split("/")), LAYER_SEQLENS)
        row = next((r for r in result["rows"] if r["name"] == layer.name), None)
        if row is None and time.perf_counter() - t0 <= args.budget_s:
            row = run_row(layer, impls, timer, args.seed, 0, True, log)
        if row is not None:
            result["layer"] = {n: ({"ms": v["ms"], "tokens_per_s": v["tokens_per_s"]} if "ms" in v
                                   else {"error": v.get("error")}) for n, v in row["impls"].items()}
    ours = next((i for i in impls if i.name == OURS), None)
    if args.graph and ours is not None and time.perf_counter() - t0 <= args.budget_s:
        result["graph"] = graph_ms(ours, Case(*args.heads[0], (args.seqlens or SEQLENS)[0]), args.seed)
        log(f"graph replay of our step: {result['graph']}")
    if args.profile and ours is not None:
        log(profile_step(ours, Case(*args.heads[0], (args.seqlens or SEQLENS)[0]), args.seed, out / PROFILE))

    failures = []
    if ours is None and OURS in args.impl:
        failures.append(f"our op did not load: {result['skipped'].get(OURS)}")
    for r in result["rows"]:
        mine = r["impls"].get(OURS, {})
        if "error" in mine:
            failures.append(f"{r['name']}: {mine['error']}")
        elif mine.get("grad_errors_within_ceilings") is False:
            failures.append(f"{r['name']}: gradients above the ceilings {mine['grad_errors']}")
    result["failures"] = failures
    for peer in PEERS:
        s = result["summary"].get(peer, {})
        log(f"{peer}/ours geomean {s.get('geomean_speedup')} over {s.get('rows')} rows, slower rows "
            f"{s.get('rows_ours_slower')}")
    return finish("pass" if not failures else f"fail: {len(failures)} problems", 0 if not failures else 1)


if __name__ == "__main__":
    sys.exit(main())
