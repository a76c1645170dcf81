"""Survivor placements planned ahead (issue 30): quality and speed on the DeepSeek-V3 counts.

`python -m bench.contingency [--gpus 32 --nodes 4 --slots 288] [--node-slots 352] [--repeats 5]
[--wide 256,32,512] [--timing-only] [--json]`

For every shipped DeepSeek-V3 workload, with the healthy placement the engine computes on
it (G GPUs in N nodes, P slots), over every single-rank loss:
- planned: the controller's survivor placement (`placement.survivors`), its balancedness
  after the loss, as a ratio of the healthy placement's, and the slots it refills;
- repair: the >= 1-replica repair an engine improvises (lost experts handed round-robin
  to spare copies on the survivors, vLLM's fault-tolerance path), its balancedness;
- scratch: a from-scratch placement on the survivors (SGLang's elastic path), the slots
  it changes.
Every node loss is planned at P (and at `--node-slots`, where a node's loss can be
served). Speed, on one core (BLAS threads 1): every rank and node loss of one deployment
planned at once (what the controller's worker does after a commit), best and median of
`--repeats`, beside the same run's from-scratch placement of the same losses (one
`compute_placement` per loss: the baseline), interleaved; wall and CPU time. Timed at P,
at `--node-slots` (every node loss servable) and for a wide group (`--wide`: G=256 in 32
nodes at 512 slots, 2 a GPU; up to 2048, `wire.layout.MAX_SLOTS`; 256 + 32 losses).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3  # noqa: E402
from rebalancer.placement import balancedness, compute_placement  # noqa: E402
from rebalancer.placement.survivors import repair_placement, surviving_slots, survivor_placements  # noqa: E402


def losses_of(num_gpus: int, num_nodes: int) -> list[tuple[int, ...]]:
    per_node = num_gpus // num_nodes
    return [(g,) for g in range(num_gpus)] + [
        tuple(range(n * per_node, (n + 1) * per_node)) for n in range(num_nodes)
    ]


def quality(load: np.ndarray, G: int, N: int, P: int) -> dict[str, Any]:
    healthy = compute_placement(load, P, G, N).phy2log
    before = balancedness(healthy, load, G)
    ranks = [(g,) for g in range(G)]
    plans = survivor_placements(load, healthy, G, ranks)
    planned = np.array([p.balancedness for p in plans])
    repair = np.array(
        [
            balancedness(repair_placement(healthy, G, lost, load.shape[1]), load, G - 1)
            for lost in ranks
        ]
    )
    fresh = compute_placement(load, P // G * (G - 1), G - 1, 1).phy2log
    scratch = np.array(
        [int((fresh != healthy[:, surviving_slots(P, G, lost)]).sum()) for lost in ranks]
    )
    moved = np.array([p.slots_moved for p in plans])
    nodes = survivor_placements(load, healthy, G, losses_of(G, N)[G:]) if N > 1 else []
    return {
        "healthy": before,
        "planned_mean": float(planned.mean()),
        "planned_min": float(planned.min()),
        "planned_over_healthy": float(planned.mean() / before),
        "repair_mean": float(repair.mean()),
        "planned_above_repair_every_loss": bool((planned > repair).all()),
        "moved_mean": float(moved.mean()),
        "scratch_moved_mean": float(scratch.mean()),
        "moved_over_scratch_max": float((moved / scratch).max()),
        "node_feasible": sum(p.feasible for p in nodes),
        "node_losses": len(nodes),
        "node_unserved_max": max((p.unserved for p in nodes), default=0),
        "node_balancedness_min": min(
            (p.balancedness for p in nodes if p.feasible), default=float("nan")
        ),
    }


def timing(load: np.ndarray, G: int, N: int, P: int, repeats: int) -> dict[str, float]:
    """Wall and CPU seconds (this process's, so a loaded machine's waits for a core are
    left out) of planning every loss at once, beside the from-scratch baseline."""
    healthy = compute_placement(load, P, G, N).phy2log
    losses = losses_of(G, N)
    ours, ours_cpu, scratch, scratch_cpu = [], [], [], []
    for _ in range(repeats):  # interleaved: planned set, then the baseline
        t, c = time.perf_counter(), time.process_time()
        survivor_placements(load, healthy, G, losses)
        ours.append(time.perf_counter() - t)
        ours_cpu.append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        for lost in losses:
            survivors = G - len(lost)
            if P // G * survivors >= load.shape[1]:
                compute_placement(load, P // G * survivors, survivors, 1)
        scratch.append(time.perf_counter() - t)
        scratch_cpu.append(time.process_time() - c)
    return {
        "gpus": G,
        "nodes": N,
        "slots": P,
        "losses": len(losses),
        "planned_best_s": min(ours),
        "planned_median_s": statistics.median(ours),
        "planned_cpu_median_s": statistics.median(ours_cpu),
        "scratch_best_s": min(scratch),
        "scratch_median_s": statistics.median(scratch),
        "scratch_cpu_median_s": statistics.median(scratch_cpu),
        "speedup_median": statistics.median(scratch) / statistics.median(ours),
    }


def print_timing(t: dict[str, float]) -> None:
    print(
        f"G={t['gpus']:.0f} P={t['slots']:.0f}: all {t['losses']:.0f} losses planned: best "
        f"{t['planned_best_s'] * 1e3:.0f} ms, median {t['planned_median_s'] * 1e3:.0f} ms "
        f"(cpu {t['planned_cpu_median_s'] * 1e3:.0f} ms); from scratch per loss (baseline): median "
        f"{t['scratch_median_s'] * 1e3:.0f} ms (cpu {t['scratch_cpu_median_s'] * 1e3:.0f} ms)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--slots", type=int, default=288)
    p.add_argument(
        "--node-slots", type=int, default=352, help="also plan node losses at this P (0: not)"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--wide",
        type=str,
        default="256,32,512",
        help="also time a wide group GPUS,NODES,SLOTS (no quality rows; '' : not)",
    )
    p.add_argument("--wide-repeats", type=int, default=3)
    p.add_argument("--timing-only", action="store_true", help="skip the quality rows")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    G, N, P = args.gpus, args.nodes, args.slots
    if G < 2 or N < 1 or G % N or P % G:
        p.error(f"--gpus {G}, --nodes {N}, --slots {P}: need G >= 2, N | G and G | P")
    out: dict[str, object] = {
        "gpus": G,
        "nodes": N,
        "slots": P,
        "load_avg_start": os.getloadavg()[0],
        "workloads": {},
    }
    files = deepseek_v3_files()
    for f in [] if args.timing_only else files:
        load = load_deepseek_v3(f).astype(np.float64)
        row = quality(load, G, N, P)
        if args.node_slots:
            row["at_node_slots"] = quality(load, G, N, args.node_slots)
        out["workloads"][f.stem] = row  # type: ignore[index]
        if not args.json:
            print(
                f"{f.stem:24s} healthy {row['healthy']:.3f} planned {row['planned_mean']:.3f} "
                f"(x{row['planned_over_healthy']:.3f}, min {row['planned_min']:.3f}) repair "
                f"{row['repair_mean']:.3f} moved {row['moved_mean']:.0f} vs scratch "
                f"{row['scratch_moved_mean']:.0f} (max ratio {row['moved_over_scratch_max']:.3f}); "
                f"node losses at P={P}: {row['node_feasible']}/{row['node_losses']} servable"
            )
            if args.node_slots:
                n = row["at_node_slots"]
                print(
                    f"{'':24s} at P={args.node_slots}: node losses "
                    f"{n['node_feasible']}/{n['node_losses']} servable, worst balancedness "
                    f"{n['node_balancedness_min']:.3f} (healthy {n['healthy']:.3f})"
                )
    load = load_deepseek_v3(files[0]).astype(np.float64)
    timings = [timing(load, G, N, P, args.repeats)]
    if args.node_slots:  # where every node loss has a placement to plan
        timings.append(timing(load, G, N, args.node_slots, args.repeats))
    if args.wide:
        wide_g, wide_n, wide_p = (int(v) for v in args.wide.split(","))
        timings.append(timing(load, wide_g, wide_n, wide_p, args.wide_repeats))
    out["timing"] = timings
    out["load_avg_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out))
    else:
        for t in timings:
            print_timing(t)
        print(
            f"load {out['load_avg_start']:.1f}-{out['load_avg_end']:.1f} on {os.cpu_count()} cores"
        )


if __name__ == "__main__":
    main()
