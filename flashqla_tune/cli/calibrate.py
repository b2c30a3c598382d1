"""flashqla-tune calibrate [CHECKPOINT]: per-head gate-decay calibration (artifact + report)."""
from __future__ import annotations

from ..calibration_settings import DEFAULT_EPS, DEFAULT_MAX_WINDOW, DEFAULT_QUANTILE


def add_parser(sub):
    p = sub.add_parser("calibrate", help="measure each GDN head's gate decay on a corpus; write n_h and classes")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--corpus", help="text file or folder of text files (default: the shipped corpus)")
    p.add_argument("--eps", type=float, default=DEFAULT_EPS, help="state error bound for warm-up (default 1e-5)")
    p.add_argument("--max-window", type=int, default=DEFAULT_MAX_WINDOW, help="window cap N in chunks (default 16)")
    p.add_argument("--quantile", type=float, default=DEFAULT_QUANTILE, help="quantile Q (default 0.999)")
    p.add_argument("--out", help="output folder (default: the cache, keyed by checkpoint hash)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 4096 on GPU, 2048 on CPU)")
    p.add_argument("--max-sequences", type=int, help="sequences used (default 64 on GPU, 24 on CPU)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when there is one)")
    p.add_argument("--offload", action="store_true", help="keep hidden states on the CPU between layers")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args) -> int:
    from ..calibrate.pipeline import calibrate_checkpoint
    from ..calibrate.report import summary
    from ..calibration_settings import CalibrationSettings

    settings = CalibrationSettings(eps=args.eps, max_window=args.max_window, quantile=args.quantile)
    res = calibrate_checkpoint(args.checkpoint, args.corpus, settings, args.out, seq_len=args.seq_len,
                               max_sequences=args.max_sequences, batch_size=args.batch_size, device=args.device,
                               offload=args.offload, progress=not args.no_progress)
    print("\n".join(summary(res.calibration)))
    print(f"artifact {res.artifact}\nreport   {res.report}\nfigure   {res.figure}")
    return 0
