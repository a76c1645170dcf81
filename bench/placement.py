"""Placement engine benchmark: speed, quality and migration on the DeepSeek-V3 counts.

Run as `python -m bench.placement`. Speed is measured on one core (BLAS/OpenMP threads
set to 1 before numpy loads) and reported as the best and the median of repeated runs,
with the vectorised greedy and the plain per-item port of it (`rebalancer.placement.reference`)
timed in the same run. The figures are printed and written to BENCHMARKS.md under the heading
"## Placement engine" (only that section is replaced; hand-written notes between its
speed table and the next heading are kept).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import itertools  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3  # noqa: E402
from rebalancer.placement import (  # noqa: E402
    balancedness,
    compute_placement,
    lower_bound_balancedness,
    reference_placement,
)
from rebalancer.placement.engine import greedy_placement  # noqa: E402
from rebalancer.placement.migration import keep_in_place  # noqa: E402

HEADING = "## Placement engine"
# name, slots, gpus, nodes, groups (DeepSeek-V3 has 8 expert groups; with 32 nodes the
# groups do not divide over the nodes, so that layout is global, as in the reference)
LAYOUTS = [
    ("G=32 N=4 P=288 global", 288, 32, 4, None),
    ("G=32 N=4 P=288 hierarchical", 288, 32, 4, 8),
    ("G=256 N=32 P=512", 512, 256, 32, 8),
]
BUDGETS = [0.02, 0.05, 0.10, 0.15, 0.20, None]


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best and median wall time of `repeats` calls, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPUs (nproc), {model}, load average {load:.1f} at start"


def speed(loads: dict[str, np.ndarray], repeats: int, loop: bool) -> list[str]:
    """Table: time per layout for ours, the vectorised greedy and the per-item port."""
    rows = [
        "| layout | ours best / median (ms) | vectorised greedy best / median (ms) "
        "| per-item greedy (ms) | speed-up vs per-item |",
        "|---|---|---|---|---|",
    ]
    for name, slots, gpus, nodes, groups in LAYOUTS:
        best_ours, med_ours, best_greedy, med_greedy = [], [], [], []
        for load in loads.values():
            best, med = timed(partial(compute_placement, load, slots, gpus, nodes, groups), repeats)
            best_ours.append(best)
            med_ours.append(med)
            weight = load.astype(np.float64)
            best, med = timed(
                partial(greedy_placement, weight, slots, gpus, nodes, groups), repeats
            )
            best_greedy.append(best)
            med_greedy.append(med)
        loop_ms = float("nan")
        if loop:
            first = next(iter(loads.values())).astype(np.float64)
            loop_ms = (
                1e3 * timed(partial(reference_placement, first, slots, gpus, nodes, groups), 1)[0]
            )
        ours_ms = 1e3 * statistics.median(med_ours)
        line = (
            f"| {name} | {1e3 * min(best_ours):.2f} / {ours_ms:.2f} | "
            f"{1e3 * min(best_greedy):.2f} / {1e3 * statistics.median(med_greedy):.2f} | "
            f"{loop_ms:.0f} | "
            f"{loop_ms / ours_ms:.0f}x |"
        )
        rows.append(line)
        print(line, flush=True)
    return rows


def quality(loads: dict[str, np.ndarray]) -> list[str]:
    """Table: balancedness of ours, the greedy and the bound, per file and layout."""
    rows = [
        "| workload | layout | trivial | greedy | ours | bound | gap to bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, slots, gpus, nodes, groups), (workload, load) in itertools.product(
        LAYOUTS, loads.items()
    ):
        trivial = np.tile(np.arange(slots) % load.shape[1], (load.shape[0], 1))
        greedy = compute_placement(load, slots, gpus, nodes, groups, algorithm="greedy")
        ours = compute_placement(load, slots, gpus, nodes, groups)
        bound = lower_bound_balancedness(load, slots, gpus, nodes, groups)
        line = (
            f"| {workload} | {name} | {balancedness(trivial, load, gpus):.3f} | "
            f"{greedy.balancedness:.4f} | {ours.balancedness:.4f} | {bound:.4f} | "
            f"{bound - ours.balancedness:.4f} |"
        )
        rows.append(line)
        print(line, flush=True)
    return rows


def migration(loads: dict[str, np.ndarray], slots: int, gpus: int, nodes: int) -> list[str]:
    """Every ordered pair (fit on A, re-plan for B): stale, re-planned, moved; then the
    balancedness / moved-fraction curve over budgets."""
    pairs = list(itertools.permutations(loads, 2))
    fitted = {
        name: compute_placement(load, slots, gpus, nodes).phy2log for name, load in loads.items()
    }
    rows = [
        f"Layout G={gpus} N={nodes} P={slots}, {len(pairs)} ordered pairs, no budget:",
        "",
        "| fit on A | re-plan for B | A's placement on B | ours on B | moved | "
        "fresh refit moved (relabelled) | ms |",
        "|---|---|---|---|---|---|---|",
    ]
    stale_all, ours_all, moved_all, fresh_all, relabel_all = [], [], [], [], []
    for a, b in pairs:
        start = time.perf_counter()
        result = compute_placement(loads[b], slots, gpus, nodes, previous=fitted[a])
        elapsed = time.perf_counter() - start
        stale = balancedness(fitted[a], loads[b], gpus)
        fresh = fitted[b]
        relabelled = keep_in_place(fitted[a], fresh, gpus, loads[b].shape[1])
        fresh_moved = float(np.mean(fresh != fitted[a]))
        relabel_moved = float(np.mean(relabelled != fitted[a]))
        stale_all.append(stale)
        ours_all.append(result.balancedness)
        moved_all.append(result.moved_fraction)
        fresh_all.append(fresh_moved)
        relabel_all.append(relabel_moved)
        line = (
            f"| {a} | {b} | {stale:.3f} | {result.balancedness:.4f} | "
            f"{result.moved_fraction:.3f} | {fresh_moved:.2f} ({relabel_moved:.2f}) | "
            f"{1e3 * elapsed:.0f} |"
        )
        rows.append(line)
        print(line, flush=True)
    summary = (
        f"| **mean** | | {np.mean(stale_all):.3f} | {np.mean(ours_all):.4f} | "
        f"{np.mean(moved_all):.3f} | {np.mean(fresh_all):.2f} ({np.mean(relabel_all):.2f}) | |"
    )
    rows += [
        summary,
        f"| **worst** | | {np.min(stale_all):.3f} | {np.min(ours_all):.4f} | "
        f"{np.max(moved_all):.3f} | | |",
    ]
    print(summary, flush=True)
    rows += [
        "",
        "Balancedness against moved fraction (mean over the pairs):",
        "",
        "| max moved fraction | mean balancedness on B | worst | mean moved |",
        "|---|---|---|---|",
    ]
    for budget in BUDGETS:
        results = [
            compute_placement(
                loads[b], slots, gpus, nodes, previous=fitted[a], max_moved_fraction=budget
            )
            for a, b in pairs
        ]
        line = (
            f"| {'none' if budget is None else f'{budget:.2f}'} | "
            f"{np.mean([r.balancedness for r in results]):.4f} | "
            f"{np.min([r.balancedness for r in results]):.4f} | "
            f"{np.mean([r.moved_fraction for r in results]):.3f} |"
        )
        rows.append(line)
        print(line, flush=True)
    return rows


def migration_summary(
    loads: dict[str, np.ndarray], slots: int, gpus: int, nodes: int, budgets: list[float | None]
) -> list[str]:
    """Means over every ordered pair only, for a second layout."""
    pairs = list(itertools.permutations(loads, 2))
    fitted = {
        name: compute_placement(load, slots, gpus, nodes).phy2log for name, load in loads.items()
    }
    rows = [
        f"Layout G={gpus} N={nodes} P={slots}, {len(pairs)} ordered pairs (means):",
        "",
        "| max moved fraction | A's placement on B | ours on B | worst | moved | ms |",
        "|---|---|---|---|---|---|",
    ]
    for budget in budgets:
        stale, ours, moved, seconds = [], [], [], []
        for a, b in pairs:
            start = time.perf_counter()
            result = compute_placement(
                loads[b], slots, gpus, nodes, previous=fitted[a], max_moved_fraction=budget
            )
            seconds.append(time.perf_counter() - start)
            stale.append(balancedness(fitted[a], loads[b], gpus))
            ours.append(result.balancedness)
            moved.append(result.moved_fraction)
        line = (
            f"| {'none' if budget is None else f'{budget:.2f}'} | {np.mean(stale):.3f} | "
            f"{np.mean(ours):.4f} | {np.min(ours):.4f} | {np.mean(moved):.3f} | "
            f"{1e3 * np.median(seconds):.0f} |"
        )
        rows.append(line)
        print(line, flush=True)
    return rows


def _after_speed_table(lines: list[str]) -> tuple[int, int]:
    """Where the notes after the speed table start and end (the next '### ' heading):
    indices into lines; (-1, -1) when there is no speed table."""
    start = next((i for i, line in enumerate(lines) if line.startswith("### Speed")), -1)
    if start < 0:
        return -1, -1
    i = start + 1
    while i < len(lines) and not lines[i].startswith("|"):
        i += 1
    while i < len(lines) and lines[i].startswith("|"):
        i += 1
    end = i
    while end < len(lines) and not lines[end].startswith("### "):
        end += 1
    return i, end


def write_section(path: Path, lines: list[str]) -> None:
    """Replace (or append) the '## Placement engine' section of BENCHMARKS.md, keeping
    the hand-written notes between its speed table and the next heading (figures from
    other machines, what a run measured)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(HEADING + "\n")
    end = -1 if start < 0 else text.find("\n## ", start + len(HEADING))
    if start >= 0:
        old = text[start : None if end < 0 else end].split("\n")
        first, last = _after_speed_table(old)
        notes = "\n".join(old[first:last]).strip("\n").split("\n") if first >= 0 else []
        at, _ = _after_speed_table(lines)
        if at >= 0 and any(line.strip() for line in notes):
            lines = [*lines[:at], "", *notes, *lines[at:]]
    section = "\n".join([HEADING, "", *lines]).rstrip() + "\n"
    if start < 0:
        text = text.rstrip() + "\n\n" + section
    else:
        text = text[:start] + section + ("" if end < 0 else text[end:])
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__)
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per file")
    parser.add_argument("--no-loop", action="store_true", help="skip the per-item port")
    parser.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument("--out", default="BENCHMARKS.md", help="file to update")
    args = parser.parse_args(argv)

    loads = {path.stem: load_deepseek_v3(path, moe_only=False) for path in deepseek_v3_files()}
    header = [
        f"Command: `python -m bench.placement` ({datetime.date.today().isoformat()}; "
        f"{machine()}; numpy {np.__version__}, one thread).",
        "Counts: the six DeepSeek-V3 workloads in rebalancer/data (61 layers, 58 with load, "
        "256 experts). Balancedness = mean/max GPU load per layer, averaged over layers "
        "with load; bound = best reachable (see docs/placement.md).",
    ]
    print("\n".join(header), flush=True)
    print("\n### Speed", flush=True)
    speed_rows = speed(loads, args.repeats, not args.no_loop)
    print("\n### Quality", flush=True)
    quality_rows = quality(loads)
    print("\n### Migration", flush=True)
    migration_rows = migration(loads, 288, 32, 4)
    migration_rows += [""] + migration_summary(loads, 512, 256, 32, [0.2, None])
    lines = [
        *header,
        "",
        "### Speed (one core; ours = `compute_placement`, algorithm auto, including "
        "validation and replica maps; per-item greedy = the reference's loops, one run "
        "on decode_in1000out1000)",
        "",
        *speed_rows,
        "",
        "### Quality",
        "",
        *quality_rows,
        "",
        "### Migration (fit on A, re-plan for B with A's placement as previous)",
        "",
        *migration_rows,
    ]
    if not args.no_write:
        write_section(Path(args.out), lines)
        print(f"\nwrote the '{HEADING}' section of {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
