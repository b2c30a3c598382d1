"""The scoreboard's outputs: one JSON with everything, and a markdown table a person reads (per
mode, each implementation's median ms, the ratios against the peers that ran (FLA, FlashQLA,
FlashInfer, cuDNN), and against the floor; then accuracy)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..measure.cases import HEAD_LABELS

# The error of a row the run did not reach before it was stopped
NOT_REACHED = "not run: the run ended before this row (killed from outside, e.g. a time limit)"

ANCHORS = ("fla", "flashqla", "flashinfer", "cudnn")  # the peers; a column only where measured
BEST_PEER = "best peer"
MODES = (("graph", "CUDA-graph replay (kernel time)"), ("eager", "eager (host overhead included)"))
MODES_KEYS = tuple(m for m, _ in MODES)


def _ms(x) -> str:
    return "-" if x is None else (f"{x:.3f}" if x < 100 else f"{x:.1f}")


def _ratio(a, b) -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def _time(row, impl, mode):
    t = row.get("times", {}).get(impl, {}).get(mode)
    return None if not t else t.get("median_ms")


def _heads_cell(row, seen: set) -> str:
    heads = row["heads"]
    if heads in seen:
        return heads
    seen.add(heads)
    label = HEAD_LABELS.get(tuple(int(p) for p in heads.split("/")))
    return f"{heads} ({label})" if label else heads


def measured(results: dict) -> list[str]:
    """Implementations that loaded and produced at least one number (the table's columns); one
    that failed on every row is listed with its first error instead."""
    out = []
    for name, info in results["impls"].items():
        if info["available"] and any(_time(r, name, m) is not None for r in results["rows"] for m in MODES_KEYS):
            out.append(name)
    return out


def _first_error(results: dict, impl: str) -> str:
    for row in results["rows"]:
        for t in row.get("times", {}).get(impl, {}).values():
            if isinstance(t, dict) and t.get("error"):
                return t["error"]
    return "no measurement"


def mode_table(results: dict, mode: str) -> list[str]:
    impls = measured(results)
    anchors = [a for a in ANCHORS if a in impls]
    head = ["heads (h_qk/h_v)", "seqlens", "floor"] + impls
    for impl in impls:
        head += [f"{impl}/{a}" for a in anchors if a != impl] + [f"{impl}/floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    seen: set = set()
    for row in results["rows"]:
        floor = (row.get("floor") or {}).get("floor_ms")
        cells = [_heads_cell(row, seen), row["seqlens"], _ms(floor)]
        cells += [_ms(_time(row, i, mode)) for i in impls]
        for impl in impls:
            t = _time(row, impl, mode)
            cells += [_ratio(t, _time(row, a, mode)) for a in anchors if a != impl] + [_ratio(t, floor)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary_table(results: dict, mode: str) -> list[str]:
    """Each of our columns against each anchor over the rows both measured: the geometric mean of
    the time ratio, how many rows are faster, and the worst row (the issues' targets read off
    this: faster than FLA on every row; 1.2x FlashQLA in geomean with no row slower). With two or
    more peers measured, also against the best peer: per row the fastest of them."""
    impls = measured(results)
    anchors = [a for a in ANCHORS if a in impls]
    ours = [i for i in impls if i.startswith("flashqla_tune")]

    def peer_time(row, anchor):
        if anchor != BEST_PEER:
            return _time(row, anchor, mode)
        times = [t for a in anchors if (t := _time(row, a, mode)) is not None and t > 0]
        return min(times) if times else None
    lines = []
    for impl in ours:
        for anchor in anchors + ([BEST_PEER] if len(anchors) > 1 else []):
            pairs = [(row, _time(row, impl, mode), peer_time(row, anchor)) for row in results["rows"]]
            pairs = [(row, t, a) for row, t, a in pairs if t is not None and a is not None and a > 0 and t > 0]
            if not pairs:
                continue
            ratios = [(t / a, row) for row, t, a in pairs]
            geomean = math.exp(sum(math.log(r) for r, _ in ratios) / len(ratios))
            worst, worst_row = max(ratios, key=lambda x: x[0])
            faster = sum(r < 1 for r, _ in ratios)
            lines.append(f"| {impl} | {anchor} | {len(ratios)} | {geomean:.3f} ({1 / geomean:.2f}x) | "
                         f"{faster} of {len(ratios)} | {worst:.2f} ({worst_row['heads']} {worst_row['seqlens']}) |")
    if not lines:
        return []
    head = "| ours | against | rows | geomean time ratio (speed-up) | faster on | worst row |"
    return [head, "|---|---|---|---|---|---|"] + lines


def errors_section(results: dict) -> list[str]:
    """Every measurement that produced no number, with its reason (implementations that failed on
    every row are summarised in the header instead)."""
    out = []
    shown = set(measured(results))
    for row in results["rows"]:
        for impl, modes in row.get("times", {}).items():
            if impl not in shown:
                continue
            for mode, t in modes.items():
                if isinstance(t, dict) and t.get("error"):
                    out.append(f"- {row['heads']} {row['seqlens']} {impl} {mode}: {t['error']}")
        if row.get("error"):
            out.append(f"- {row['heads']} {row['seqlens']}: {row['error']}")
    return out


def accuracy_table(results: dict) -> list[str]:
    rows = [r for r in results["rows"] if r.get("accuracy")]
    if not rows:
        return []
    impls = measured(results)
    head = ["heads", "seqlens"] + [f"{i} {w}" for i in impls for w in ("o", "state")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["heads"], row["seqlens"]]
        for impl in impls:
            acc = row["accuracy"].get(impl, {})
            cells += [f"{acc[w]:.1e}" if w in acc else "-" for w in ("o", "state")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _impl_line(results: dict, name: str, info: dict) -> str:
    if not info["available"]:
        return f"{name} skipped: {info['reason']}"
    if name not in measured(results):
        return f"{name} ({info['version']}) failed on every row: {_first_error(results, name)}"
    return f"{name} ({info['version']}: {info['note']})"


def render_markdown(results: dict) -> str:
    meta = results["meta"]
    env, ceil, v = meta["environment"], meta.get("ceilings") or {}, meta["environment"]["versions"]
    gpu = env.get("gpu") or {}
    lines = [f"# Scoreboard: GDN chunked prefill forward ({env['date']})", "",
             f"- GPU: {gpu.get('name', 'none')} ({gpu.get('sm_count', '?')} SMs), driver {env.get('driver')}",
             "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
             ]
    if ceil:
        lines.append(f"- ceilings measured in this run: device-to-device copy "
                     f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), bf16 "
                     f"{ceil['matmul_n']}^3 matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    lines += [f"- protocol: {meta['protocol']}",
              f"- floor: max(bytes / copy bandwidth, FLOPs / matmul rate); "
              f"{meta['flops_per_token_head'] / 1e3:.0f} kFLOP per token per v-head (floor.py)",
              "- implementations: " + "; ".join(_impl_line(results, n, d) for n, d in results["impls"].items())]
    lines += [f"- note: {note}" for note in meta.get("notes", [])]
    if meta.get("prewarm"):
        lines.append(f"- prewarm (JIT compile, parallel processes): {meta['prewarm']}")
    lines += ["", "Times are medians in ms; ratios are row time / column time (below 1 is faster). Graph "
              "replay: one CUDA graph calls the implementation on R distinct input sets (R per row in the "
              "JSON, 'rotation': together at least twice the L2), median replay time / R. Eager: median "
              "of single calls timed on the host between two synchronizes."]
    for mode, title in MODES:
        if mode in meta["modes"]:
            lines += ["", f"## Forward, {title}", ""] + mode_table(results, mode)
            summary = summary_table(results, mode)
            if summary:
                lines += ["", f"Summary, {mode}: rows where both columns have a time.", ""] + summary
    acc = accuracy_table(results)
    if acc:
        lines += ["", "## Accuracy (relative L2 vs float64 chunked reference, input set 0)", ""] + acc
    errs = errors_section(results)
    if errs:
        lines += ["", "## Missing numbers", ""] + errs
    return "\n".join(lines) + "\n"


def join(parts: list[dict], names: list[str]) -> dict:
    """One scoreboard from runs of disjoint rows (the halves two GPUs or two calls measured), so
    the targets read off one summary. The runs must agree on the GPU, the versions, the modes and
    the implementations; a row measured twice is refused (a repeat is a separate scoreboard).
    The first run's ceilings stand for all (each row's floor was computed in its own run)."""
    if len(parts) < 2 or len(parts) != len(names):
        raise ValueError(f"join needs two or more scoreboards, each with a name (got {len(parts)} and {len(names)})")
    first = parts[0]

    def same(what, get):
        want = get(first)
        for name, part in zip(names[1:], parts[1:]):
            if get(part) != want:
                raise ValueError(f"{name}: {what} {get(part)!r} differs from {names[0]}'s {want!r}")

    same("GPU", lambda r: (r["meta"]["environment"].get("gpu") or {}).get("name"))
    same("versions", lambda r: r["meta"]["environment"]["versions"])
    same("modes", lambda r: list(r["meta"]["modes"]))
    same("implementations", lambda r: sorted(r["impls"]))
    # A row a part did not reach (its time ran out) may be run by a later part, which takes its
    # place; a row that two parts both ran is ambiguous.
    rows, seen = {}, {}
    for name, part in zip(names, parts):
        for row in part["rows"]:
            key = (row["heads"], row["seqlens"])
            if key in seen and not _not_run(rows[key]):
                if _not_run(row):
                    continue
                raise ValueError(f"row {key[0]} {key[1]} is in both {seen[key]} and {name}")
            seen[key] = name
            rows[key] = row
    meta = json.loads(json.dumps(first["meta"]))  # a copy: the parts stay as read
    meta["notes"] = list(meta.get("notes", [])) + [
        "joined from " + ", ".join(f"{n} ({p['meta']['environment']['date']}, {len(p['rows'])} rows)"
                                   for n, p in zip(names, parts)) + "; ceilings are the first run's"]
    return {"meta": meta, "impls": first["impls"], "rows": list(rows.values())}


def _not_run(row: dict) -> bool:
    return not row.get("times") and row.get("error") == NOT_REACHED


def write(results: dict, out_dir, stem: str = "scoreboard") -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    js.write_text(json.dumps(results, indent=1, default=str))
    md.write_text(render_markdown(results))
    return md, js
