"""calibrate_checkpoint: checkpoint + corpus -> Calibration artifact and report.

Everything that can be refused (config, tensors, tokenizer, corpus, settings) is checked
before the model runs, and files are written only at the end, atomically, so a failed run
leaves no partial artifact behind.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..calibration_artifact import Calibration, save_calibration
from ..calibration_settings import CalibrationError, CalibrationSettings
from ..environment import cache_dir
from ..model_config import ConfigError, read_model_config
from .adapters import adapter_class
from .corpus import load_tokenizer, read_corpus, tokenize_corpus
from .default_model import default_model_path
from ..content_hash import checkpoint_hash
from .runner import run_layer_by_layer, steps
from .weights import WeightIndex

# Defaults per device kind: the GPU takes 64 sequences of 4096 tokens; the CPU takes fewer so
# that calibrating the shipped model stays under a minute on a 2-core machine.
DEFAULT_TOKENS = {"cuda": (4096, 64), "cpu": (2048, 24)}


@dataclass
class CalibrationResult:
    calibration: Calibration
    artifact: Path | None
    report: Path | None
    figure: Path | None


def default_out_dir(sha: str) -> Path:
    return cache_dir() / "calibrations" / sha[:16]


def _pick(device, dtype):
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return dev, dt


def calibrate_checkpoint(checkpoint=None, corpus=None, settings: CalibrationSettings | None = None,
                         out_dir=None, *, seq_len: int | None = None,
                         max_sequences: int | None = None, batch_size: int = 8,
                         device=None, dtype=None, offload: bool = False, progress: bool = True,
                         write: bool = True) -> CalibrationResult:
    settings = settings or CalibrationSettings()
    ckpt = Path(checkpoint) if checkpoint is not None else default_model_path()
    if not ckpt.is_dir():
        raise CalibrationError(f"checkpoint folder {ckpt} does not exist")
    try:
        model = read_model_config(ckpt)
    except ConfigError as exc:
        raise CalibrationError(f"{ckpt}: {exc}") from exc
    if not model.gdn_layers:
        raise CalibrationError(f"{ckpt}: model has no GDN (linear_attention) layers")
    if model.spec.gate_kind != "scalar":
        raise CalibrationError(f"{ckpt}: gate kind {model.spec.gate_kind!r} is not calibrated yet")
    weights = WeightIndex(ckpt)
    tokenizer = load_tokenizer(ckpt)
    texts = read_corpus(corpus)
    dev, dt = _pick(device, dtype)
    default_len, default_n = DEFAULT_TOKENS["cuda" if dev.type == "cuda" else "cpu"]
    corpus_name = str(corpus) if corpus is not None else "shipped:corpus.txt"
    tokens = tokenize_corpus(texts, tokenizer, seq_len or default_len,
                             default_n if max_sequences is None else max_sequences, corpus_name)
    adapter = adapter_class(model.family)(ckpt, model, weights, dev, dt)
    adapter.check()
    sha = checkpoint_hash(ckpt)

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps(model, tokens.input_ids, batch_size), desc="calibrate", unit="layer-batch")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    start = time.perf_counter()
    try:
        layers = run_layer_by_layer(adapter, tokens.input_ids, settings, batch_size, offload, bar)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    run = {"device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev), "dtype": str(dt),
           "seconds": round(seconds, 3), "batch_size": batch_size, "offload": offload,
           "torch": torch.__version__}
    if dev.type == "cuda":
        run["peak_gpu_memory_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    cal = Calibration(checkpoint_sha256=sha, checkpoint_path=str(ckpt.resolve()), family=model.family,
                      model_type=model.model_type, spec=model.spec.to_dict(), corpus=tokens.describe(),
                      settings=settings, layers=layers, run=run)
    if not write:
        return CalibrationResult(cal, None, None, None)
    out = Path(out_dir) if out_dir is not None else default_out_dir(sha)
    from .report import write_report

    report, figure = write_report(cal, out)
    artifact = save_calibration(cal, out)    # last, so its presence means the report is there too
    return CalibrationResult(cal, artifact, report, figure)
