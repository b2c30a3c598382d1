"""A calibration a person can read: a markdown report and one PNG, both sized for any model
from a few layers x heads to 64 layers x 128 heads.

The figure has a fixed size: three layers x heads heatmaps (n_h, the median per-chunk decay, and
the decay of the weakest 1% of chunks) whose cells shrink with the model, and a per-layer summary
panel. The markdown keeps its lines short: a per-layer summary table, the layer x head n_h grid
while it is narrow, and one collapsed section per layer with that layer's per-head rows.
"""
from __future__ import annotations

import io
import math
from pathlib import Path
from statistics import median

import numpy as np

from ..calibration_artifact import QUANTILE_LEVELS, Calibration, LayerStats
from ..files import atomic_write_bytes, atomic_write_text

REPORT_NAME = "calibration.md"
FIGURE_NAME = "calibration.png"

# The figure's size does not depend on the model: 17.5 x 10.5 in at 110 dpi is 1925 x 1155 px.
FIGURE_INCHES = (17.5, 10.5)
FIGURE_DPI = 110
# Decays below this fraction of -log(eps)/N (the least per-chunk decay that reaches eps within N
# chunks) are drawn at it on the log scales, so zero-decay heads do not stretch them.
DECAY_FLOOR_OF_CAP = 0.1
EXACT_COLOUR = (0.85, 0.2, 0.2, 1.0)
# The n_h grid carries one number per cell while cells stay this large (layers, heads).
ANNOTATE_UP_TO = (24, 24)
# The markdown's layer x head n_h grid is one table row per layer while a row has at most this
# many heads; wider models list each layer's n_h in its collapsed section instead.
GRID_MAX_HEADS = 16
# Heads per line where a layer's n_h, or the model-wide table, is listed as text.
HEADS_PER_LINE = 32


def _q(level: float) -> int:
    return QUANTILE_LEVELS.index(level)


def summary(cal: Calibration) -> list[str]:
    """The short summary printed at the end of a calibration (the CLI and `flashqla-tune build`)."""
    heads = [h for layer in cal.layers for h in layer.heads]
    exact = sum(h.n_h is None for h in heads)
    return [f"calibrated {cal.checkpoint_path} ({cal.family}): {len(cal.layers)} GDN layers x "
            f"{len(cal.layers[0].heads)} v-heads on {cal.corpus['num_tokens']} tokens in {cal.run['seconds']:.1f} s "
            f"({cal.run['device']})",
            *("  " + line for line in cal.summary_lines()),
            f"  {len(heads) - exact} warm-up heads, {exact} exact; model-wide table {cal.model_table()}"]


# ---------------------------------------------------------------- markdown

def _n_h_cell(n_h: int | None) -> str:
    return "ex" if n_h is None else str(n_h)


def _wrapped_heads(values: list[str]) -> list[str]:
    """Per-head values as lines of HEADS_PER_LINE, each led by its head range."""
    width = max(len(v) for v in values)
    lines = []
    for start in range(0, len(values), HEADS_PER_LINE):
        chunk = values[start:start + HEADS_PER_LINE]
        label = f"h{start}-{start + len(chunk) - 1}:"
        lines.append(f"{label:<10} " + " ".join(v.rjust(width) for v in chunk))
    return lines


def _layer_row(layer: LayerStats) -> str:
    warm = [h.n_h for h in layer.heads if h.n_h is not None]
    exact = len(layer.heads) - len(warm)
    n_h = f"{min(warm)} / {int(median(warm))} / {max(warm)}" if warm else "-"
    med = [h.chunk_log_decay_quantiles[_q(0.5)] for h in layer.heads]
    p99 = max(h.chunk_log_decay_quantiles[_q(0.99)] for h in layer.heads)
    zero = max(h.zero_decay_fraction for h in layer.heads)
    return (f"| {layer.layer} | {layer.decoder_layer} | {len(warm)} | {exact} | {n_h} | "
            f"{min(med):.3g} / {median(med):.3g} / {max(med):.3g} | {p99:.3g} | {zero:.1%} |")


def _layer_section(layer: LayerStats, grid_shown: bool) -> list[str]:
    warm = sum(h.n_h is not None for h in layer.heads)
    lines = [f"<details><summary>GDN layer {layer.layer}, decoder layer {layer.decoder_layer}: "
             f"{warm} warm-up, {len(layer.heads) - warm} exact</summary>", ""]
    if not grid_shown:
        lines += ["n_h per v-head (`ex` = exact):", "", "```",
                  *_wrapped_heads([_n_h_cell(h.n_h) for h in layer.heads]), "```", ""]
    lines += ["| head | class | n_h | median | p1 | p99 | zero-decay |", "|---|---|---|---|---|---|---|"]
    for h in layer.heads:
        q = h.chunk_log_decay_quantiles
        lines.append(f"| {h.head} | {h.cls} | {'-' if h.n_h is None else h.n_h} | {q[_q(0.5)]:.3g} | "
                     f"{q[_q(0.01)]:.3g} | {q[_q(0.99)]:.3g} | {h.zero_decay_fraction:.1%} |")
    return lines + ["", "</details>", ""]


def markdown(cal: Calibration) -> str:
    s = cal.settings
    heads = len(cal.layers[0].heads)
    table = cal.model_table()
    if heads <= HEADS_PER_LINE:
        model_table = [f"- model-wide table (largest n_h per head, -1 = exact): {table}"]
    else:
        model_table = ["- model-wide table (largest n_h per head, -1 = exact):", "", "  ```",
                       *("  " + line for line in _wrapped_heads([str(v) for v in table])), "  ```"]
    grid_shown = heads <= GRID_MAX_HEADS
    lines = [
        f"# Calibration of `{Path(cal.checkpoint_path).name}`", "",
        f"- checkpoint sha256 `{cal.checkpoint_sha256[:16]}`, family {cal.family} ({cal.model_type}), "
        f"{len(cal.layers)} GDN layers x {heads} v-heads",
        f"- corpus `{cal.corpus['name']}` (sha256 `{cal.corpus['sha256'][:16]}`): {cal.corpus['num_sequences']} x "
        f"{cal.corpus['seq_len']} tokens",
        f"- eps = {s.eps:g}, chunk = {s.chunk_size}, window cap N = {s.max_window}, Q = {s.quantile}",
        f"- ran on {cal.run.get('device', '?')} ({cal.run.get('dtype', '?')}) in {cal.run.get('seconds', '?')} s",
        "", "## Summary", "",
        *[f"- {line}" for line in cal.summary_lines()],
        *model_table,
        "", "## Per layer", "",
        "Per-chunk summed log-decay (0 = no decay); each head's median, p1 and p99 are over its chunks.",
        "`head medians` gives the smallest, median and largest over the layer's heads;",
        "`largest p99` is the weakest-decaying head's p99; `zero-decay` is the largest share of zero-decay",
        "tokens in one head.", "",
        "| layer | decoder layer | warm-up | exact | n_h min / median / max | head medians min / median / max "
        "| largest p99 | zero-decay |",
        "|---|---|---|---|---|---|---|---|",
        *[_layer_row(layer) for layer in cal.layers],
    ]
    if grid_shown:
        lines += ["", "## n_h per layer and v-head (`ex` = exact)", "",
                  "| layer | decoder layer | " + " | ".join(f"h{h}" for h in range(heads)) + " | exact |",
                  "|---|---|" + "---|" * heads + "---|"]
        for layer in cal.layers:
            cells = [_n_h_cell(h.n_h) for h in layer.heads]
            lines.append(f"| {layer.layer} | {layer.decoder_layer} | " + " | ".join(cells)
                         + f" | {cells.count('ex')} |")
    lines += ["", "## Per v-head: n_h, per-chunk summed log-decay (median [p1, p99]) and zero-decay token share",
              "", "One collapsed section per GDN layer.", ""]
    for layer in cal.layers:
        lines += _layer_section(layer, grid_shown)
    return "\n".join(lines).rstrip("\n") + "\n"


# ---------------------------------------------------------------- figure

def _decay_grid(cal: Calibration, level: float) -> np.ndarray:
    """Layers x heads of the per-chunk decay -sum(g) at a log-decay quantile level."""
    return -np.array([[h.chunk_log_decay_quantiles[_q(level)] for h in layer.heads] for layer in cal.layers],
                     dtype=float)


def _decay_floor(cal: Calibration) -> float:
    return DECAY_FLOOR_OF_CAP * -math.log(cal.settings.eps) / cal.settings.max_window


def _index_ticks(axis, count: int, most: int) -> None:
    """Every index while there are at most `most`, else about `most` round ones."""
    from matplotlib.ticker import MaxNLocator

    if count <= most:
        axis.set_ticks(range(count))
    else:
        axis.set_major_locator(MaxNLocator(nbins=most, integer=True))


def _head_axes(ax, num_layers: int, num_heads: int) -> None:
    _index_ticks(ax.xaxis, num_heads, 8 if num_heads > 16 else 16)
    _index_ticks(ax.yaxis, num_layers, 16)
    ax.set_xlabel("v-head")
    ax.set_ylabel("GDN layer")


def _n_h_panel(fig, ax, cal: Calibration) -> None:
    import matplotlib
    from matplotlib.colors import BoundaryNorm, ListedColormap

    n = cal.settings.max_window
    L, H = len(cal.layers), len(cal.layers[0].heads)
    grid = np.array([[n + 1 if h.n_h is None else h.n_h for h in layer.heads] for layer in cal.layers], dtype=float)
    base = matplotlib.colormaps["viridis"].resampled(n)
    cmap = ListedColormap([*base(np.arange(n)), EXACT_COLOUR])
    im = ax.imshow(grid, cmap=cmap, norm=BoundaryNorm(np.arange(0.5, n + 2), cmap.N), aspect="auto",
                   interpolation="nearest")
    if L <= ANNOTATE_UP_TO[0] and H <= ANNOTATE_UP_TO[1]:
        size = 9 if max(L, H) <= 8 else 7 if max(L, H) <= 12 else 5
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, "ex" if v > n else str(int(v)), ha="center", va="center", fontsize=size,
                    color="white" if v <= n * 0.6 or v > n else "black")
    _head_axes(ax, L, H)
    ax.set_title(f"warm-up chunks n_h (eps={cal.settings.eps:g}, Q={cal.settings.quantile}, N={n})\n"
                 "red = exact", fontsize=10)
    step = math.ceil(n / 8)
    ticks = sorted({1, *range(step, n + 1, step)}) + [n + 1]
    cb = fig.colorbar(im, ax=ax, ticks=ticks, fraction=0.05, pad=0.02)
    cb.ax.set_yticklabels([*map(str, ticks[:-1]), "exact"])


def _decay_panels(fig, ax_med, ax_weak, cal: Calibration) -> None:
    from matplotlib.colors import LogNorm

    L, H = len(cal.layers), len(cal.layers[0].heads)
    floor = _decay_floor(cal)
    med, weak = _decay_grid(cal, 0.5), _decay_grid(cal, 0.99)
    clipped = bool((weak < floor).any() or (med < floor).any())
    med, weak = np.maximum(med, floor), np.maximum(weak, floor)
    lo, hi = float(min(med.min(), weak.min())), float(max(med.max(), weak.max()))
    norm = LogNorm(vmin=lo, vmax=hi if hi > lo else lo * 10)
    for ax, grid, title in ((ax_med, med, "median decay per chunk, -sum g\n(same colour scale as the right panel)"),
                            (ax_weak, weak, "decay that 99% of chunks exceed\n(-p99 of sum g)")):
        im = ax.imshow(grid, cmap="magma", norm=norm, aspect="auto", interpolation="nearest")
        _head_axes(ax, L, H)
        ax.set_title(title, fontsize=10)
    cb = fig.colorbar(im, ax=ax_weak, fraction=0.05, pad=0.02, extend="min" if clipped else "neither")
    cb.set_label(f"decay per {cal.settings.chunk_size}-token chunk, -sum g"
                 + (f"\n(below {floor:.2g} drawn at {floor:.2g})" if clipped else ""))
    for value, style in _thresholds(cal):
        if norm.vmin <= value <= norm.vmax:
            cb.ax.axhline(value, color="deepskyblue", ls=style, lw=2.0)


def _thresholds(cal: Calibration) -> list[tuple[float, str]]:
    """-log(eps): n_h = 1 within one chunk; -log(eps)/N: the decay per chunk that reaches eps within N."""
    return [(-math.log(cal.settings.eps), "--"), (-math.log(cal.settings.eps) / cal.settings.max_window, ":")]


def _layer_panel(ax, cal: Calibration) -> None:
    s = cal.settings
    x = np.array([layer.layer for layer in cal.layers])
    floor = _decay_floor(cal)
    med, weak, strong = (_decay_grid(cal, lv) for lv in (0.5, 0.99, 0.01))
    clipped = bool((weak < floor).any() or (med < floor).any())
    med, weak, strong = (np.maximum(grid, floor) for grid in (med, weak, strong))
    ms = 5 if len(x) <= 24 else 3
    ax.vlines(x, med.min(axis=1), med.max(axis=1), color="tab:blue", alpha=0.25, lw=7 if len(x) <= 32 else 4,
              label="head medians: smallest to largest over the layer's heads")
    ax.plot(x, np.median(med, axis=1), "o-", color="tab:blue", ms=ms, lw=1.2,
            label="head medians: median over the layer's heads")
    ax.plot(x, strong.max(axis=1), "^", color="tab:green", ms=ms,
            label="largest decay at p1 of sum g over heads (the most-decaying chunks)")
    ax.plot(x, weak.min(axis=1), "v", color="tab:orange", ms=ms,
            label="smallest decay at p99 of sum g over heads (the least-decaying chunks)")
    exact = np.array([sum(h.n_h is None for h in layer.heads) for layer in cal.layers])
    if exact.any():
        ax.plot(x[exact > 0], weak.min(axis=1)[exact > 0], "x", color=EXACT_COLOUR, ms=ms + 3, mew=1.5,
                label="layer with exact heads")
    (one, one_style), (cap, cap_style) = _thresholds(cal)
    ax.axhline(one, color="k", ls=one_style, lw=0.9, label="-log(eps): n_h = 1 in one chunk")
    ax.axhline(cap, color="r", ls=cap_style, lw=0.9, label=f"-log(eps)/N (N={s.max_window})")
    ax.set_yscale("log")
    _index_ticks(ax.xaxis, len(x), 32)
    ax.set_xlim(x.min() - 0.6, x.max() + 0.6)
    ax.set_xlabel("GDN layer")
    ax.set_ylabel(f"decay per {s.chunk_size}-token chunk, -sum g"
                  + (f"\n(below {floor:.2g} drawn at {floor:.2g})" if clipped else ""))
    ax.set_title("per layer: spread of the per-chunk decay over the layer's heads", fontsize=10)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def figure_png(cal: Calibration) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, H = len(cal.layers), len(cal.layers[0].heads)
    fig = plt.figure(figsize=FIGURE_INCHES, layout="constrained")
    # two subfigures lay out apart: the lower panel's legend takes no width from the heatmaps
    top, bottom = fig.subfigures(2, 1, height_ratios=[1.35, 1])
    ax_n, ax_med, ax_weak = top.subplots(1, 3)
    _n_h_panel(top, ax_n, cal)
    _decay_panels(top, ax_med, ax_weak, cal)
    _layer_panel(bottom.subplots(), cal)
    fig.suptitle(f"Calibration of {Path(cal.checkpoint_path).name}: {L} GDN layers x {H} v-heads, "
                 f"{cal.corpus.get('num_tokens', '?')} tokens", fontsize=12)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=FIGURE_DPI)
    plt.close(fig)
    return buf.getvalue()


def write_report(cal: Calibration, out_dir) -> tuple[Path, Path]:
    out = Path(out_dir)
    fig = atomic_write_bytes(out / FIGURE_NAME, figure_png(cal))
    md = atomic_write_text(out / REPORT_NAME,
                           markdown(cal) + f"\n![n_h and decay heatmaps, per-layer decay]({FIGURE_NAME})\n")
    return md, fig
