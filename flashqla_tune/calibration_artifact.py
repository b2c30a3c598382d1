"""The calibration artifact: what a calibration is, as stored (a versioned JSON file keyed by
checkpoint and corpus hashes), and its reading and writing.

A leaf shared by both sides: the calibration pass (calibrate/) makes and saves these records, a
kernel pack's loader reads them. Loading fails closed: another checkpoint's artifact, an unknown
schema, or a damaged file is an error that says which, never a silently reused table.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from . import __version__
from .calibration_settings import CalibrationError, CalibrationSettings
from .files import atomic_write_text

WARMUP, EXACT = "warmup", "exact"
# Quantile levels of the per-chunk summed log-decay stored per head (0 = most decay).
QUANTILE_LEVELS = (0.0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 1.0)


@dataclass(frozen=True)
class HeadStats:
    head: int
    n_h: int | None                      # None for class "exact"
    cls: str                             # WARMUP or EXACT
    chunk_log_decay_quantiles: tuple[float, ...]   # at QUANTILE_LEVELS
    above_fraction: tuple[float | None, ...]       # n = 1..N; None where no window of n chunks exists
    zero_decay_fraction: float

    @property
    def warmup(self) -> int:
        """The kernel-table value: warm-up chunks, or -1 = chain exactly."""
        return -1 if self.n_h is None else self.n_h


@dataclass(frozen=True)
class LayerStats:
    layer: int            # GDN-layer index (0-based over the model's GDN layers)
    decoder_layer: int    # index among all decoder layers
    num_tokens: int
    num_chunks: int
    heads: tuple[HeadStats, ...] = field(default_factory=tuple)

    @property
    def warmup_table(self) -> list[int]:
        return [h.warmup for h in self.heads]

    def summary_line(self, max_window: int) -> str:
        """One plain-language sentence, e.g. 'layer 3: 6 of 8 heads reach eps within 2 chunks; ...'."""
        warm = [h.n_h for h in self.heads if h.n_h is not None]
        exact = len(self.heads) - len(warm)
        parts = []
        if warm:
            spread = f"within {max(warm)} chunk{'s' if max(warm) > 1 else ''}"
            if min(warm) != max(warm):
                spread += f" (fastest {min(warm)}, median {int(median(warm))})"
            parts.append(f"{len(warm)} of {len(self.heads)} heads reach eps {spread}")
        else:
            parts.append(f"0 of {len(self.heads)} heads reach eps within {max_window} chunks")
        if exact:
            zero = sum(1 for h in self.heads if h.n_h is None and h.zero_decay_fraction > 0.5)
            note = f"; {zero} of them mostly zero-decay" if zero else ""
            parts.append(f"{exact} head{'s' if exact > 1 else ''} never decay enough within "
                         f"{max_window} chunks: exact{note}")
        return f"layer {self.layer}: " + "; ".join(parts)


SCHEMA = "flashqla-tune.calibration"
SCHEMA_VERSION = 1
ARTIFACT_NAME = "calibration.json"


@dataclass
class Calibration:
    checkpoint_sha256: str
    checkpoint_path: str
    family: str
    model_type: str
    spec: dict
    corpus: dict            # name, sha256, num_sequences, seq_len, num_tokens
    settings: CalibrationSettings
    layers: list[LayerStats]
    run: dict = field(default_factory=dict)   # device, seconds, peak memory: informative only
    tool_version: str = __version__
    schema_version: int = SCHEMA_VERSION

    def model_table(self) -> list[int]:
        """One warm-up count per v-head for `layer=None`: the largest n_h over layers, -1 if any
        layer needs that head chained exactly."""
        table: list[int] = []
        for h in range(len(self.layers[0].heads)):
            vals = [layer.heads[h].warmup for layer in self.layers]
            table.append(-1 if -1 in vals else max(vals))
        return table

    def summary_lines(self) -> list[str]:
        return [layer.summary_line(self.settings.max_window) for layer in self.layers]

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "schema_version": self.schema_version, "tool_version": self.tool_version,
            "checkpoint": {"sha256": self.checkpoint_sha256, "path": self.checkpoint_path,
                           "family": self.family, "model_type": self.model_type, "spec": self.spec},
            "corpus": self.corpus,
            "settings": self.settings.to_dict(),
            "quantile_levels": list(QUANTILE_LEVELS),
            "run": self.run,
            "model_table": self.model_table(),
            "layers": [_layer_to_dict(layer, self.settings.max_window) for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "Calibration":
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise CalibrationError(f"{source} is not a flashqla-tune calibration artifact "
                                   f"(schema {data.get('schema') if isinstance(data, dict) else None!r})")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise CalibrationError(f"{source} has calibration schema version {version!r}; this tool "
                                   f"({__version__}) reads version {SCHEMA_VERSION}: recalibrate")
        try:
            levels = tuple(data["quantile_levels"])
            if levels != QUANTILE_LEVELS:
                raise CalibrationError(f"{source} stores quantile levels {levels}, expected {QUANTILE_LEVELS}")
            ck = data["checkpoint"]
            return cls(
                checkpoint_sha256=ck["sha256"], checkpoint_path=ck["path"], family=ck["family"],
                model_type=ck["model_type"], spec=ck["spec"], corpus=data["corpus"],
                settings=CalibrationSettings.from_dict(data["settings"]),
                layers=[_layer_from_dict(d) for d in data["layers"]], run=data.get("run", {}),
                tool_version=data["tool_version"], schema_version=version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CalibrationError):
                raise
            raise CalibrationError(f"{source} is a damaged calibration artifact: {type(exc).__name__}: {exc}") from exc


def _layer_to_dict(layer: LayerStats, max_window: int) -> dict:
    return {
        "layer": layer.layer, "decoder_layer": layer.decoder_layer, "num_tokens": layer.num_tokens,
        "num_chunks": layer.num_chunks, "summary": layer.summary_line(max_window),
        "warmup": layer.warmup_table,
        "heads": [{"head": h.head, "n_h": h.n_h, "class": h.cls,
                   "chunk_log_decay_quantiles": list(h.chunk_log_decay_quantiles),
                   "above_fraction": list(h.above_fraction),
                   "zero_decay_fraction": h.zero_decay_fraction} for h in layer.heads],
    }


def _layer_from_dict(d: dict) -> LayerStats:
    heads = []
    for h in d["heads"]:
        cls, n_h = h["class"], h["n_h"]
        if cls not in (WARMUP, EXACT) or (cls == EXACT) != (n_h is None):
            raise CalibrationError(f"layer {d['layer']} head {h['head']}: class {cls!r} with n_h {n_h!r}")
        heads.append(HeadStats(head=int(h["head"]), n_h=None if n_h is None else int(n_h), cls=cls,
                               chunk_log_decay_quantiles=tuple(float(x) for x in h["chunk_log_decay_quantiles"]),
                               above_fraction=tuple(None if x is None else float(x) for x in h["above_fraction"]),
                               zero_decay_fraction=float(h["zero_decay_fraction"])))
    return LayerStats(layer=int(d["layer"]), decoder_layer=int(d["decoder_layer"]), num_tokens=int(d["num_tokens"]),
                      num_chunks=int(d["num_chunks"]), heads=tuple(heads))


def save_calibration(cal: Calibration, path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir() or path.suffix != ".json":
        path = path / ARTIFACT_NAME
    return atomic_write_text(path, json.dumps(cal.to_dict(), indent=1) + "\n")


def load_calibration(path: str | Path, checkpoint_sha256: str | None = None) -> Calibration:
    """Read an artifact; with checkpoint_sha256, refuse one made for another checkpoint."""
    path = Path(path)
    if path.is_dir():
        path = path / ARTIFACT_NAME
    if not path.is_file():
        raise CalibrationError(f"no calibration artifact at {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{path} is a damaged calibration artifact (not JSON: {exc})") from exc
    cal = Calibration.from_dict(data, source=str(path))
    if checkpoint_sha256 is not None and cal.checkpoint_sha256 != checkpoint_sha256:
        raise CalibrationError(
            f"{path} was calibrated for checkpoint {cal.checkpoint_sha256[:16]} ({cal.checkpoint_path}), "
            f"not for this checkpoint {checkpoint_sha256[:16]}: recalibrate")
    return cal


__all__ = ["ARTIFACT_NAME", "Calibration", "EXACT", "HeadStats", "LayerStats", "QUANTILE_LEVELS", "SCHEMA",
           "SCHEMA_VERSION", "WARMUP", "load_calibration", "save_calibration"]
