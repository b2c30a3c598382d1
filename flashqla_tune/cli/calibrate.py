"""flashqla-tune calibrate [CHECKPOINT]: per-head gate-decay calibration (artifact + report).

The calibration flags are shared with `build` (add_calibration_arguments); their defaults are
applied here, so a command can tell a flag the user gave from one left alone."""
from __future__ import annotations

import json
from pathlib import Path

from ..calibration_settings import DEFAULT_EPS, DEFAULT_MAX_WINDOW, DEFAULT_QUANTILE
from ..supported_shapes import MAX_WINDOW_CHUNKS, SUPPORTED

SUPPORTED_QKV_DTYPES = SUPPORTED.qkv_dtypes

DEFAULT_BATCH_SIZE = 8
# (argument dest, flag) of every calibration flag, in the order --help lists them
CALIBRATION_FLAGS = (("corpus", "--corpus"), ("eps", "--eps"), ("max_window", "--max-window"),
                     ("quantile", "--quantile"), ("seq_len", "--seq-len"), ("max_sequences", "--max-sequences"),
                     ("batch_size", "--batch-size"), ("device", "--device"), ("offload", "--offload"))


def add_calibration_arguments(p) -> None:
    """How a checkpoint is calibrated: corpus, settings, sizes, device (`calibrate` and `build`)."""
    p.add_argument("--corpus", help="text file or folder of text files (default: the shipped corpus)")
    p.add_argument("--eps", type=float, help=f"state error bound for warm-up (default {DEFAULT_EPS:g})")
    p.add_argument("--max-window", type=int,
                   help=f"window cap N in chunks, 1..{MAX_WINDOW_CHUNKS} (default {DEFAULT_MAX_WINDOW})")
    p.add_argument("--quantile", type=float, help=f"quantile Q (default {DEFAULT_QUANTILE:g})")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 4096 on GPU, 2048 on CPU)")
    p.add_argument("--max-sequences", type=int, help="sequences used (default 64 on GPU, 24 on CPU)")
    p.add_argument("--batch-size", type=int, help=f"sequences per forward (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when there is one)")
    p.add_argument("--offload", action="store_true", help="keep hidden states on the CPU between layers")


def given_calibration_flags(args) -> list[str]:
    """The calibration flags the command line set."""
    return [flag for dest, flag in CALIBRATION_FLAGS if getattr(args, dest) not in (None, False)]


def check_calibration_sizes(args) -> None:
    """Sizes the flags gave are positive (refused by flag name before any work)."""
    for dest, flag in (("seq_len", "--seq-len"), ("max_sequences", "--max-sequences"), ("batch_size", "--batch-size")):
        value = getattr(args, dest)
        if value is not None and value <= 0:
            raise ValueError(f"{flag}={value} must be positive")


def calibration_settings(args):
    """The CalibrationSettings the flags ask for (refused, naming the value, when out of range)."""
    from ..calibration_settings import CalibrationSettings

    return CalibrationSettings(eps=DEFAULT_EPS if args.eps is None else args.eps,
                               max_window=DEFAULT_MAX_WINDOW if args.max_window is None else args.max_window,
                               quantile=DEFAULT_QUANTILE if args.quantile is None else args.quantile)


def calibration_run_options(args) -> dict:
    """calibrate_checkpoint's keyword arguments for sizes and device."""
    return {"seq_len": args.seq_len, "max_sequences": args.max_sequences,
            "batch_size": DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size,
            "device": args.device, "offload": args.offload}


def calibration_summary(cal) -> dict:
    """What a calibration found, for --json and `info PACK`: settings, corpus, tables per layer."""
    return {"checkpoint_sha256": cal.checkpoint_sha256, "checkpoint_path": cal.checkpoint_path,
            "family": cal.family, "settings": cal.settings.to_dict(), "corpus": cal.corpus, "run": cal.run,
            "model_table": cal.model_table(),
            "layers": [{"layer": layer.layer, "decoder_layer": layer.decoder_layer, "warmup": layer.warmup_table,
                        "summary": layer.summary_line(cal.settings.max_window)} for layer in cal.layers]}


def add_parser(sub):
    p = sub.add_parser("calibrate", help="measure each GDN head's gate decay on a corpus; write n_h and classes")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (default: the embedded default model)")
    add_calibration_arguments(p)
    p.add_argument("--dtype", choices=SUPPORTED_QKV_DTYPES,
                   help="q/k/v dtype the kernels will be built for (default: the checkpoint's; needed when the "
                        "checkpoint's is one the kernels do not take, e.g. float32)")
    p.add_argument("--out", help="output folder (default: the cache, keyed by checkpoint hash)")
    p.add_argument("--force", action="store_true",
                   help="write over calibration.json/.md/.png in --out even when they are not a calibration's")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print JSON (the files written and the summary) instead of text")
    return p


def check_checkpoint_form(checkpoint, qkv_dtype) -> None:
    """What config.json alone can refuse (not a GDN model, bad head counts, a dtype the kernels do
    not take without --dtype), before the model, tokenizer or corpus is read."""
    from ..model_config import read_model_config
    from ..supported_shapes import check_checkpoint_dtype, heads_problem

    if checkpoint is None:
        from ..calibrate.default_model import default_model_path

        checkpoint = default_model_path()
    if not Path(checkpoint).is_dir():
        return      # the calibration names the missing folder
    model = read_model_config(checkpoint)
    if problem := heads_problem(model.spec.num_qk_heads, model.spec.num_v_heads):
        raise ValueError(f"{checkpoint}: {problem}")
    check_checkpoint_dtype(model, qkv_dtype, str(checkpoint))


def run(args) -> int:
    from ..calibrate.pipeline import calibrate_checkpoint, check_out_dir
    from ..calibrate.report import summary

    check_calibration_sizes(args)
    settings = calibration_settings(args)
    if args.out is not None:
        check_out_dir(Path(args.out), args.force)
    check_checkpoint_form(args.checkpoint, args.dtype)
    res = calibrate_checkpoint(args.checkpoint, args.corpus, settings, args.out, progress=not args.no_progress,
                               qkv_dtype=args.dtype, force=args.force, **calibration_run_options(args))
    if args.json:
        print(json.dumps({"artifact": str(res.artifact), "report": str(res.report), "figure": str(res.figure),
                          "calibration": calibration_summary(res.calibration)}, indent=2))
        return 0
    print("\n".join(summary(res.calibration)))
    print(f"artifact {res.artifact}\nreport   {res.report}\nfigure   {res.figure}")
    return 0
