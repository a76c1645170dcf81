"""Soak: the whole loop for a long bounded run, resources sampled, growth reported.

The chaos harness's deployment (reliability/chaos/: a `rebalancer serve` process on an SQLite
store, one `rebalancer sidecar` per pod, G gloo ranks on DeepSeek-V3 routing drifting
over six workloads, every link through the loopback proxy) runs without faults, the
policy rebalancing as the load drifts. Every `--every` seconds it samples the
controller's RSS, open file descriptors and threads (its decision process separately),
the same of each sidecar, the ranks' RSS (max over ranks), fds and threads, and the
store's size (database + WAL). At the end: each series' mean over the first and the last
third of the run and the growth between them, the last third's slope per hour, and the
invariants of the run (reliability/chaos/checks.py, from the ranks' step logs).

    nice -n 10 python -m reliability.soak --seconds 900 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from reliability.chaos import ChaosConfig, Harness
from reliability.chaos.checks import check_liveness, settle

PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_sample(pid: int) -> dict[str, float] | None:
    """RSS (MB), open fds and threads of one process; None once it is gone."""
    try:
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        threads = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[17])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        return None
    return {"rss_mb": rss_pages * PAGE / 2**20, "fds": float(fds), "threads": float(threads)}


def children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


class Soak:
    def __init__(self, seconds: float, every: float, seed: int) -> None:
        self.seconds, self.every = seconds, every
        self.harness = Harness(ChaosConfig(seconds=seconds, seed=seed, kinds=(), progress=True))
        self.samples: list[dict[str, float]] = []

    def sample(self, t: float) -> dict[str, float]:
        h = self.harness
        row: dict[str, float] = {"t": round(t, 1)}
        ctl = h.procs.controller
        if ctl is not None and (s := proc_sample(ctl.pid)):
            row.update({f"controller_{k}": v for k, v in s.items()})
            pool = [p for c in children(ctl.pid) if (p := proc_sample(c))]
            if pool:
                row["decision_process_rss_mb"] = sum(p["rss_mb"] for p in pool)
        sidecars = [s for p in h.procs.sidecars if p is not None and (s := proc_sample(p.pid))]
        if sidecars:
            row["sidecar_rss_mb"] = max(s["rss_mb"] for s in sidecars)
            row["sidecar_fds"] = max(s["fds"] for s in sidecars)
            row["sidecar_threads"] = max(s["threads"] for s in sidecars)
        if h.procs.group is not None:
            ranks = [s for p in h.procs.group.procs if (s := proc_sample(p.pid))]
            if ranks:
                row["worker_rss_mb"] = max(s["rss_mb"] for s in ranks)
                row["worker_fds"] = max(s["fds"] for s in ranks)
                row["worker_threads"] = max(s["threads"] for s in ranks)
        row["sqlite_mb"] = sum(p.stat().st_size for p in h.store_dir.glob("c.sqlite*")) / 2**20
        st = h.status(2.0)
        if st is not None:
            row["placement_version"] = float(st.placement_version)
            row["windows_ingested"] = float(st.windows_ingested)
        return row

    def run(self) -> dict[str, Any]:
        h = self.harness
        start = time.monotonic()
        try:
            try:
                h.setup()
                h.say(f"soak: {self.seconds:.0f} s, a sample every {self.every:g} s")
                t0 = time.monotonic()
                last_say = 0.0
                while (t := time.monotonic() - t0) < self.seconds:
                    check_liveness(h)
                    h.procs.track_descendants()
                    row = self.sample(t)
                    self.samples.append(row)
                    if t - last_say >= 60 or len(self.samples) == 1:
                        last_say = t
                        h.say("soak " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
                    time.sleep(max(0.0, self.every - (time.monotonic() - t0 - t)))
                settle(h)
                h.finish_group()
            finally:
                h.procs.track_descendants()
                h.teardown()
            chaos = h.report(time.monotonic() - start)
        finally:
            h.release_files()
        return {
            **self.summary(),
            "invariant_violations": chaos["invariant_violations"],
            "violations": chaos["violations"],
            "plans_committed": chaos["plans_committed"],
            "plans_aborted": chaos["plans_aborted"],
            "max_step_wait_ms": chaos["max_step_wait_ms"],
            "steps_logged": chaos["steps_logged"],
            "leaked_processes": chaos["leaked_processes"],
            "seconds": round(time.monotonic() - start, 1),
            "load_avg": chaos["load_avg"],
        }

    def summary(self) -> dict[str, Any]:
        """Per series: first-third and last-third means, growth between them, and the last
        third's least-squares slope per hour."""
        keys = sorted({k for row in self.samples for k in row} - {"t"})
        n = len(self.samples)
        third = max(1, n // 3)
        growth: dict[str, dict[str, float]] = {}
        for k in keys:
            pts = np.array([(row["t"], row[k]) for row in self.samples if k in row])
            if len(pts) < 3:
                continue
            first, last = pts[:third, 1].mean(), pts[-third:, 1].mean()
            tail = pts[-third:]
            slope = (
                float(np.polyfit(tail[:, 0], tail[:, 1], 1)[0]) * 3600 if len(tail) >= 2 else 0.0
            )
            growth[k] = {
                "first_third": round(float(first), 2),
                "last_third": round(float(last), 2),
                "growth_pct": round(100 * (last - first) / first, 1) if first else 0.0,
                "last_third_slope_per_hour": round(slope, 2),
            }
        curve = self.samples[:: max(1, n // 12)] + ([self.samples[-1]] if n else [])
        return {
            "samples": n,
            "growth": growth,
            "curve": [{k: round(v, 1) for k, v in row.items()} for row in curve],
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = p.parse_args(argv)
    result = Soak(args.seconds, args.every, args.seed).run()
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 1 if result["invariant_violations"] or result["leaked_processes"] else 0


if __name__ == "__main__":
    sys.exit(main())
