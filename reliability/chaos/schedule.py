"""The campaign's timeline: which fault each episode injects, at which plan phase, with
which link faults beside it, all drawn from the one seeded RNG of the run in a fixed order
(a seed gives the same fault sequence), and bringing a plan to that phase."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Literal

import grpc

from rebalancer.v1 import rebalancer_pb2 as pb
from reliability.chaos.config import DEPLOYMENT
from reliability.chaos.faults import LINK_FAULTS, WEIGHTS
from reliability.chaos.steplog import PREPARED, READY, VERSION

if TYPE_CHECKING:
    from reliability.chaos.harness import Harness

Phase = Literal[
    "any", "proposed", "preparing", "prepared", "commit_sent", "commit_agreed", "switched"
]
PHASES: tuple[Phase, ...] = (
    "proposed",
    "preparing",
    "prepared",
    "commit_sent",
    "commit_agreed",
    "switched",
)
# Every seventh episode strikes at a random moment instead of a plan phase.
ANY_EVERY = 7


def first_turns(rng: random.Random, kinds: tuple[str, ...]) -> list[str]:
    """Every kind once (shuffled): the campaign's first episodes."""
    turns = list(kinds)
    rng.shuffle(turns)
    return turns


def next_kind(rng: random.Random, kinds: tuple[str, ...]) -> str:
    """After the first turns: a kind by its weight."""
    return rng.choices(list(kinds), [WEIGHTS[k] for k in kinds])[0]


def phase_of(episode: int) -> Phase:
    """The plan phase episode number `episode` strikes at, in turn."""
    return "any" if episode % ANY_EVERY == ANY_EVERY - 1 else PHASES[episode % len(PHASES)]


def storm(rng: random.Random, kinds: tuple[str, ...]) -> list[str]:
    """Faults overlap: besides the episode's own, up to three link faults on random links,
    started at the same moment (the proxy ends them)."""
    extras = [k for k in kinds if k in LINK_FAULTS]
    if not extras:
        return []
    return [rng.choice(extras) for _ in range(rng.choice([0, 1, 2, 3, 3]))]


def force(h: Harness) -> int:
    """Force a plan now (waiting for one in flight to end first); its version or 0."""
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        s = h.status(1.0)
        if s is not None and not s.plan_in_flight and s.connected_ranks == h.cfg.workers:
            try:
                h.admin.ForceRebalance(pb.ForceRebalanceRequest(deployment=DEPLOYMENT), timeout=3)
            except grpc.RpcError:
                time.sleep(0.1)
                continue
            s = h.status(1.0)
            return int(s.plan_in_flight) if s is not None else 0
        time.sleep(0.05)
    return 0


def reach(h: Harness, phase: Phase) -> str:
    """Bring a plan to `phase` and return as soon as it is there: the phase reached
    ("missed" when the plan ended or the phase passed unseen)."""
    if phase == "any":
        time.sleep(h.rng.uniform(0.0, 1.0))
        return "any"
    group = h.procs.group
    assert group is not None
    for log in group.logs:
        log.read()
    prepared0 = [int(log.last[PREPARED]) if log.last else 0 for log in group.logs]
    version = force(h)
    if not version:
        return "missed"
    if phase == "proposed":
        return phase
    deadline = time.monotonic() + h.cfg.prepare_timeout_seconds + 3
    while time.monotonic() < deadline:
        rows = [log.read()[-1] if log.read() else None for log in group.logs]
        if any(r is None for r in rows):
            time.sleep(0.01)
            continue
        prepared = sum(int(r[PREPARED]) > p for r, p in zip(rows, prepared0, strict=True))  # type: ignore[index]
        ready = sum(int(r[READY]) >= version for r in rows)  # type: ignore[index]
        switched = sum(int(r[VERSION]) >= version for r in rows)  # type: ignore[index]
        s = h.status(0.5) if phase in ("preparing", "prepared", "commit_sent") else None
        in_flight = s is not None and s.plan_in_flight == version
        if (
            phase == "preparing"
            and in_flight
            and s is not None
            and s.plan_phase == "preparing"
            and prepared == 0
        ):
            time.sleep(h.rng.uniform(0.0, 0.1))
            return phase
        if (
            phase == "prepared"
            and in_flight
            and s is not None
            and s.plan_phase == "preparing"
            and 0 < prepared
        ):
            return phase
        if (
            phase == "commit_sent"
            and in_flight
            and s is not None
            and s.plan_phase == "committing"
            and switched == 0
        ):
            return phase
        if phase == "commit_agreed" and ready > 0 and switched == 0:
            return phase
        if phase == "switched" and switched > 0:
            return phase
        if switched == len(rows) or (
            s is not None
            and s.plan_in_flight != version
            and prepared == 0
            and phase in ("preparing", "prepared")
        ):
            return "missed"
        time.sleep(0.005)
    return "missed"
