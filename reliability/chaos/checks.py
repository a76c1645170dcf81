"""The invariants the campaign checks (RELIABILITY.md): agreement after every episode (7),
live processes, and from the ranks' step logs one version per step on every rank (2),
outputs equal to the unbalanced reference (1), only committed versions run (5), no step
waiting on the rebalancer (3); controller recovery times."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rebalancer.controller.store import Store
from reliability.chaos.config import DEPLOYMENT
from reliability.chaos.processes import Group
from reliability.chaos.steplog import (
    DIFF,
    HOOK_MS,
    HOOK_RUNQ_MS,
    STEP,
    STEP_LOG_COLUMNS,
    VERSION,
    WALL,
)

if TYPE_CHECKING:
    from reliability.chaos.harness import Harness

Violation = Callable[[str], None]


@dataclass
class Outcome:
    faults: Counter[str] = field(default_factory=Counter)
    phases: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)
    refused_starts: list[str] = field(default_factory=list)
    controller_restarts: int = 0
    group_restarts: int = 0
    sidecar_restarts: int = 0
    settle_seconds: list[float] = field(default_factory=list)
    # Wall-clock spans where a rank was frozen or its group down: a step gap there is the
    # fault itself, not a wait on the rebalancer.
    excused: list[tuple[float, float]] = field(default_factory=list)


# ---------------------------------------------------------------- during the run


def store_version(db: Path) -> int | None:
    """The committed version in the store, read as another process would."""
    try:
        store = Store(db)
    except Exception:  # noqa: BLE001 - a store being restarted or faulted: ask again
        return None
    try:
        rows = [d for d in store.load_deployments() if d.name == DEPLOYMENT]
        return rows[0].committed_version if rows else None
    except Exception:  # noqa: BLE001
        return None
    finally:
        store.close()


def settle(h: Harness) -> None:
    """Invariant 7: store, controller and every rank on one version (no plan in flight)."""
    start = time.monotonic()
    seen = ""
    while time.monotonic() - start < h.cfg.settle_seconds:
        check_liveness(h)
        s = h.status(1.0)
        ranks = h.rank_versions()
        stored = store_version(h.db)
        if s is not None:
            seen = (
                f"store v{stored}, controller v{s.placement_version} ({s.connected_ranks} ranks, "
                f"plan {s.plan_in_flight or '-'} {s.plan_phase}), ranks {ranks}"
            )
            if (
                not s.plan_in_flight
                and s.connected_ranks == h.cfg.workers
                and stored == s.placement_version
                and all(v == stored for v in ranks)
            ):
                h.out.settle_seconds.append(time.monotonic() - start)
                return
        time.sleep(0.05)
    h.violation(f"7: no agreement {h.cfg.settle_seconds:.0f} s after the episode: {seen}")


def check_liveness(h: Harness) -> None:
    """A process that ended on its own is a finding; it is restarted so the run goes on."""
    procs = h.procs
    if procs.controller is not None and procs.controller.poll() is not None:
        h.violation(
            f"controller exited with {procs.controller.returncode}: {procs.tail('controller.log')}"
        )
        h.restart_controller()
    for pod, proc in enumerate(procs.sidecars):
        if proc is not None and proc.poll() is not None:
            h.violation(
                f"sidecar {pod} exited with {proc.returncode}: {procs.tail(f'sidecar{pod}.log')}"
            )
            procs.start_sidecar(pod)
    g = procs.group
    if g is not None and any(p.poll() is not None for p in g.procs):
        codes = [p.poll() for p in g.procs]
        h.violation(
            f"group {g.index}: a rank exited on its own {codes}: "
            f"{procs.tail(f'g{g.index}-rank{codes.index(next(c for c in codes if c is not None))}.log')}"  # noqa: E501
        )
        h.restart_group()


# ---------------------------------------------------------------- after the run


def final_plans(db: Path, violation: Violation) -> dict[int, str]:
    """Every plan's version and final state in the store."""
    try:
        store = Store(db)
    except Exception as exc:  # noqa: BLE001
        violation(f"the store does not open after the run: {exc}")
        return {}
    try:
        return {p.version: p.state for p in store.plans(DEPLOYMENT, 100000)}
    finally:
        store.close()


def check_step_logs(
    groups: Iterable[Group],
    plans: dict[int, str],
    excused: list[tuple[float, float]],
    step_wait_bound_ms: float,
    violation: Violation,
) -> dict[str, Any]:
    """Invariants 1, 2, 3, 5 from every group's step logs; the run's figures."""
    committed = {v for v, state in plans.items() if state == "committed"} | {0}
    aborted = {v for v, state in plans.items() if state == "aborted"}
    steps = 0
    max_wait = 0.0
    max_hook = 0.0
    max_gap = 0.0
    for g in groups:
        rows = [
            np.array(log.read(), dtype=np.float64).reshape(-1, STEP_LOG_COLUMNS) for log in g.logs
        ]
        steps += sum(len(r) for r in rows)
        if not all(len(r) for r in rows):
            continue
        n = min(len(r) for r in rows)  # steps every rank logged (a killed rank's tail differs)
        for r in rows:
            if not np.array_equal(r[:n, STEP], np.arange(n)):
                violation(f"group {g.index}: a step log is not one row per step")
        versions = np.stack([r[:n, VERSION] for r in rows])
        mixed = np.flatnonzero((versions != versions[0]).any(axis=0))
        if len(mixed):
            s = int(mixed[0])
            violation(
                f"2: group {g.index}: {len(mixed)} steps ran mixed versions, first step {s}: "
                f"{versions[:, s].astype(int).tolist()}"
            )
        for rank, r in enumerate(rows):
            bad = np.flatnonzero(r[:, DIFF] != 0.0)
            if len(bad):
                violation(
                    f"1: group {g.index} rank {rank}: {len(bad)} steps differ from the reference "
                    f"(max {r[:, DIFF].max():g})"
                )
            ran = {int(v) for v in np.unique(r[:, VERSION])}
            if ran - committed:
                violation(
                    f"5: group {g.index} rank {rank} ran versions {sorted(ran - committed)} that "
                    f"are not committed in the store (aborted: {sorted(ran & aborted)})"
                )
            waited = r[:, HOOK_MS] - r[:, HOOK_RUNQ_MS]  # in the hook, not waiting for a CPU
            max_wait = max(max_wait, float(waited.max()))
            max_hook = max(max_hook, float(r[:, HOOK_MS].max()))
            slow = np.flatnonzero(waited > step_wait_bound_ms)
            if len(slow):
                worst = int(slow[np.argmax(waited[slow])])
                violation(
                    f"3: group {g.index} rank {rank}: {len(slow)} steps spent more than "
                    f"{step_wait_bound_ms:g} ms in the hook besides waiting for a CPU "
                    f"(max {waited[worst]:.0f} ms at step {worst}, {r[worst, HOOK_MS]:.0f} ms "
                    f"with the CPU wait)"
                )
            gaps = np.diff(r[:, WALL])
            ends = r[1:, WALL]
            ok = np.ones(len(gaps), dtype=bool)
            for a, b in excused:
                ok &= ~((ends >= a) & (ends - gaps <= b))
            if ok.any():
                max_gap = max(max_gap, float(gaps[ok].max()))
        # All or nothing: the versions a group ran, the same on every rank (up to the
        # steps all of them logged), each committed.
        ran_all = [set(np.unique(r[:n, VERSION]).astype(int)) for r in rows]
        if any(s != ran_all[0] for s in ran_all):
            violation(f"5: group {g.index}: ranks ran different version sets {ran_all}")
    return {
        "steps": steps,
        "max_step_wait_ms": round(max_wait, 2),
        "max_hook_ms": round(max_hook, 2),
        "max_step_gap_ms": round(1e3 * max_gap, 1),
        "plans_committed": len(committed - {0}),
        "plans_aborted": len(aborted),
    }


def transfer_timeouts(folder: Path) -> int:
    """Plans whose weight transfers timed out on a rank (a peer never joined them):
    gloo then closes the migration group's pairs, and later plans fail on that group
    until it restarts (an open finding, RELIABILITY.md)."""
    count = 0
    for log in folder.glob("g*-rank*.log"):
        text = log.read_text(errors="replace")
        count += text.count("Timed out waiting") + text.count("timeout caused pair closure")
    return count


def recovery_p99(recoveries: list[float]) -> float:
    """Controller recovery: from the kill to every rank resynced, 99th percentile."""
    return float(np.percentile(sorted(recoveries), 99)) if recoveries else 0.0
