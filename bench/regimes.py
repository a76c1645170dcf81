"""The regimes policy against adaptive and follow, and what its decision costs (issue 33).

Traces: the drifting DeepSeek-V3 traces `rebalancer trace make` builds (the same
`make_trace`, default tokens and top-k) of `--windows` windows, each kind, window length
and seed, replayed at G=32, P=288, 4 nodes from the trivial placement and from the static
fit; the policies' timing derived for the window length as `rebalancer simulate` does.
Per row: relative throughput of adaptive, follow and regimes (regimes pays its own
migration costs like adaptive; follow moves for free), slots moved, and the issue's
checks: regimes >= follow (phase and mix), regimes >= adaptive - 0.002 (every trace),
slots moved <= adaptive's x 1.2. `--short` adds traces of that many windows (the
never-below-adaptive check only).

`--decision-cost`: the decision's time per window on the decision worker's code path
(`decide_regimes` with one new window, against `decide`, the adaptive policy, on the same
estimate and placement in the same run), with a library of 16 regimes (mixes of the
DeepSeek-V3 workloads), at G=32/P=288 (4 nodes) and G=256/P=512 (32 nodes): a window that
joins a known regime (the common case) and one that starts a new regime (a from-scratch fit).

    python -m bench.regimes                          # seeds 71,72; 300 windows; 1 s and 10 s
    python -m bench.regimes --seeds 5 --kinds phase --window-seconds 10 --starts trivial
    python -m bench.regimes --decision-cost
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from typing import Any

import numpy as np

from rebalancer.controller.decide import PolicyConfig, decide
from rebalancer.controller.regimes import RegimeConfig, RegimeLibrary, decide_regimes, fit, observe
from rebalancer.sim import SimConfig, TraceGenConfig, deepseek_v3_sources, make_trace, simulate
from rebalancer.wire.shape import ClusterShape


def _row(
    kind: str,
    windows: int,
    window_seconds: float,
    seed: int,
    start: str,
    sources: dict[str, np.ndarray],
) -> dict[str, Any]:
    trace = make_trace(
        sources,
        TraceGenConfig(kind=kind, windows=windows, window_seconds=window_seconds, seed=seed),
    )
    config = SimConfig.for_trace(trace, num_slots=288, num_gpus=32, num_nodes=4, start=start)
    began = time.perf_counter()
    results = simulate(trace, config, ["adaptive", "follow", "regimes"])
    a, f, r = (results[n] for n in ("adaptive", "follow", "regimes"))
    row = {
        "kind": kind,
        "windows": windows,
        "window_seconds": window_seconds,
        "seed": seed,
        "start": start,
        "adaptive": round(a.relative_throughput, 6),
        "follow": round(f.relative_throughput, 6),
        "regimes": round(r.relative_throughput, 6),
        "slots_adaptive": a.slots_moved,
        "slots_regimes": r.slots_moved,
        "rebalances_adaptive": a.rebalances,
        "rebalances_regimes": r.rebalances,
        "seconds": round(time.perf_counter() - began, 1),
    }
    row["vs_follow"] = round(r.relative_throughput - f.relative_throughput, 6)
    row["vs_adaptive"] = round(r.relative_throughput - a.relative_throughput, 6)
    row["slots_ratio"] = round(r.slots_moved / a.slots_moved, 4) if a.slots_moved else None
    row["meets_follow"] = (
        None if kind == "burst" or windows < 300 else r.relative_throughput >= f.relative_throughput
    )
    row["meets_adaptive"] = r.relative_throughput >= a.relative_throughput - 0.002
    row["meets_slots"] = r.slots_moved <= 1.2 * a.slots_moved
    return row


def _print(row: dict[str, Any]) -> None:
    def yes(v: bool | None) -> str:
        return "-" if v is None else ("yes" if v else "NO")

    print(
        f"{row['kind']:5s} {row['windows']:4d} {row['window_seconds']:4g} {row['seed']:4d} "
        f"{row['start']:7s} "
        f"{row['adaptive']:.4f} {row['follow']:.4f} {row['regimes']:.4f} {row['vs_follow']:+.4f} "
        f"{row['vs_adaptive']:+.4f} {row['slots_regimes']:7d} {row['slots_adaptive']:7d} "
        f"{row['slots_ratio'] if row['slots_ratio'] is not None else '-':>6} "
        f"{yes(row['meets_follow']):>4s} {yes(row['meets_adaptive']):>4s} "
        f"{yes(row['meets_slots']):>4s} "
        f"{row['seconds']:5.0f}",
        flush=True,
    )


def _library(
    load: np.ndarray, shape: ClusterShape, size: int, rng: np.random.Generator, sources: np.ndarray
) -> RegimeLibrary:
    """A library of `size` regimes: random sharp mixes of the source workloads, each seen
    for a few windows, every one with a ready placement."""
    lib = RegimeLibrary()
    config = RegimeConfig(capacity=size)
    t = 0.0
    while len(lib.regimes) < size:
        w = rng.dirichlet(np.full(len(sources), 0.3))
        dist = np.einsum("k,kle->le", w, sources)
        for _ in range(3):
            counts = np.stack([rng.multinomial(65536 * 8, row / row.sum()) for row in dist])
            observe(lib, counts, t, shape, config)
            t += 1.0
    for r in lib.regimes:
        r.ready = fit(r.centroid, shape).astype(np.int16)  # as the library keeps it
    return lib


def decision_cost(repeats: int) -> list[dict[str, Any]]:
    sources = deepseek_v3_sources()
    stacked = np.stack([v / v.sum(axis=1, keepdims=True) for v in sources.values()])
    rows = []
    for G, P, N in ((32, 288, 4), (256, 512, 32)):
        L, E = stacked.shape[1], stacked.shape[2]
        shape = ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, num_nodes=N)
        rng = np.random.default_rng(0)
        lib = _library(stacked[0], shape, 16, rng, stacked)
        policy = PolicyConfig(min_interval_seconds=0.0)
        known = lib.regimes[3]
        current = known.ready
        assert current is not None
        timings: dict[str, list[float]] = {"adaptive": [], "regimes_known": [], "regimes_new": []}
        for i in range(repeats):
            counts = np.stack([rng.multinomial(65536 * 8, row) for row in known.centroid])
            estimate = counts.astype(np.float64)
            t0 = time.process_time()
            decide(estimate, current, shape, policy, now=1e6 + i, last_rebalance=None, windows=100)
            timings["adaptive"].append(time.process_time() - t0)
            copy = RegimeLibrary.from_record(*lib.to_record())
            t0 = time.process_time()
            decide_regimes(
                copy,
                [(counts, 1e6 + i)],
                estimate,
                current,
                shape,
                policy,
                now=1e6 + i,
                last_rebalance=None,
                windows=100,
            )
            timings["regimes_known"].append(time.process_time() - t0)
            w = rng.dirichlet(np.full(len(stacked), 0.1))
            fresh = np.stack(
                [
                    rng.multinomial(65536 * 8, row / row.sum())
                    for row in np.einsum("k,kle->le", w, stacked) ** 1.5
                ]
            )
            copy = RegimeLibrary.from_record(*lib.to_record())
            t0 = time.process_time()
            decide_regimes(
                copy,
                [(fresh, 1e6 + i)],
                fresh.astype(np.float64),
                current,
                shape,
                policy,
                now=1e6 + i,
                last_rebalance=None,
                windows=100,
            )
            timings["regimes_new"].append(time.process_time() - t0)
        # The library travels to the decision worker and back with each decision (pickled).
        t0 = time.process_time()
        blob = pickle.dumps(lib)
        pickle.loads(blob)
        timings["pickle_round_trip"] = [time.process_time() - t0]
        row = {
            "gpus": G,
            "slots": P,
            "nodes": N,
            "layers": L,
            "experts": E,
            "library": len(lib.regimes),
            "library_pickle_kib": round(len(blob) / 1024),
            "repeats": repeats,
            **{f"{k}_ms": round(1e3 * statistics.median(v), 1) for k, v in timings.items()},
        }
        row["known_over_adaptive"] = round(row["regimes_known_ms"] / row["adaptive_ms"], 2)
        row["new_over_adaptive"] = round(row["regimes_new_ms"] / row["adaptive_ms"], 2)
        print(
            f"G={G} P={P} N={N}: adaptive {row['adaptive_ms']} ms, regimes (known regime) "
            f"{row['regimes_known_ms']} ms (x{row['known_over_adaptive']}), regimes (new regime) "
            f"{row['regimes_new_ms']} ms (x{row['new_over_adaptive']}); median CPU of {repeats}; "
            f"the library "
            f"pickled {row['library_pickle_kib']} KiB, round trip {row['pickle_round_trip_ms']} ms",
            flush=True,
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="71,72", help="trace seeds (comma list)")
    ap.add_argument("--kinds", default="phase,mix,burst", help="trace kinds")
    ap.add_argument("--window-seconds", default="1,10", help="window lengths (comma list)")
    ap.add_argument("--starts", default="trivial,static", help="where the changing policies start")
    ap.add_argument("--windows", type=int, default=300, help="windows per trace")
    ap.add_argument(
        "--short", type=int, default=0, help="also traces of this many windows (0: none)"
    )
    ap.add_argument("--decision-cost", action="store_true", help="time the decision instead")
    ap.add_argument("--repeats", type=int, default=5, help="with --decision-cost: windows timed")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    if args.decision_cost:
        rows = decision_cost(args.repeats)
        if args.json:
            print(json.dumps({"decision_cost": rows}))
        return 0
    sources = deepseek_v3_sources()
    print(
        "kind  win  w_s seed start   adapt.  follow  regimes vs_fol  vs_ada   slots  slots_a  "
        "ratio "
        " fol  ada slot     s"
    )
    rows = []
    lengths = [args.windows] + ([args.short] if args.short else [])
    for windows in lengths:
        for kind in args.kinds.split(","):
            for ws in (float(v) for v in args.window_seconds.split(",")):
                for seed in (int(v) for v in args.seeds.split(",")):
                    for start in args.starts.split(","):
                        row = _row(kind, windows, ws, seed, start, sources)
                        _print(row)
                        rows.append(row)
    checks = {
        name: [r[name] for r in rows if r[name] is not None]
        for name in ("meets_follow", "meets_adaptive", "meets_slots")
    }
    print("met: " + ", ".join(f"{k} {sum(v)}/{len(v)}" for k, v in checks.items()))
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
