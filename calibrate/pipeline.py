"""calibrate_checkpoint: checkpoint + corpus -> Calibration artifact and report.

Everything that can be refused (config, tensors, tokenizer, corpus, settings) is checked
before the model runs, and files are written only at the end, atomically, so a failed run
leaves no partial artifact behind.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..calibration_artifact import ARTIFACT_NAME, SCHEMA, Calibration, save_calibration
from ..calibration_settings import CalibrationError, CalibrationSettings
from ..environment import cache_dir
from ..model_config import ConfigError, read_model_config
from ..supported_shapes import heads_problem
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


def resolve_device(device) -> torch.device:
    """The device to calibrate on: the one asked for (refused by name when this machine has none
    such), else cuda when there is one, else cpu."""
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise CalibrationError(f"--device {device!r} is not a device (cuda, cuda:N or cpu): {exc}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CalibrationError(f"--device {device}: this machine has no CUDA device (or this torch, "
                                   f"{torch.__version__}, is built without CUDA); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CalibrationError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise CalibrationError(f"--device {device}: calibration runs on cuda or cpu")
    return dev


def _pick(device, dtype):
    dev = resolve_device(device)
    if dtype is None:
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return dev, dt


def check_sizes(seq_len, max_sequences, batch_size) -> None:
    """Sequence length, sequence count and batch size are positive integers (None: the default)."""
    for name, value in (("seq_len", seq_len), ("max_sequences", max_sequences), ("batch_size", batch_size)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CalibrationError(f"{name}={value!r} must be a positive integer")


def check_out_dir(out: Path, force: bool = False) -> None:
    """Refuse an output path the calibration would fail on or whose files are not ours to replace:
    a file; or a folder holding calibration.json, .md or .png unless its calibration.json is a
    flashqla-tune calibration artifact (then the three are ours, written together). force replaces
    them all."""
    from .report import FIGURE_NAME, REPORT_NAME

    if out.exists() and not out.is_dir():
        raise CalibrationError(f"--out {out} is a file, not a folder: give a folder for the artifact and report")
    if force or not out.is_dir():
        return
    present = [out / name for name in (ARTIFACT_NAME, REPORT_NAME, FIGURE_NAME) if (out / name).exists()]
    if not present or _is_our_artifact(out / ARTIFACT_NAME):
        return
    raise CalibrationError(f"{present[0]} is not part of a flashqla-tune calibration (no calibration artifact of "
                           f"ours beside it): calibrate will not replace it; choose another --out or pass --force")


def _is_our_artifact(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.get("schema") == SCHEMA


def calibrate_checkpoint(checkpoint=None, corpus=None, settings: CalibrationSettings | None = None,
                         out_dir=None, *, seq_len: int | None = None,
                         max_sequences: int | None = None, batch_size: int = 8,
                         device=None, dtype=None, offload: bool = False, progress: bool = True,
                         write: bool = True, qkv_dtype: str | None = None,
                         force: bool = False) -> CalibrationResult:
    """qkv_dtype replaces the checkpoint's dtype in the artifact's spec (the one the kernels will
    be built for); force lets the files be written over ones that are not a calibration's."""
    settings = settings or CalibrationSettings()
    check_sizes(seq_len, max_sequences, batch_size)
    if write and out_dir is not None:
        check_out_dir(Path(out_dir), force)
    dev, dt = _pick(device, dtype)
    ckpt = Path(checkpoint) if checkpoint is not None else default_model_path()
    if not ckpt.is_dir():
        raise CalibrationError(f"checkpoint folder {ckpt} does not exist")
    try:
        model = read_model_config(ckpt)
    except ConfigError as exc:
        raise CalibrationError(f"{ckpt}: {exc}") from exc
    if not model.gdn_layers:
        raise CalibrationError(f"{ckpt}: model has no GDN (linear_attention) layers")
    if problem := heads_problem(model.spec.num_qk_heads, model.spec.num_v_heads):
        raise CalibrationError(f"{ckpt}: {problem}")
    spec = model.spec if qkv_dtype is None else dataclasses.replace(model.spec, qkv_dtype=qkv_dtype)
    texts = read_corpus(corpus)
    weights = WeightIndex(ckpt)
    tokenizer = load_tokenizer(ckpt)
    default_len, default_n = DEFAULT_TOKENS["cuda" if dev.type == "cuda" else "cpu"]
    corpus_name = str(corpus) if corpus is not None else "shipped:corpus.txt"
    tokens = tokenize_corpus(texts, tokenizer, default_len if seq_len is None else seq_len,
                             default_n if max_sequences is None else max_sequences, corpus_name)
    adapter = adapter_class(model.family)(ckpt, model, weights, dev, dt)
    adapter.check()
    sha = checkpoint_hash(ckpt)
    if write and out_dir is None:
        check_out_dir(default_out_dir(sha), force)

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
                      model_type=model.model_type, spec=spec.to_dict(), corpus=tokens.describe(),
                      settings=settings, layers=layers, run=run)
    if not write:
        return CalibrationResult(cal, None, None, None)
    out = Path(out_dir) if out_dir is not None else default_out_dir(sha)
    from .report import write_report

    report, figure = write_report(cal, out)
    artifact = save_calibration(cal, out)    # last, so its presence means the report is there too
    return CalibrationResult(cal, artifact, report, figure)
