"""The Optuna tuner: one study per (spec, GPU name), persisted in the cache as a journal file.

search_space: TileParams <-> trial parameters and the known-good configs; study: storage and
study naming; trial: one batch of trials (validate, build in parallel, check, time); report:
the closing table. The measurement is injected, so the bookkeeping runs without a GPU.
"""
from .search_space import SPACE, known_good, suggest_tiles, tiles_from_params
from .study import open_study, study_name, study_path
from .trial import BatchTuner, TuneResult, Measurement

__all__ = ["SPACE", "BatchTuner", "Measurement", "TuneResult", "known_good", "open_study", "study_name",
           "study_path", "suggest_tiles", "tiles_from_params"]
