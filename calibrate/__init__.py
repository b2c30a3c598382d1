"""The calibration pass: run a GDN checkpoint over a corpus, capture every GDN layer's gate,
and turn it into per-head warm-up chunk counts (n_h) and classes (warm-up / exact).

The statistics are a pure function of gate tensors (`calibrate_gates`), so a synthetic gate
distribution can be calibrated without a checkpoint.
"""
from .artifact import Calibration, load_calibration, save_calibration
from .errors import CalibrationError
from .settings import CalibrationSettings
from .statistics import EXACT, WARMUP, GateAccumulator, HeadStats, LayerStats, calibrate_gates

__all__ = [
    "EXACT", "WARMUP", "Calibration", "CalibrationError", "CalibrationSettings", "GateAccumulator",
    "HeadStats", "LayerStats", "calibrate_gates", "load_calibration", "save_calibration",
]
