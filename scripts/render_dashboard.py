"""Render the Grafana dashboard (deploy/grafana/rebalancer.json) as an operator would see it,
without Grafana: every panel's queries answered by a real Prometheus over a live run,
drawn as a PNG (docs/dashboard.png).

A Prometheus server (Debian's, from `.ci/run --tools`) scrapes a live fleet every second
(rebalancer/launch/fleet.py: the controller, the demo's 2 sidecars and its 4 CPU workers
on DeepSeek-V3's real routing, and beside them a deployment of 2 instant ranks in a replica
pool, rebalancer/launch/instant.py, for the pool panels) until the workers finish; then
each panel's every query goes to Prometheus's query_range over the run (up to the last
moment every rank was connected) and the panel is drawn from the answer, at its place on
the dashboard's grid (rebalancer/launch/dashboard.py).
Grafana's variables get what Grafana would give them: `$deployment` the fleet's
deployment, `$__range` the run, `$__rate_interval` max(step + scrape interval, 4 x
scrape interval). A query that returns nothing says so on its panel and on stderr, and
the script exits 1.

    .venv/bin/python scripts/render_dashboard.py --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rebalancer.launch.config import DemoConfig
from rebalancer.launch.dashboard import (
    Query,
    ask,
    dashboard_queries,
    draw,
    has_data,
    last_all_connected,
)
from rebalancer.launch.fleet import Fleet
from rebalancer.launch.instant import PoolMember
from rebalancer.launch.prometheus import Prometheus

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "rebalancer.json"

# The pool panels' deployment beside the demo's: (deployment, pool).
POOLED = ("dashboard-pooled", "dashboard-pool")


def run(dashboard: dict[str, Any], steps: int, every: float) -> dict[str, Any]:
    """A live run scraped by a real Prometheus, and its answers to every dashboard query."""
    run_seconds = 600.0
    demo = DemoConfig(steps=steps, timeout_seconds=run_seconds)
    with tempfile.TemporaryDirectory(prefix="dashboard") as tmp:
        fleet = Fleet(Path(tmp) / "fleet", demo)
        with (
            Prometheus(
                Path(tmp) / "prometheus",
                fleet.targets(),
                scrape_interval=every,
                evaluation_interval=every,
            ) as prom,
            fleet,
            PoolMember(fleet.address, *POOLED),
        ):
            start = time.time()
            deadline = time.monotonic() + run_seconds
            while all(w.poll() is None for w in fleet.workers) and time.monotonic() < deadline:
                time.sleep(0.5)
            while any(w.poll() is None for w in fleet.workers) and time.monotonic() < deadline:
                time.sleep(0.5)
            end = last_all_connected(prom, demo.deployment, start, time.time(), every)
            failed = [r for r, w in enumerate(fleet.workers) if w.poll() != 0]
            if failed:
                raise SystemExit(
                    f"workers {failed} failed or did not finish (see their output above)"
                )
            answers = ask(prom, dashboard_queries(dashboard), demo.deployment, start, end, every)
            version = prom.api("status/buildinfo")["version"]
    return {
        "start": start,
        "end": end,
        "step": every,
        "prometheus": version,
        "answers": [{"query": vars(q), "answer": a} for q, a in answers.items()],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    p.add_argument(
        "--steps", type=int, default=640, help="forward steps of each worker (default %(default)s)"
    )
    p.add_argument(
        "--every", type=float, default=1.0, help="scrape interval and query step, seconds"
    )
    p.add_argument("--answers", help="also write Prometheus's answers here (JSON)")
    p.add_argument("--from-answers", help="draw from answers --answers wrote (no run)")
    args = p.parse_args()
    dashboard = json.loads(DASHBOARD.read_text())
    if args.from_answers:
        saved = json.loads(Path(args.from_answers).read_text())
    else:
        saved = run(dashboard, args.steps, args.every)
        if args.answers:
            Path(args.answers).write_text(json.dumps(saved))
    answers = {Query(**a["query"]): a["answer"] for a in saved["answers"]}
    start, end, step = saved["start"], saved["end"], saved["step"]
    title = (
        f"{dashboard['title']}: drawn by scripts/render_dashboard.py (not Grafana) from a real "
        f"Prometheus {saved['prometheus']}\nscraping a live run for {end - start:.0f} s: the "
        "controller, 2 demo sidecars and 4 CPU workers on DeepSeek-V3 routing, and a pooled "
        "deployment of 2 instant ranks"
    )
    for line in draw(dashboard, answers, start, end, step, Path(args.out), title):
        print(line)
    print(f"wrote {args.out}")
    empty = [f"{q.panel} {q.ref}: {q.expr}" for q, a in answers.items() if not has_data(a)]
    for line in empty:
        print(f"no data: {line}", file=sys.stderr)
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
