"""Tune one spec on this machine's GPU: the entry point `flashqla-tune tune` and `build` share."""
from __future__ import annotations

import os

from .. import environment
from ..plan import kernel_spec
from ..spec import GDNSpec
from .measure import gpu_measurement
from .study import open_study, study_path
from .trial import BatchTuner, TuneResult


class NoTuningGPU(RuntimeError):
    """Tuning times kernels on an sm_90 GPU, and this machine has none."""


def require_tuning_gpu() -> environment.GPUInfo:
    gpu = environment.gpu_info()
    if gpu is None:
        raise NoTuningGPU("tuning needs an sm_90 GPU (it checks and times each config on it), but this machine "
                          "has no CUDA GPU (torch.cuda.is_available() is False); build an untuned pack with "
                          "`flashqla-tune build CHECKPOINT --out PACK --no-tune`, or tune on an H100/H200")
    if gpu.capability != (9, 0):
        raise NoTuningGPU(f"tuning needs an sm_90 GPU; {gpu.name} is {gpu.arch}")
    return gpu


def tune_spec(spec: GDNSpec, gpu_name: str, *, budget_s: float | None = None, max_trials: int | None = None,
              jobs: int | None = None, seed: int | None = None, root=None, progress: bool = True,
              measurement=None) -> TuneResult:
    """Run (or resume) the study of spec on gpu_name until the budget or trial cap. The
    measurement (the GPU one by default) is closed on return: its measuring process ends."""
    spec = kernel_spec(spec)
    jobs = jobs or max(1, os.cpu_count() or 1)
    measurement = measurement or gpu_measurement(jobs)
    try:
        study = open_study(spec, gpu_name, root, seed=seed)
        lock = study_path(spec, gpu_name, root).with_suffix(".enqueue.lock")
        tuner = BatchTuner(spec, study, measurement, batch_size=jobs, budget_s=budget_s,
                           max_trials=max_trials, progress=progress, lock_path=lock)
        return tuner.run()
    finally:
        if measurement.close is not None:
            measurement.close()
