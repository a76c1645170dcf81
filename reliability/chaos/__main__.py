"""The campaign's command line:
`python -m reliability.chaos --seconds 300 --seed 1 --hog 2 --json`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import reliability.chaos
from reliability.chaos.config import ChaosConfig
from reliability.chaos.faults import ALL_KINDS, FAULTS
from reliability.chaos.harness import run_chaos


def main(argv: list[str] | None = None) -> int:
    doc = reliability.chaos.__doc__
    p = argparse.ArgumentParser(
        prog="python -m reliability.chaos", description=doc.splitlines()[0] if doc else ""
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=300.0,
        help="how long to inject faults (at least until every kind was injected once)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--pods", type=int, default=2)
    p.add_argument("--kinds", default="", help=f"comma-separated subset of: {','.join(ALL_KINDS)}")
    p.add_argument(
        "--hog",
        type=int,
        default=0,
        metavar="N",
        help="N busy processes beside the whole campaign (a busy node)",
    )
    p.add_argument("--keep", action="store_true", help="keep the run's folder (logs, store)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k) or ALL_KINDS
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        print(f"error: unknown fault kinds {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.hog < 0:
        print(f"error: --hog must be >= 0, got {args.hog}", file=sys.stderr)
        return 2
    config = ChaosConfig(
        seconds=args.seconds,
        seed=args.seed,
        workers=args.workers,
        pods=args.pods,
        kinds=kinds,
        hog=args.hog,
        keep=args.keep,
        progress=not args.quiet,
    )
    # SIGTERM (a timeout, an operator) ends the run like Ctrl-C: every process, the store's
    # tmpfs and the run's folder are released on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result = run_chaos(config)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    bad = result["invariant_violations"] or result["leaked_processes"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
