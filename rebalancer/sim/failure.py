"""A GPU or node lost mid-trace (`rebalancer simulate --fail RANK@WINDOW --fail-node NODE@WINDOW`).

From the failure window on, three ways to keep serving on the survivors are compared on
the trace's own windows:
- repair: the >= 1-replica repair an engine improvises (vLLM's fault-tolerance path: each
  lost expert takes a spare copy's slot, round-robin over the survivors; no balancing);
- scratch: a from-scratch placement on the survivors (SGLang's elastic path);
- planned: the controller's survivor placement, planned ahead (`placement.survivors`).
All three start from the placement in use when the GPUs are lost: the one fitted on the
windows before the failure (the estimate the controller would hold), and are planned on
that estimate, not on the windows they are then measured on. Slots moved are counted
against what the survivors hold; relative throughput is the serving clock's
(`sim.cost.WindowClock`, the simulator's) balanced time over the time under the placement,
weight transfers not charged (a lower bound on what scratch's many moves cost).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from rebalancer.errors import InputError
from rebalancer.placement import compute_placement
from rebalancer.placement.migration import peak_load
from rebalancer.placement.survivors import repair_placement, surviving_slots, survivor_placement
from rebalancer.sim.cost import WindowClock
from rebalancer.sim.engine import SimConfig
from rebalancer.sim.trace import Trace

# The three ways compared, in the JSON's order.
FAILURE_WAYS = ("repair", "scratch", "planned")

_SPEC = re.compile(r"^\s*(\d+)\s*@\s*(\d+)\s*$")


def parse_at(spec: str, flag: str, what: str) -> tuple[int, int]:
    """`N@W` as (N, W), both non-negative integers; InputError naming the flag otherwise."""
    match = _SPEC.match(spec)
    if match is None:
        raise InputError(
            f"{flag}: expected {what}@WINDOW with non-negative integers (e.g. 3@10), got {spec!r}"
        )
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class Failure:
    """GPUs lost together at one window."""

    lost: tuple[int, ...]
    window: int


def parse_failures(
    ranks: list[str],
    nodes: list[str],
    num_gpus: int,
    num_nodes: int,
) -> Failure | None:
    """The failure that --fail (RANK@WINDOW, repeatable) and --fail-node (NODE@WINDOW,
    repeatable) describe, checked against the group (G ranks in N nodes), or None when
    neither is given. All must name one window (one failure event); at least one GPU must
    survive. The window is checked against the trace by `check_window`."""
    specs = [(*parse_at(s, "--fail", "RANK"), False) for s in ranks]
    specs += [(*parse_at(s, "--fail-node", "NODE"), True) for s in nodes]
    if not specs:
        return None
    per_node = num_gpus // num_nodes
    lost: set[int] = set()
    for index, _, is_node in specs:
        limit, name = (num_nodes, "node") if is_node else (num_gpus, "rank")
        if index >= limit:
            raise InputError(
                f"--fail{'-node' if is_node else ''}: {name} {index} is out of range "
                f"(the group has {limit} {name}s: 0..{limit - 1})"
            )
        lost.update(range(index * per_node, (index + 1) * per_node) if is_node else (index,))
    windows = sorted({w for _, w, _ in specs})
    if len(windows) > 1:
        raise InputError(
            f"--fail/--fail-node: every failure must name the same window (one failure "
            f"event), got windows {', '.join(map(str, windows))}"
        )
    if len(lost) >= num_gpus:
        raise InputError(f"--fail/--fail-node: all {num_gpus} ranks lost, none survives")
    return Failure(tuple(sorted(lost)), windows[0])


def check_window(failure: Failure, num_windows: int) -> None:
    """InputError unless the failure's window lies inside the trace."""
    if failure.window >= num_windows:
        raise InputError(
            f"--fail/--fail-node: window {failure.window} is beyond the trace "
            f"({num_windows} windows: 0..{num_windows - 1})"
        )


def simulate_failure(trace: Trace, config: SimConfig, failure: Failure) -> dict[str, Any]:
    """The three ways to serve on the survivors, from the failure window to the trace's end.

    Returns {"lost": [...], "window": w, "survivors": G', "slots": P', "feasible": bool,
    "repair"|"scratch"|"planned": {"balancedness_after", "slots_moved",
    "relative_throughput"}} (figures None where the survivors' slots cannot hold every
    expert: no placement serves them)."""
    num_gpus, num_slots, w = config.shape.num_gpus, config.shape.num_slots, failure.window
    counts = trace.counts.astype(np.float64)  # [T, L, E]
    num_logical = counts.shape[2]
    estimate = counts[:w].mean(axis=0) if w > 0 else counts[0]
    healthy = compute_placement(estimate, num_slots, num_gpus, config.shape.num_nodes).phy2log
    survivors = num_gpus - len(failure.lost)
    kept = healthy[:, surviving_slots(num_slots, num_gpus, failure.lost)]
    out: dict[str, Any] = {
        "lost": list(failure.lost),
        "window": w,
        "survivors": survivors,
        "slots": kept.shape[1],
        "feasible": kept.shape[1] >= num_logical,
    }
    if not out["feasible"]:
        return out | {
            way: {"balancedness_after": None, "slots_moved": None, "relative_throughput": None}
            for way in FAILURE_WAYS
        }
    placements = {
        "repair": repair_placement(healthy, num_gpus, failure.lost, num_logical),
        "scratch": compute_placement(estimate, kept.shape[1], survivors, 1).phy2log,
        "planned": survivor_placement(estimate, healthy, num_gpus, failure.lost).phy2log,
    }
    clock = WindowClock.calibrate(
        config.cost, config.params, trace.counts, trace.window_seconds, survivors
    )
    after = counts[w:]
    mean = after.sum(axis=(1, 2)) / survivors  # [T - w]: sum over layers of the mean GPU load
    for way, phy2log in placements.items():
        assert phy2log is not None  # feasible: every way has a placement
        peak = np.array([peak_load(phy2log, window, survivors).sum() for window in after])
        ideal = sum(clock.seconds(float(m)) for m in mean)
        taken = sum(clock.seconds(float(p)) for p in peak)
        out[way] = {
            "balancedness_after": round(float(mean.sum() / peak.sum()), 6),
            "slots_moved": int((phy2log != kept).sum()),
            "relative_throughput": round(ideal / taken, 6),
        }
    return out


def failure_table(out: dict[str, Any]) -> str:
    lines = [
        f"failure at window {out['window']}: ranks {out['lost']} lost, {out['survivors']} "
        f"survivors with {out['slots']} slots"
        + ("" if out["feasible"] else " (fewer than the experts: no placement serves them)"),
        f"{'way':9s} {'balanced':>8s} {'rel_tput':>8s} {'slots':>9s}",
    ]
    if out["feasible"]:
        for way in FAILURE_WAYS:
            f = out[way]
            lines.append(
                f"{way:9s} {f['balancedness_after']:8.4f} {f['relative_throughput']:8.4f} "
                f"{f['slots_moved']:9d}"
            )
    return "\n".join(lines)
