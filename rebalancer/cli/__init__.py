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
    "sidecar",
    "admin",
    "plan",
    "evaluate",
    "simulate",
    "trace",
)

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_IN_USE = 7  # an InputError with `exit_code` (controller.store.InUseError) chooses its code

# Every exit code of every command, shown by `rebalancer --help`.
EXIT_CODES_HELP = """\
exit codes (every command):
  0    done (serve, sidecar: stopped cleanly on SIGTERM/SIGINT)
  1    failed: the command ran and its result is a failure (demo: its checks failed;
       sidecar --check: not serving; admin: any other gRPC error), the system refused a
       file (permissions, disk full), or out of memory
  2    bad input: usage, a flag, a file or its contents (counts, placement, config, store,
       TLS), a host or port that cannot be used, a controller's INVALID_ARGUMENT
  3    admin: not found (NOT_FOUND)
  4    admin: refused in this state (FAILED_PRECONDITION, ALREADY_EXISTS)
  5    admin: controller unreachable or too slow (UNAVAILABLE, DEADLINE_EXCEEDED)
  6    admin: not authenticated or not allowed (UNAUTHENTICATED, PERMISSION_DENIED)
  7    in use: serve: the store or a port belongs to another process (another controller?);
       sidecar: its socket belongs to a live sidecar
  130  interrupted (Ctrl-C)
Errors are one line on stderr: "rebalancer COMMAND: error: what and why".
"""


def _error(command: str, message: str, code: int) -> int:
    """One line on stderr, whatever the message holds (an embedded library message may
    span lines), and the exit code."""
    prog = f"rebalancer {command}" if command else "rebalancer"
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rebalancer",
        description="Online expert-placement rebalancer for Mixture-of-Experts inference.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXIT_CODES_HELP,
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
        parser.print_usage(sys.stderr)
        return _error("", "a command is required (rebalancer --help lists them)", EXIT_BAD_INPUT)
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        return _error(args.command, str(exc), getattr(exc, "exit_code", EXIT_BAD_INPUT))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: stop quietly, as other CLIs do.
        sys.stderr.close()
        return 0
    except MemoryError:
        # sizes the input asked for that this machine cannot hold (e.g. --slots 10**12)
        return _error(args.command, "out of memory for the sizes asked for", EXIT_FAILED)
    except OSError as exc:
        # a file the command writes or reads that the system refused (permissions, disk full)
        return _error(
            args.command,
            f"{exc.strerror or type(exc).__name__}: {exc.filename or exc}",
            EXIT_FAILED,
        )


if __name__ == "__main__":
    sys.exit(main())
