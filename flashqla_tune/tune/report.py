"""The closing table of a tuning run: best configs first, each with its speedup over the
default tiles, and why the other trials were pruned."""
from __future__ import annotations

from collections import Counter

from optuna.trial import TrialState

from ..plan import default_tiles
from .search_space import params_of
from .trial import MIX_TOLERANCE, TuneResult, per_mix_speedups, slower_mixes

TOP = 10


def _tiles(params: dict) -> str:
    extra = (" og" if params.get("output_group") else "") + (
        f" p{params['prep_threads']}" if params.get("prep_threads", 256) != 256 else "")
    return (f"bv{params['block_v']} st{params['stages']} r{params['producer_regs']}x{params['consumer_regs']} "
            f"c{params['ctas_per_sm']}{extra}")


def worker_lines(trials) -> list[str]:
    """How workers sharing the journal split the study: trials each asked for and measured
    (enqueued configs no worker has asked for yet are not counted)."""
    trials = [t for t in trials if t.state != TrialState.WAITING]
    asked = Counter(t.user_attrs.get("worker", "?") for t in trials)
    measured = Counter(t.user_attrs.get("worker", "?") for t in trials if t.state == TrialState.COMPLETE)
    return [f"worker {w}: {asked[w]} trials, {measured[w]} measured" for w in sorted(asked)]


def table(result: TuneResult, top: int = TOP) -> str:
    done = sorted((t for t in result.trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    base = result.default.value if result.default is not None else None
    lines = [f"study {result.study_name}: {len(result.trials)} trials "
             f"({result.evaluated_here} evaluated by this call; stopped: {result.stopped_because})"]
    lines.append(f"{'trial':>5}  {'tiles':<26} {'sum of medians ms':>18}  {'vs default':>10}")
    default_params = params_of(default_tiles(result.spec))
    for t in done[:top]:
        speed = f"{base / t.value:.3f}x" if base and t.value else "n/a"
        mark = "  (default)" if t.params == default_params else ""
        if result.default is not None and t.params != default_params:
            worse = slower_mixes(t, result.default)
            mark += f"  (slower on {', '.join(worse)}: not eligible)" if worse else ""
        lines.append(f"{t.number:>5}  {_tiles(t.params):<26} {t.value:>18.4f}  {speed:>10}{mark}")
    if base is None:
        lines.append("default tiles not measured yet: no speedup to report")
    elif result.best is not None:
        lines.append(f"best: trial {result.best.number} ({_tiles(result.best.params)}), "
                     f"{result.speedup:.3f}x the default's {base:.4f} ms, no mix slower than the default "
                     f"by more than {MIX_TOLERANCE:.0%}")
        # the best config's gain on each length mix: a sum can hide a mix where it loses
        per_mix = per_mix_speedups(result.best, result.default)
        if per_mix:
            lines.append("  per mix (default ms / best ms): " + ", ".join(f"{mix} {r:.3f}x" for mix, r in per_mix.items()))
    if not result.anchors and result.best is not None:
        lines.append("anchors: not timed in this run (`flashqla-tune tune`, `build --compare-anchors` or "
                     "`flashqla-tune bench` compares FLA and FlashQLA)")
    for name, record in sorted(result.anchors.items()):
        ratio = result.speedup_over(name)
        if ratio is not None:
            # ratio = anchor time / best time: above 1 the tuned kernel is faster
            lines.append(f"best vs {name} (same run, same mixes): {ratio:.3f}x the speed "
                         f"({name} {sum(record['times_ms'].values()):.4f} ms, best {result.best.value:.4f} ms)")
        else:
            lines.append(f"{name}: not compared ({record.get('error', 'mixes differ from the best config')})")
    stages = Counter(t.user_attrs.get("stage", "?") for t in result.trials if t.state == TrialState.PRUNED)
    if stages:
        lines.append("pruned: " + ", ".join(f"{n} {stage}" for stage, n in sorted(stages.items())))
    failed = sum(t.state == TrialState.FAIL for t in result.trials)
    if failed:
        lines.append(f"failed (uncaught errors): {failed}")
    workers = worker_lines(result.trials)
    if len(workers) > 1:
        lines.extend(workers)
    return "\n".join(lines)
