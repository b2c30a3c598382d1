"""The calibration pass: run a GDN checkpoint over a corpus, capture every GDN layer's gate,
and turn it into per-head warm-up chunk counts (n_h) and classes (warm-up / exact).

The statistics are a pure function of gate tensors (`calibrate_gates`), so a synthetic gate
distribution can be calibrated without a checkpoint.

What a calibration is as stored (the artifact and its records) and the settings live in the leaf
modules flashqla_tune.calibration_artifact and flashqla_tune.calibration_settings, which a kernel
pack's loader reads too; this package imports them and no runtime or compiler module, and
re-exports them here as the pass's API.
"""
from ..calibration_artifact import EXACT, WARMUP, Calibration, HeadStats, LayerStats, load_calibration, save_calibration
from ..calibration_settings import CalibrationError, CalibrationSettings
from .statistics import GateAccumulator, calibrate_gates

__all__ = [
    "EXACT", "WARMUP", "Calibration", "CalibrationError", "CalibrationSettings", "GateAccumulator",
    "HeadStats", "LayerStats", "calibrate_gates", "load_calibration", "save_calibration",
]
