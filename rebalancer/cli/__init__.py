"""The `rebalancer` command line: one module per subcommand.

Each subcommand module exposes `register(subparsers)`, which adds its parser and
sets `func`; heavy imports happen inside the command, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rebalancer import __version__
from rebalancer.errors import InputError

# Order is the order shown by --help.
SUBCOMMANDS = (
    "demo",
    "serve",
    "admin",
    "plan",
    "evaluate",
    "simulate",
    "trace",
)

EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rebalancer",
        description="Online expert-placement rebalancer for Mixture-of-Experts inference.",
    )
    parser.add_argument("--version", action="version", version=f"rebalancer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"rebalancer.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name == f"rebalancer.cli.{name}_cmd":
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        print(f"rebalancer {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: stop quietly, as other CLIs do.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
