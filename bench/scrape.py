"""One whole scrape of the controller's metrics in one process: CPU seconds and bytes.

`--deployments` DeepSeek-V3 EP32 deployments (`cost.REFERENCE`'s shape) in replica
pools of `--pool-size`, each with a few windows folded, as a controller holds a fleet;
the policy is paused and contingency planning off (their series are then absent, as on a
fleet whose sets are not computed yet). The first scrape computes every deployment's
"estimated" balancedness (a scrape after a placement change, or once they aged); the
`--scrapes` after it answer from what it kept, as most scrapes of a steady fleet do.

Against another tree (the interleaved A/B of a change): run this file by its path with
`PYTHONPATH=<that tree>`; a tree without `ControllerMetrics.render` is scraped through
prometheus_client's `generate_latest`, as its metrics server did.

    PYTHONPATH=/tmp/base python bench/scrape.py --json
    python -m bench.scrape --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _scraper(metrics: Any) -> Callable[[], bytes]:
    render = getattr(metrics, "render", None)
    if render is not None:
        return render  # type: ignore[no-any-return]
    from prometheus_client import generate_latest

    return lambda: generate_latest(metrics.registry)


def run(deployments: int, pool_size: int, scrapes: int) -> dict[str, Any]:
    from rebalancer.controller.cost import REFERENCE
    from rebalancer.controller.decide import PolicyConfig
    from rebalancer.controller.metrics import ControllerMetrics
    from rebalancer.controller.state import Controller
    from rebalancer.controller.store import Store
    from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3

    shape = REFERENCE.shape
    counts = load_deepseek_v3(deepseek_v3_files()[0]) // 1000
    ranks = frozenset(range(shape.num_gpus))
    ctl = Controller(Store(":memory:"), PolicyConfig(min_windows=1, paused=True))
    contingency = getattr(ctl, "contingency", None)  # absent in trees before issue 30
    if contingency is not None:
        contingency.refresh = lambda *args, **kwargs: None
    for d in range(deployments):
        pool = f"pool-{d // pool_size}" if pool_size else ""
        _, dep = ctl.register(f"dsv3-{d}", ranks, shape, 0, None, f"w{d}", f"ns/pod-{d}", pool)
        for seq in range(3):
            ctl.ingest(dep, ranks, seq, 0, counts, None)
    scrape = _scraper(ControllerMetrics(ctl))
    cpu = time.process_time()
    size = len(scrape())
    first = time.process_time() - cpu
    kept = []
    for _ in range(scrapes):
        cpu = time.process_time()
        scrape()
        kept.append(time.process_time() - cpu)
    ctl.store.close()
    return {
        "deployments": deployments,
        "pool_size": pool_size,
        "bytes": size,
        "first_scrape_cpu_seconds": first,
        "scrape_cpu_seconds": statistics.median(kept) if kept else float("nan"),
        "scrape_cpu_seconds_range": [min(kept), max(kept)] if kept else [],
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployments", type=int, default=2048)
    p.add_argument("--pool-size", type=int, default=8, help="members per pool (0: no pools)")
    p.add_argument("--scrapes", type=int, default=5, help="scrapes timed after the first")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.deployments < 1 or args.pool_size < 0 or args.scrapes < 0:
        print("--deployments must be >= 1, --pool-size and --scrapes >= 0", file=sys.stderr)
        return 2
    result = run(args.deployments, args.pool_size, args.scrapes)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['deployments']} deployments: {result['bytes'] / 1e6:.1f} MB, first scrape "
            f"{result['first_scrape_cpu_seconds']:.2f} s CPU, then "
            f"{result['scrape_cpu_seconds']:.3f} s (median of {args.scrapes}; load "
            f"{result['load_avg'][0]})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
