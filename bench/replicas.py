"""Pools in the simulator: replicas that learn together against replicas that learn alone.

On the drifting DeepSeek-V3 traces the project builds from its shipped data (phase, mix,
burst at G=32, P=288, 4 nodes), each replica window an independent draw of
`--tokens` tokens (8 picks each) from the window's routing: the adaptive policy pooled
(one estimate from every member's windows) against per deployment, at R = 2, 8, 32, and a
member joining mid-trace warm (the pool's placement) against trivial. Prints one table
and, with --json, one JSON object. The simulator is deterministic (virtual clock, fixed
seeds): a rerun gives the same figures on any machine.

    python -m bench.replicas                          # R = 2, 8, 32 on phase, mix, burst
    python -m bench.replicas --replicas 2 --windows 30 --kinds phase   # a quick look
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rebalancer.sim import SimConfig, TraceGenConfig, deepseek_v3_sources, make_trace
from rebalancer.sim.replicas import ReplicaConfig, simulate_replicas


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="2,8,32", help="comma list of pool sizes R")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per replica window")
    ap.add_argument("--windows", type=int, default=60, help="windows per trace")
    ap.add_argument("--kinds", default="phase,mix,burst", help="trace kinds")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    sources = deepseek_v3_sources()
    rows: list[dict[str, Any]] = []
    print(
        f"{'trace':6s} {'R':>3s} {'pooled':>8s} {'alone':>8s} {'ratio':>6s} {'slots_pool':>10s} "
        f"{'slots_alone':>11s} {'warm':>6s} {'trivial':>7s} {'s':>5s}"
    )
    for kind in args.kinds.split(","):
        trace = make_trace(sources, TraceGenConfig(kind=kind, windows=args.windows, seed=0))
        config = SimConfig.for_trace(trace, num_slots=288, num_gpus=32, num_nodes=4)
        for r in (int(v) for v in args.replicas.split(",")):
            start = time.perf_counter()
            out = simulate_replicas(
                trace, config, ReplicaConfig(replicas=r, tokens_per_window=args.tokens)
            )
            seconds = time.perf_counter() - start
            pooled, alone = out["pooled"], out["per_deployment"]
            rows.append({"trace": kind, **out, "seconds": round(seconds, 1)})
            print(
                f"{kind:6s} {r:3d} {pooled['relative_throughput']:8.4f} "
                f"{alone['relative_throughput']:8.4f} "
                f"{pooled['relative_throughput'] / alone['relative_throughput']:6.3f} "
                f"{pooled['slots_moved']:10d} {alone['slots_moved']:11d} "
                f"{out['warm_first_window_ratio']:6.3f} {out['trivial_first_window_ratio']:7.3f} "
                f"{seconds:5.0f}",
                flush=True,
            )
    if args.json:
        print(json.dumps({"tokens_per_window": args.tokens, "windows": args.windows, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
