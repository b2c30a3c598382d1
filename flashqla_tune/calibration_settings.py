"""The knobs that decide a calibration's answer (stored in the artifact with it), their defaults,
and the one exception type for everything the calibration refuses.

A leaf shared by both sides: the calibration pass (calibrate/) and the runtime, whose guard
bound defaults to the calibration's eps (warm-up tables passed without a calibration).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from .supported_shapes import MAX_WINDOW_CHUNKS

DEFAULT_EPS = 1e-5
DEFAULT_MAX_WINDOW = 16
DEFAULT_QUANTILE = 0.999
DEFAULT_CHUNK = 64
# A token with |g| at or below this forgets nothing measurable (decay factor >= 0.9999).
DEFAULT_ZERO_DECAY_TOL = 1e-4


class CalibrationError(ValueError):
    """A bad checkpoint, corpus, setting or artifact; the message names what is wrong."""


@dataclass(frozen=True)
class CalibrationSettings:
    eps: float = DEFAULT_EPS
    max_window: int = DEFAULT_MAX_WINDOW
    quantile: float = DEFAULT_QUANTILE
    chunk_size: int = DEFAULT_CHUNK
    zero_decay_tol: float = DEFAULT_ZERO_DECAY_TOL

    def __post_init__(self) -> None:
        for name in ("eps", "quantile", "zero_decay_tol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CalibrationError(f"{name} must be a number, got {value!r}")
        if not (isinstance(self.eps, (int, float)) and 0.0 < float(self.eps) < 1.0):
            raise CalibrationError(f"eps must be in (0, 1), got {self.eps!r}")
        if not (isinstance(self.quantile, (int, float)) and 0.0 < float(self.quantile) < 1.0):
            raise CalibrationError(f"quantile Q must be in (0, 1), got {self.quantile!r}")
        if isinstance(self.max_window, bool) or not isinstance(self.max_window, int) or self.max_window < 1:
            raise CalibrationError(f"max window N must be an int >= 1, got {self.max_window!r}")
        if self.max_window > MAX_WINDOW_CHUNKS:
            raise CalibrationError(f"max window N={self.max_window} exceeds the kernels' window cap of "
                                   f"{MAX_WINDOW_CHUNKS} chunks")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise CalibrationError(f"chunk size must be an int >= 1, got {self.chunk_size!r}")
        if not (float(self.zero_decay_tol) >= 0.0):
            raise CalibrationError(f"zero-decay tolerance must be >= 0, got {self.zero_decay_tol!r}")

    @property
    def log_eps(self) -> float:
        return math.log(self.eps)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CalibrationSettings":
        """The stored settings as written: a value of the wrong type (n as "16" or 16.0) is refused,
        not converted."""
        if not isinstance(data, dict):
            raise CalibrationError(f"settings is a JSON {type(data).__name__}, not an object")
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise CalibrationError(f"settings lack {', '.join(missing)}")
        return cls(**{f.name: data[f.name] for f in fields(cls)})


__all__ = ["CalibrationError", "CalibrationSettings", "DEFAULT_CHUNK", "DEFAULT_EPS", "DEFAULT_MAX_WINDOW",
           "DEFAULT_QUANTILE", "DEFAULT_ZERO_DECAY_TOL"]
