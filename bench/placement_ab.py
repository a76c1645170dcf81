"""Placement engine, this tree against another tree's engine: same results, speed side by side.

    python -m bench.placement_ab --old-engine OLD/rebalancer/placement/engine.py

A change to the entry point (`rebalancer/placement/engine.py`: validation, picking the
algorithm) is measured in one process against the same file of another tree (e.g. `git
archive` of the commit before, unpacked). The old file is loaded under another module
name and imports this tree's other placement modules, so only the entry point differs.
Each case: both engines' results compared (placement, balancedness, algorithm), then
`compute_placement` timed in interleaved rounds (`bench.interleave`: A B, B A, ...), one
thread, on the DeepSeek-V3 counts; per round the median of `--calls` calls, and the
figure is the median over rounds with its spread and the per-round overhead of the new
engine. Load average printed: on a shared machine the spread says how far to trust it.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from bench.interleave import overhead_pct, run_interleaved, spread  # noqa: E402
from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3  # noqa: E402
from rebalancer.placement import engine as new_engine  # noqa: E402


def load_old_engine(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("old_placement_engine", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"bench.placement_ab: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def cases(load: np.ndarray) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "G=32 N=4 P=288 global": dict(num_slots=288, num_gpus=32, num_nodes=4),
        "G=32 N=4 P=288 hierarchical": dict(num_slots=288, num_gpus=32, num_nodes=4, num_groups=8),
        "G=256 N=32 P=512": dict(num_slots=512, num_gpus=256, num_nodes=32),
    }
    previous = new_engine.compute_placement(
        load, **out["G=32 N=4 P=288 global"], algorithm="greedy"
    ).phy2log
    out["G=32 N=4 P=288 migration, budget 0.25"] = dict(
        num_slots=288,
        num_gpus=32,
        num_nodes=4,
        previous=np.asarray(previous),
        max_moved_fraction=0.25,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.placement_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--old-engine", type=Path, required=True, help="the other tree's engine.py")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5, help="timed calls per variant and round")
    args = parser.parse_args(argv)
    old_engine = load_old_engine(args.old_engine)
    load = load_deepseek_v3(deepseek_v3_files()[0], moe_only=False)
    print(
        f"load average at start {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs); "
        f"{args.rounds} rounds x {args.calls} calls per variant"
    )
    same_everywhere = True
    for name, kw in cases(load).items():
        a = old_engine.compute_placement(load, **kw)
        b = new_engine.compute_placement(load, **kw)
        same = bool(
            np.array_equal(a.phy2log, b.phy2log)
            and a.balancedness == b.balancedness
            and a.algorithm == b.algorithm
        )
        same_everywhere &= same

        def timer(engine: ModuleType, kw: dict[str, Any] = kw) -> Any:
            def measure(_round: int) -> float:
                times = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    engine.compute_placement(load, **kw)
                    times.append(time.perf_counter() - start)
                return 1e3 * statistics.median(times)

            return measure

        ms = run_interleaved({"old": timer(old_engine), "new": timer(new_engine)}, args.rounds)
        print(
            f"{name}: same result {same}\n  old {spread(ms['old']).text('ms')}\n"
            f"  new {spread(ms['new']).text('ms')}\n"
            f"  new vs old {overhead_pct(ms['old'], ms['new']).text('%', signed=True)}",
            flush=True,
        )
    print(f"load average at end {os.getloadavg()[0]:.1f}")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
