"""One exception type for everything the calibration pass refuses, so the CLI can report it."""
from __future__ import annotations


class CalibrationError(ValueError):
    """A bad checkpoint, corpus, setting or artifact; the message names what is wrong."""
