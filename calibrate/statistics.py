"""Gate-decay statistics per (layer, v-head): a pure function of captured gate tensors.

A warm-up window of n chunks before a segment boundary may replace exact state chaining when
the gate's summed log-decay over those n chunks is at most log(eps) (DESIGN.md, "The math").
For each head we measure, over every window of n consecutive full chunks inside one sequence,
the fraction whose sum stays *above* log(eps) (the windows that would not decay enough);
n_h is the smallest n <= N where that fraction is at most 1 - Q. No such n: class "exact".
For KDA's per-key-channel gate (g [.., Hv, K]) the same statistics are taken of each token's
least-negative channel gate, max_k g[t, k] (least_decay_gates): over a window its sum bounds the
norm of the window's transition product, while per-channel sums bound nothing (docs/kda.md).
Nothing here needs a checkpoint: tests and the benchmark call it on synthetic gates. The records it
returns (HeadStats, LayerStats) are the artifact's, in flashqla_tune.calibration_artifact.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from ..calibration_artifact import EXACT, QUANTILE_LEVELS, WARMUP, HeadStats, LayerStats
from ..calibration_settings import CalibrationError, CalibrationSettings


def as_sequences(gates) -> list[torch.Tensor]:
    """Accept [T, H], [B, T, H] or a list of [T_i, H]; return a list of [T_i, H] tensors."""
    if isinstance(gates, (list, tuple)):
        seqs = [torch.as_tensor(g) for g in gates]
        bad = [tuple(g.shape) for g in seqs if g.dim() != 2]
        if bad:
            raise CalibrationError(f"per-sequence gates must each be [T, Hv], got shapes {bad}")
        return seqs
    g = torch.as_tensor(gates)
    if g.dim() == 2:
        return [g]
    if g.dim() == 3:
        return list(g.unbind(0))
    raise CalibrationError(f"gate tensor must be [T, Hv] or [B, T, Hv], got shape {tuple(g.shape)}")


def least_decay_gates(gates) -> list[torch.Tensor]:
    """Per-key gates [T, Hv, K], [B, T, Hv, K] or a list of [T_i, Hv, K] -> a list of [T_i, Hv]
    holding max_k g[t, h, k], the per-token statistic of the KDA warm-up bound."""
    if isinstance(gates, (list, tuple)):
        seqs = [torch.as_tensor(g) for g in gates]
        bad = [tuple(g.shape) for g in seqs if g.dim() != 3]
        if bad:
            raise CalibrationError(f"per-sequence per-key gates must each be [T, Hv, K], got shapes {bad}")
    else:
        g = torch.as_tensor(gates)
        if g.dim() not in (3, 4):
            raise CalibrationError(f"per-key gate tensor must be [T, Hv, K] or [B, T, Hv, K], "
                                   f"got shape {tuple(g.shape)}")
        seqs = [g] if g.dim() == 3 else list(g.unbind(0))
    if any(g.shape[-1] == 0 for g in seqs):
        raise CalibrationError("per-key gate has no key channels (K = 0)")
    if any(g.numel() and not bool(torch.isfinite(g).all()) for g in seqs):
        raise CalibrationError("gate tensor holds NaN or inf values")
    return [g.max(dim=-1).values for g in seqs]


def chunk_log_decay(g: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Summed log-decay of every full chunk of one sequence: [T, H] -> [T // C, H] float64.
    A trailing partial chunk is left out: its smaller sum would understate how fast a head forgets."""
    full = (g.shape[0] // chunk_size) * chunk_size
    return g[:full].to(torch.float64).reshape(-1, chunk_size, g.shape[1]).sum(1)


def window_above_fraction(chunk_sums: Sequence[np.ndarray], max_window: int, log_eps: float):
    """For n = 1..N: the fraction of n-chunk windows (inside one sequence) whose summed log-decay
    is above log_eps. Returns (fractions [N, H] with NaN where no window exists, counts [N])."""
    num_heads = chunk_sums[0].shape[1]
    above = np.zeros((max_window, num_heads))
    counts = np.zeros(max_window, dtype=np.int64)
    for c in chunk_sums:
        # Grow each window by one chunk at a time (a running sum, not a difference of prefix
        # sums) so a window that sums to exactly log(eps) is not pushed across by rounding.
        windows = np.zeros_like(c)
        for n in range(1, min(max_window, c.shape[0]) + 1):
            windows = windows[: c.shape[0] - n + 1] + c[n - 1:]
            above[n - 1] += (windows > log_eps).sum(0)
            counts[n - 1] += windows.shape[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        fractions = np.where(counts[:, None] > 0, above / np.maximum(counts[:, None], 1), np.nan)
    return fractions, counts


def warmup_chunks(fractions: np.ndarray, quantile: float) -> list[int | None]:
    """n_h per head: the smallest n whose above-eps fraction is <= 1 - Q (None: exact)."""
    allowed = 1.0 - quantile
    out: list[int | None] = []
    for h in range(fractions.shape[1]):
        col = fractions[:, h]
        ok = np.nonzero(~np.isnan(col) & (col <= allowed))[0]
        out.append(int(ok[0]) + 1 if ok.size else None)
    return out


class GateAccumulator:
    """Collects one GDN layer's gates batch by batch, keeping only per-chunk sums and counts,
    so memory stays small however many tokens the corpus has."""

    def __init__(self, num_heads: int, settings: CalibrationSettings, per_key: bool = False):
        self.num_heads = num_heads
        self.settings = settings
        self.per_key = per_key      # gates come per key channel (KDA): reduced by least_decay_gates
        self.chunk_sums: list[np.ndarray] = []
        self.num_tokens = 0
        self.zero_counts = np.zeros(num_heads, dtype=np.int64)

    def add(self, gates) -> None:
        for g in (least_decay_gates(gates) if self.per_key else as_sequences(gates)):
            if g.shape[1] != self.num_heads:
                raise CalibrationError(f"gate has {g.shape[1]} v-heads, expected {self.num_heads}")
            if g.numel() and not bool(torch.isfinite(g).all()):
                raise CalibrationError("gate tensor holds NaN or inf values")
            if g.numel() and float(g.max()) > 0.0:
                raise CalibrationError(f"gate must be <= 0 (log of a decay factor), max is {float(g.max()):.3g}")
            self.num_tokens += g.shape[0]
            self.zero_counts += (g.abs() <= self.settings.zero_decay_tol).sum(0).cpu().numpy()
            sums = chunk_log_decay(g, self.settings.chunk_size)
            if sums.shape[0]:
                self.chunk_sums.append(sums.cpu().numpy())

    def finish(self, layer: int = 0, decoder_layer: int | None = None) -> LayerStats:
        s = self.settings
        if not self.chunk_sums:
            raise CalibrationError(f"no full chunk of {s.chunk_size} tokens in the gates "
                                   f"({self.num_tokens} tokens seen): the corpus is too short")
        all_sums = np.concatenate(self.chunk_sums)
        quants = np.quantile(all_sums, QUANTILE_LEVELS, axis=0)          # [levels, H]
        fractions, _ = window_above_fraction(self.chunk_sums, s.max_window, s.log_eps)
        n_h = warmup_chunks(fractions, s.quantile)
        heads = tuple(
            HeadStats(
                head=h, n_h=n_h[h], cls=WARMUP if n_h[h] is not None else EXACT,
                chunk_log_decay_quantiles=tuple(float(x) for x in quants[:, h]),
                above_fraction=tuple(None if np.isnan(f) else float(f) for f in fractions[:, h]),
                zero_decay_fraction=float(self.zero_counts[h] / max(self.num_tokens, 1)),
            )
            for h in range(self.num_heads)
        )
        return LayerStats(layer=layer, decoder_layer=layer if decoder_layer is None else decoder_layer,
                          num_tokens=self.num_tokens, num_chunks=int(all_sums.shape[0]), heads=heads)


def calibrate_gates(gates, settings: CalibrationSettings | None = None, layer: int = 0,
                    decoder_layer: int | None = None, per_key: bool = False) -> LayerStats:
    """Statistics of one layer's gates: a raw [T, Hv] / [B, T, Hv] tensor or a per-sequence list;
    with per_key, KDA gates [T, Hv, K] / [B, T, Hv, K] or a list of [T_i, Hv, K]."""
    seqs = least_decay_gates(gates) if per_key else as_sequences(gates)
    if not seqs:
        raise CalibrationError("no gate sequences given")
    acc = GateAccumulator(seqs[0].shape[1], settings or CalibrationSettings())
    acc.add(seqs)
    return acc.finish(layer, decoder_layer)


def calibrate_layers(layer_gates: Iterable, settings: CalibrationSettings | None = None) -> list[LayerStats]:
    """Convenience: one LayerStats per layer from an iterable of per-layer gates."""
    return [calibrate_gates(g, settings, layer=i) for i, g in enumerate(layer_gates)]
