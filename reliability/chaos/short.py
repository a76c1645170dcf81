"""The short campaign, seed by seed: what CI runs once (tests/integration/test_chaos.py)
and RELIABILITY.md runs many times beside a CPU hog.

`python -m reliability.chaos.short --first 300 --count 50 --hog 4 --out runs.jsonl [--keep]`
runs seeds first..first+count-1 one after the other and appends one JSON line per run
(seed, pass, what failed, seconds, load average, plans, recovery p99, the kept folder);
the last line printed sums them up. Exit 1 when any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from reliability.chaos.config import ChaosConfig
from reliability.chaos.faults import LINK_FAULTS
from reliability.chaos.harness import run_chaos

# One of each family: a process killed (each kind of process), frozen, every link fault,
# the store faults and a starved node; a worker kill restarts the group (the costliest
# episode).
SHORT_KINDS = (
    "sigkill_controller",
    "sigterm_sidecar",
    "sigkill_worker",
    "sigstop_controller",
    *LINK_FAULTS,
    "store_torn_wal",
    "store_disk_full",
    "cpu_starve",
)


def short_config(seed: int = 11, **kw: Any) -> ChaosConfig:
    """The short campaign (also what RELIABILITY.md runs beside a CPU hog, seed by seed):
    2 ranks in 2 pods, every kind once, a starvation of at most 6 s."""
    return ChaosConfig(
        seconds=15.0,
        seed=seed,
        workers=2,
        pods=2,
        kinds=SHORT_KINDS,
        starve_seconds_max=6.0,
        progress=False,
        **kw,
    )


def short_campaign_failures(config: ChaosConfig, result: dict[str, Any]) -> list[str]:
    """What the short campaign's result misses (empty: it passed)."""
    checks = {
        f"violations: {result['violations']}": result["invariant_violations"] == 0,
        f"{result['leaked_processes']} processes left": result["leaked_processes"] == 0,
        f"kinds injected: {result['faults_by_kind']}": set(result["faults_by_kind"])
        == set(config.kinds),
        "restarts": result["controller_restarts"] >= 2 and result["group_restarts"] >= 1,
        f"recovery p99 {result['controller_recovery_seconds_p99']} s": result[
            "controller_recovery_seconds_p99"
        ]
        < config.recovery_bound_seconds,
        f"step wait {result['max_step_wait_ms']} ms": result["max_step_wait_ms"]
        <= config.step_wait_bound_ms,
        f"{result['plans_committed']} plans committed": result["steps_logged"] > 0
        and result["plans_committed"] >= 1,
        f"{result['transfer_timeouts']} transfer timeouts": result["transfer_timeouts"] == 0,
    }
    return [what for what, ok in checks.items() if not ok]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m reliability.chaos.short", description=__doc__.splitlines()[0]
    )
    p.add_argument("--first", type=int, default=11, help="first seed")
    p.add_argument("--count", type=int, default=1, help="seeds to run, one after the other")
    p.add_argument(
        "--hog", type=int, default=0, metavar="N", help="N busy processes beside each run"
    )
    p.add_argument("--out", help="append one JSON line per run here")
    p.add_argument("--keep", action="store_true", help="keep every run's folder (logs, store)")
    args = p.parse_args(argv)
    if args.count < 1 or args.hog < 0:
        p.error("--count must be >= 1 and --hog >= 0")
    passed = 0
    for seed in range(args.first, args.first + args.count):
        config = short_config(seed, hog=args.hog, keep=args.keep)
        started, load = time.monotonic(), os.getloadavg()[0]
        line: dict[str, Any] = {"seed": seed}
        try:
            result: dict[str, Any] = run_chaos(config)
        except Exception as exc:  # noqa: BLE001 - a run that could not start is a failed run, not the campaign's end
            failures = [f"run did not complete: {type(exc).__name__}: {exc}"]
            line.update(committed=None, aborted=None, recovery_p99=None, kept=None)
        else:
            failures = short_campaign_failures(config, result)
            line.update(
                committed=result["plans_committed"],
                aborted=result["plans_aborted"],
                recovery_p99=result["controller_recovery_seconds_p99"],
                kept=result.get("kept"),
            )
        passed += not failures
        line.update(
            {
                "pass": not failures,
                "failures": failures,
                "seconds": round(time.monotonic() - started, 1),
                "load": [round(load, 1), round(os.getloadavg()[0], 1)],
            }
        )
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")
    print(json.dumps({"runs": args.count, "passed": passed, "hog": args.hog}))
    return 0 if passed == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
