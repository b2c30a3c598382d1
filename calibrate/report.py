"""A calibration a person can read: a markdown table and one PNG (layers x heads heatmap of
n_h, and each head's per-chunk decay distribution)."""
from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from ..calibration_artifact import QUANTILE_LEVELS, Calibration
from ..files import atomic_write_bytes, atomic_write_text

REPORT_NAME = "calibration.md"
FIGURE_NAME = "calibration.png"


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


def markdown(cal: Calibration) -> str:
    s = cal.settings
    heads = len(cal.layers[0].heads)
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
        f"- model-wide table (largest n_h per head, -1 = exact): {cal.model_table()}",
        "", "## n_h per layer and v-head (`ex` = exact)", "",
        "| layer | decoder layer | " + " | ".join(f"h{h}" for h in range(heads)) + " | exact |",
        "|---|---|" + "---|" * heads + "---|",
    ]
    for layer in cal.layers:
        cells = ["ex" if h.n_h is None else str(h.n_h) for h in layer.heads]
        lines.append(f"| {layer.layer} | {layer.decoder_layer} | " + " | ".join(cells)
                     + f" | {cells.count('ex')} |")
    lines += ["", "## Per-chunk summed log-decay (median [p1, p99]) and zero-decay token share", "",
              "| layer | head | class | n_h | median | p1 | p99 | zero-decay |", "|---|---|---|---|---|---|---|---|"]
    for layer in cal.layers:
        for h in layer.heads:
            q = h.chunk_log_decay_quantiles
            lines.append(f"| {layer.layer} | {h.head} | {h.cls} | {'-' if h.n_h is None else h.n_h} | "
                         f"{q[_q(0.5)]:.3g} | {q[_q(0.01)]:.3g} | {q[_q(0.99)]:.3g} | {h.zero_decay_fraction:.1%} |")
    return "\n".join(lines) + "\n"


def figure_png(cal: Calibration) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    s = cal.settings
    L, H = len(cal.layers), len(cal.layers[0].heads)
    grid = np.array([[h.n_h if h.n_h is not None else s.max_window + 1 for h in layer.heads]
                     for layer in cal.layers], dtype=float)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 4 + 0.5 * H + 0.3 * L * H / 4), 2.5 + 0.35 * L + 2),
                                   gridspec_kw={"width_ratios": [1, 1.6]})
    base = plt.get_cmap("viridis", s.max_window)
    cmap = ListedColormap([*base(np.arange(s.max_window)), (0.85, 0.2, 0.2, 1.0)])
    im = ax1.imshow(grid, cmap=cmap, vmin=0.5, vmax=s.max_window + 1.5, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        ax1.text(j, i, "ex" if v > s.max_window else str(int(v)), ha="center", va="center", fontsize=7,
                 color="white" if v <= s.max_window * 0.6 or v > s.max_window else "black")
    ax1.set_xlabel("v-head")
    ax1.set_ylabel("GDN layer")
    ax1.set_title(f"n_h (eps={s.eps:g}, Q={s.quantile})\nred = exact", fontsize=9)
    ax1.set_xticks(range(H))
    ax1.set_yticks(range(L))
    fig.colorbar(im, ax=ax1, fraction=0.04)

    # decay per chunk: -sum(g) over a chunk, median with p1..p99 bars, per (layer, head)
    floor = 1e-6
    for li, layer in enumerate(cal.layers):
        x = li * (H + 1) + np.arange(H)
        q = np.array([h.chunk_log_decay_quantiles for h in layer.heads])
        med, lo, hi = (np.maximum(-q[:, _q(lv)], floor) for lv in (0.5, 0.99, 0.01))
        ax2.errorbar(x, med, yerr=[med - lo, hi - med], fmt="o", ms=3, capsize=2, label=f"layer {layer.layer}")
    ax2.axhline(-math.log(s.eps), color="k", ls="--", lw=0.8, label="-log(eps): n_h = 1 in one chunk")
    ax2.axhline(-math.log(s.eps) / s.max_window, color="r", ls=":", lw=0.8, label=f"-log(eps)/N (N={s.max_window})")
    ax2.set_yscale("log")
    ax2.set_xlabel("layer-major v-head index")
    ax2.set_ylabel("decay per 64-token chunk, -sum g (median, p1-p99)")
    ax2.set_title("per-chunk decay distribution")
    ax2.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_report(cal: Calibration, out_dir) -> tuple[Path, Path]:
    out = Path(out_dir)
    fig = atomic_write_bytes(out / FIGURE_NAME, figure_png(cal))
    md = atomic_write_text(out / REPORT_NAME, markdown(cal) + f"\n![n_h heatmap and decay distributions]({FIGURE_NAME})\n")
    return md, fig
