"""The `flashqla-tune` command. Each subcommand lives in its own module with
add_parser(subparsers) and run(args) -> int; the modules import torch, the compiler and the
calibration only inside run(), so `--help` of any command answers without them."""
from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `--help` lists them. Only commands that exist are here.
SUBCOMMANDS = ("info", "calibrate", "compile", "tune", "build", "verify", "keygen", "sign", "cache", "bench")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="flashqla-tune", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"flashqla-tune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"flashqla_tune.cli.{name}")
        module.add_parser(sub).set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"flashqla-tune {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
