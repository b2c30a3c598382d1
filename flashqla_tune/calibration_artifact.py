"""The calibration artifact: what a calibration is, as stored (a versioned JSON file keyed by
checkpoint and corpus hashes), and its reading and writing.

A leaf shared by both sides: the calibration pass (calibrate/) makes and saves these records, a
kernel pack's loader reads them. Loading fails closed: another checkpoint's artifact, an unknown
schema, or a damaged file (any field of the wrong type, out of range, or disagreeing with the
spec or the settings) is an error that names the file and the field, never a silently reused table.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from . import __version__
from .calibration_settings import CalibrationError, CalibrationSettings
from .files import atomic_write_text
from .spec import GDNSpec

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
# Version 1: a scalar gate, the statistics of g per token. Version 2: KDA's per-key-channel gate,
# the same statistics of each token's least-negative channel gate, max_k g[t, k], the quantity whose
# window sum bounds the warm-up error (docs/kda.md); it names that in `gate_statistic`. Scalar-gate
# artifacts are written as version 1, unchanged; both versions load.
SCHEMA_VERSION = 1
KDA_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (SCHEMA_VERSION, KDA_SCHEMA_VERSION)
MAX_KEY_CHANNEL = "max_key_channel"
ARTIFACT_NAME = "calibration.json"


def schema_version_for(spec: dict) -> int:
    """The artifact version a calibration of spec (GDNSpec.to_dict()) is written as."""
    return KDA_SCHEMA_VERSION if isinstance(spec, dict) and spec.get("gate_kind") == "per_key" else SCHEMA_VERSION


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
    schema_version: int | None = None      # None: schema_version_for(spec)

    def __post_init__(self) -> None:
        if self.schema_version is None:
            self.schema_version = schema_version_for(self.spec)

    @property
    def gate_statistic(self) -> str | None:
        """What the per-head statistics are of: MAX_KEY_CHANNEL for KDA (version 2), None for the
        scalar gate (g itself)."""
        return MAX_KEY_CHANNEL if self.schema_version == KDA_SCHEMA_VERSION else None

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
        kda = {"gate_statistic": MAX_KEY_CHANNEL} if self.schema_version == KDA_SCHEMA_VERSION else {}
        return {
            "schema": SCHEMA, "schema_version": self.schema_version, "tool_version": self.tool_version, **kda,
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
        """Read a stored artifact, checking every field against the schema: a wrong type, a value
        out of range or tables that disagree is an error naming source and the field."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise CalibrationError(f"{source} is not a flashqla-tune calibration artifact "
                                   f"(schema {data.get('schema') if isinstance(data, dict) else None!r})")
        version = data.get("schema_version")
        if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
            raise CalibrationError(f"{source} has calibration schema version {version!r}; this tool "
                                   f"({__version__}) reads versions {SCHEMA_VERSION} (scalar gate) and "
                                   f"{KDA_SCHEMA_VERSION} (per-key gate): recalibrate")
        try:
            return _calibration_from_dict(data, version)
        except _FieldError as exc:
            raise CalibrationError(f"{source} is a damaged calibration artifact: {exc}") from None


class _FieldError(ValueError):
    """A stored field that breaks the schema; the message starts with the field's path."""


def _field(data: dict, key: str, where: str):
    if not isinstance(data, dict):
        raise _FieldError(f"{where or 'the file'} is a JSON {type(data).__name__}, not an object")
    if key not in data:
        raise _FieldError(f"{where + '.' if where else ''}{key} is missing")
    return data[key]


def _int(value, where: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _FieldError(f"{where} is {value!r}: it must be an integer")
    if value < low or (high is not None and value > high):
        bound = (str(low) if low == high else f"{low}..{high}") if high is not None else f">= {low}"
        raise _FieldError(f"{where} is {value}: it must be {bound}")
    return value


def _number(value, where: str, low: float | None = None, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _FieldError(f"{where} is {value!r}: it must be a number")
    if (low is not None and value < low) or (high is not None and value > high):
        raise _FieldError(f"{where} is {value}: it must be in [{low}, {high}]")
    return float(value)


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise _FieldError(f"{where} is {type(value).__name__} {value!r:.40}: it must be a list")
    return value


def _calibration_from_dict(data: dict, version: int) -> Calibration:
    levels = _list(_field(data, "quantile_levels", ""), "quantile_levels")
    if tuple(levels) != QUANTILE_LEVELS:
        raise _FieldError(f"quantile_levels are {tuple(levels)}, expected {QUANTILE_LEVELS}")
    ck = _field(data, "checkpoint", "")
    texts = {key: _field(ck, key, "checkpoint") for key in ("sha256", "path", "family", "model_type")}
    for key, value in texts.items():
        if not isinstance(value, str):
            raise _FieldError(f"checkpoint.{key} is {value!r}: it must be a string")
    spec = _field(ck, "spec", "checkpoint")
    try:
        num_v_heads = GDNSpec.from_dict(spec).num_v_heads if isinstance(spec, dict) else None
    except (TypeError, ValueError) as exc:
        raise _FieldError(f"checkpoint.spec: {exc}") from None
    if num_v_heads is None:
        raise _FieldError(f"checkpoint.spec is {spec!r}: it must be an object")
    if schema_version_for(spec) != version:
        raise _FieldError(f"schema_version is {version} but checkpoint.spec has gate_kind={spec.get('gate_kind')!r}: "
                          f"a scalar gate's artifact is version {SCHEMA_VERSION}, a per-key gate's "
                          f"version {KDA_SCHEMA_VERSION}")
    if version == KDA_SCHEMA_VERSION and data.get("gate_statistic") != MAX_KEY_CHANNEL:
        raise _FieldError(f"gate_statistic is {data.get('gate_statistic')!r}: a version {KDA_SCHEMA_VERSION} "
                          f"artifact records {MAX_KEY_CHANNEL!r}")
    corpus = _field(data, "corpus", "")
    if not isinstance(corpus, dict):
        raise _FieldError(f"corpus is {corpus!r}: it must be an object")
    try:
        settings = CalibrationSettings.from_dict(_field(data, "settings", ""))
    except CalibrationError as exc:
        raise _FieldError(f"settings: {exc}") from None
    layers = _list(_field(data, "layers", ""), "layers")
    if not layers:
        raise _FieldError("layers is []: a calibration has at least one GDN layer")
    parsed = [_layer_from_dict(d, i, settings, num_v_heads) for i, d in enumerate(layers)]
    run = data.get("run", {})
    tool_version = _field(data, "tool_version", "")
    if not isinstance(run, dict) or not isinstance(tool_version, str):
        raise _FieldError(f"run ({type(run).__name__}) must be an object and tool_version "
                          f"({tool_version!r}) a string")
    return Calibration(checkpoint_sha256=texts["sha256"], checkpoint_path=texts["path"], family=texts["family"],
                       model_type=texts["model_type"], spec=spec, corpus=corpus, settings=settings, layers=parsed,
                       run=run, tool_version=tool_version, schema_version=version)


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


def _layer_from_dict(d: dict, index: int, settings: CalibrationSettings, num_v_heads: int) -> LayerStats:
    """Layer `index` of the artifact: every v-head of the spec once, in order (head h at position
    h), each a warm-up head with 1 <= n_h <= the settings' max window or an exact head."""
    where = f"layers[{index}]"
    layer = _int(_field(d, "layer", where), f"{where}.layer", index, index)
    heads_data = _list(_field(d, "heads", where), f"{where}.heads")
    if len(heads_data) != num_v_heads:
        raise _FieldError(f"{where}.heads holds {len(heads_data)} heads, but the spec has "
                          f"num_v_heads={num_v_heads} (every layer has one entry per v-head)")
    heads = []
    for position, h in enumerate(heads_data):
        at = f"{where}.heads[{position}]"
        head = _int(_field(h, "head", at), f"{at}.head", position, position)
        cls, n_h = _field(h, "class", at), _field(h, "n_h", at)
        if cls == WARMUP:
            n_h = _int(n_h, f"{at}.n_h", 1, settings.max_window)
        elif cls == EXACT:
            if n_h is not None:
                raise _FieldError(f"{at}.n_h is {n_h!r}: an exact head stores null")
        else:
            raise _FieldError(f"{at}.class is {cls!r}: it must be {WARMUP!r} or {EXACT!r}")
        quantiles = _list(_field(h, "chunk_log_decay_quantiles", at), f"{at}.chunk_log_decay_quantiles")
        if len(quantiles) != len(QUANTILE_LEVELS):
            raise _FieldError(f"{at}.chunk_log_decay_quantiles holds {len(quantiles)} values, expected "
                              f"{len(QUANTILE_LEVELS)} (one per quantile level)")
        above = _list(_field(h, "above_fraction", at), f"{at}.above_fraction")
        if len(above) != settings.max_window:
            raise _FieldError(f"{at}.above_fraction holds {len(above)} values, expected one per window "
                              f"length 1..{settings.max_window}")
        heads.append(HeadStats(
            head=head, n_h=n_h, cls=cls,
            chunk_log_decay_quantiles=tuple(_number(x, f"{at}.chunk_log_decay_quantiles[{i}]")
                                            for i, x in enumerate(quantiles)),
            above_fraction=tuple(None if x is None else _number(x, f"{at}.above_fraction[{i}]", 0.0, 1.0)
                                 for i, x in enumerate(above)),
            zero_decay_fraction=_number(_field(h, "zero_decay_fraction", at), f"{at}.zero_decay_fraction",
                                        0.0, 1.0)))
    return LayerStats(layer=layer, decoder_layer=_int(_field(d, "decoder_layer", where), f"{where}.decoder_layer", 0),
                      num_tokens=_int(_field(d, "num_tokens", where), f"{where}.num_tokens", 0),
                      num_chunks=_int(_field(d, "num_chunks", where), f"{where}.num_chunks", 0), heads=tuple(heads))


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


__all__ = ["ARTIFACT_NAME", "Calibration", "EXACT", "HeadStats", "KDA_SCHEMA_VERSION", "LayerStats", "MAX_KEY_CHANNEL",
           "QUANTILE_LEVELS", "READABLE_SCHEMA_VERSIONS", "SCHEMA", "SCHEMA_VERSION", "WARMUP", "load_calibration",
           "save_calibration", "schema_version_for"]
