"""What the controller holds about one deployment, and who is told when it changes.

A deployment is one model served by one EP group of G ranks: its shape, committed
placement, the ranks' sessions (one per rank, or one per group of ranks: a pod's
sidecar), the window merger, the policy loop (estimate + decision timing), the plan in
flight, the newest aborted plan (retold to a session that reconnects) and running
totals. The modules beside this one (registry, reconcile, fold, decisions, plans,
operate) change these objects; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from rebalancer.controller.coordinate import Aborted, Mixed, Plan, Unconfirmed, who
from rebalancer.controller.decide import ClusterShape, Decision, PolicyConfig
from rebalancer.controller.estimate import LoadEstimator
from rebalancer.controller.ingest import WindowMerger
from rebalancer.controller.policy_loop import PolicyLoop
from rebalancer.wire.dispatch import DEFAULT_DISPATCH_MODE

# (kind, payload) -> queued for the rank's stream; kind is "prepare", "commit" or "abort".
Send = Callable[[str, Any], None]


@dataclass
class Session:
    """One registration: of one rank, or of a group of ranks (`ranks`, a pod's sidecar),
    which then speaks for all of them: windows summed over them, reports for all."""

    session_id: str
    rank: int             # the rank, or a group's lowest rank
    worker_id: str
    registered_at: float  # controller clock
    send: Send | None = None
    streaming: bool = False
    ranks: tuple[int, ...] = ()  # every rank it stands for; () means (rank,)
    pod: str = ""                # a group's pod, for logs

    def __post_init__(self) -> None:
        self.ranks = tuple(sorted(self.ranks)) if self.ranks else (self.rank,)

    @property
    def group(self) -> bool:
        return len(self.ranks) > 1 or bool(self.pod)

    @property
    def label(self) -> str:
        """`rank 3`, or `ranks 0-7 (pod ns/name)`."""
        return who(self.ranks, self.pod)


@dataclass
class WindowEvent:
    """One folded window, for observers (demo display, metrics)."""

    deployment: str
    seq: int
    ranks: int
    version: int
    tokens: int
    balancedness_actual: float     # routed load of this window on the GPUs, measured
    balancedness_estimated: float  # current placement on the estimate
    balancedness_best: float       # a fresh placement on this window's counts


@dataclass
class DeploymentStats:
    windows_ingested: int = 0
    tokens_folded: int = 0   # routed (token, k) pairs counted; persisted with the cursor
    duplicate_windows: int = 0  # resent windows recognised (the merger refuses them)
    plans_committed: int = 0
    plans_aborted: int = 0
    plans_partial: int = 0   # Commit out, then a rank failed: applied in part (Mixed)
    slots_moved: int = 0
    bytes_moved: int = 0
    balancedness_actual: float = float("nan")
    # [L, G] routed load per GPU of the newest window with dispatch counts (metrics.py
    # derives the per-layer balancedness quantiles and the per-rank series from it).
    gpu_load: np.ndarray | None = None


@dataclass
class Observers:
    """Callbacks on the controller's event loop: (deployment, plan, what) with what in
    proposed / prepared / committed / aborted / unconfirmed / partial, and (deployment, decision,
    trigger) with trigger "policy" or "forced"."""

    window: list[Callable[[WindowEvent], None]] = field(default_factory=list)
    plan: list[Callable[[str, Plan, str], None]] = field(default_factory=list)
    decision: list[Callable[[str, Decision, str], None]] = field(default_factory=list)


class Deployment:
    def __init__(
        self, name: str, shape: ClusterShape, policy: PolicyConfig, version: int, phy2log: np.ndarray
    ) -> None:
        self.name = name
        self.shape = shape
        self.version = version
        self.phy2log = phy2log
        self.sessions: dict[int, Session] = {}  # rank -> its session (a group's under each rank)
        self.windows = WindowMerger(shape.num_gpus)
        self.persisted_at = -float("inf")
        self.deciding = False  # a decision is being computed off the event loop
        # Estimate and decision timing: the same object the simulator drives.
        self.loop = PolicyLoop(shape, policy)
        self.plan: Plan | None = None
        # The newest aborted plan while it is above the committed version: told again to
        # a session opening its stream, so staging made while it was away is dropped.
        self.last_aborted: Aborted | None = None
        # The newest plan whose Commit went out unconfirmed, while above the committed
        # version: its Commit is told again to a session opening its stream.
        self.last_unconfirmed: Unconfirmed | None = None
        # Set while the ranks serve a placement a plan left applied in part: no plan
        # starts until the group restarts (registry.register clears it).
        self.mixed: Mixed | None = None
        self.stats = DeploymentStats()
        # Shape fields the store held no value for (written before they existed): the
        # first rank that reports them sets them (`merge_shape`).
        self.unknown_fields: frozenset[str] = frozenset()

    @property
    def policy(self) -> PolicyConfig:
        return self.loop.policy

    @property
    def estimator(self) -> LoadEstimator:
        return self.loop.estimator

    @property
    def next_seq(self) -> dict[int, int]:
        return self.windows.next_seq

    @property
    def connected_ranks(self) -> int:
        """Ranks with a stream open, their own or their group's."""
        return sum(1 for s in self.sessions.values() if s.streaming)

    def live_sessions(self) -> list[Session]:
        """Each session once (a group's is held under each of its ranks)."""
        return list({id(s): s for s in self.sessions.values()}.values())

    def send_all(self, kind: str, plan: Plan) -> None:
        """Queue one plan phase on every session with a stream open (once per group)."""
        for session in self.live_sessions():
            if session.send is not None:
                session.send(kind, plan)


def shape_key(shape: ClusterShape) -> dict[str, Any]:
    """The shape as stored and compared: plain ints (the dispatch mode: its name)."""
    return {k: v if isinstance(v, str) else int(v) for k, v in asdict(shape).items()}


def dispatch_shape(shape: ClusterShape, dispatch_mode: str, top_k: int) -> ClusterShape:
    """A Register's shape with its dispatch mode ("" = split) and top_k, checked."""
    out = replace(shape, dispatch_mode=dispatch_mode or DEFAULT_DISPATCH_MODE, top_k=int(top_k))
    out.validate()
    return out


# Shape fields added after deployments were first stored: a row without them loads with
# the field unknown (registry.load), and top_k 0 means unknown wherever it comes from.
LATER_SHAPE_FIELDS = ("dispatch_mode", "top_k")


def merge_shape(stored: ClusterShape, reported: ClusterShape, unknown: frozenset[str]) -> ClusterShape | None:
    """The deployment's shape once a rank reports `reported`, or None if the two disagree.

    1. A stored field that is unknown (in `unknown`: absent from an older store; top_k 0)
       takes the reported value, so ranks that now send their dispatch mode and top_k
       join a deployment saved before they did.
    2. A rank reporting top_k 0 (it does not know) accepts the stored top_k.
    3. Everything else must be equal (a rank sending no dispatch mode means split).
    """
    merged = stored
    if "dispatch_mode" in unknown:
        merged = replace(merged, dispatch_mode=reported.dispatch_mode)
    if merged.top_k == 0 or "top_k" in unknown:
        merged = replace(merged, top_k=reported.top_k or merged.top_k)
    seen = reported if reported.top_k else replace(reported, top_k=merged.top_k)
    return merged if shape_key(merged) == shape_key(seen) else None
