"""Prometheus metrics of the controller, on a port of their own; every name defined here once.

Two kinds: state read at scrape time from the controller (balancedness, versions,
connected ranks, the rebalancing state, totals kept in each deployment's stats), so
nothing is copied on the hot path; and events counted as they happen (decisions with
their predicted gain and cost, plan phases, durations and aborts, ingest latency and
bytes). A scrape is written on the event loop, where both change: the fleet's series
(per deployment and pool) as text in slices (exposition.py), the process's own few
through prometheus_client's registry.

Labels are bounded: deployment, and small fixed sets (source, stat, state, outcome,
trigger, phase, reason). Every counter has its zero series for each known label value
from the start (a deployment's once it is known), so `rate()` and `increase()` see the
first event instead of a series that appears with it. The process's own series
(`process_*`: CPU seconds, resident memory, open descriptors, start time) come from
prometheus_client's process collector. Per-layer and per-rank series (`layer`, `rank` labels: 61
layers x 72 ranks is 4,392 series for one DeepSeek-V3 deployment) come only with
`per_layer` (the server's `per_layer_metrics` setting, default off).

For readers of vLLM's EPLB metrics: `vllm:eplb_balancedness_{min,p50,p90,avg}` is
`rebalancer_balancedness{source="actual", stat=...}` here (mean/max GPU load per layer of
the routed tokens, summarised over layers); rearrangements are
`rebalancer_plans_total{outcome="committed"}`.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import zlib
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from typing import Any

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from rebalancer import __version__
from rebalancer.controller.config import ShardConfig
from rebalancer.controller.coordinate import Plan, PlanState
from rebalancer.controller.cost import plan_cost
from rebalancer.controller.decide import Decision
from rebalancer.controller.decision_runner import RECORDED_OUTCOMES, TRIGGERS
from rebalancer.controller.deployment import Deployment
from rebalancer.controller.exposition import (
    Family,
    Labeled,
    Names,
    counter,
    gauge,
    write_in_steps,
)
from rebalancer.controller.loop_busy import ITERATION_BUCKETS, TimedSelector, for_loop
from rebalancer.controller.state import Controller

# ---------------------------------------------------------------- names (the API)
BUILD = "rebalancer_build"  # _info{version}
SHARD = "rebalancer_shard"  # _info{shard, shards}: this controller's place among the shards
SHARDS = "rebalancer_shards"  # how many shards split the fleet (an alert counts them)
BALANCEDNESS = "rebalancer_balancedness"  # {deployment, source, stat}
PLACEMENT_VERSION = "rebalancer_placement_version"  # committed placement version
CONNECTED_RANKS = (
    "rebalancer_connected_ranks"  # ranks there (own stream, or their sidecar's report)
)
RANKS = "rebalancer_ranks"  # G of the EP group
STREAMS = "rebalancer_streams"  # open streams (one per rank or per pod)
STATE = "rebalancer_rebalancing_state"  # {deployment, state}: 1 for the current one
PAUSED = "rebalancer_paused"  # 1: automatic rebalancing paused
MIXED = "rebalancer_mixed_placement"  # 1: the ranks serve a plan applied in part
WINDOWS_INGESTED = "rebalancer_windows_ingested"  # counter: windows received (per stream)
WINDOWS_FOLDED = "rebalancer_windows_folded"  # counter: merged windows in the estimate
DUPLICATE_WINDOWS = "rebalancer_duplicate_windows"  # counter: resent windows recognised
PLANS = "rebalancer_plans"  # counter {outcome}: committed | aborted | stopped | partial
MIGRATED_SLOTS = "rebalancer_migrated_slots"  # counter
MIGRATED_BYTES = "rebalancer_migrated_bytes"  # counter
STORE_ERRORS = "rebalancer_store_errors"  # counter: statements SQLite refused
DECISIONS = "rebalancer_decisions"  # counter {outcome}
DECISION_GAIN = "rebalancer_decision_predicted_gain_seconds"  # {outcome}: newest such decision
DECISION_COST = "rebalancer_decision_migration_cost_seconds"  # {outcome}: newest such decision
REBALANCES = "rebalancer_rebalances"  # counter {trigger}: plans started
ABORTS = "rebalancer_plan_aborts"  # counter {reason}
PHASE_SECONDS = "rebalancer_plan_phase_seconds"  # histogram {phase}: prepare | commit
LAST_PLAN_SECONDS = "rebalancer_last_plan_seconds"  # newest committed plan: proposed -> committed
LAST_PLAN_STALL = "rebalancer_last_plan_stall_seconds"  # its serving stall (cost model)
INGEST_SECONDS = "rebalancer_ingest_seconds"  # histogram
INGEST_BYTES = "rebalancer_ingest_bytes"  # counter
INGEST_REFUSED = "rebalancer_ingest_refused"  # counter
POOL_MEMBERS = "rebalancer_pool_members"  # {pool}: deployments in the pool
POOL_DIVERGED = "rebalancer_pool_diverged_members"  # {pool}: members balanced alone
POOL_AT_TARGET = (
    "rebalancer_pool_members_at_target"  # {pool}: following members on the pool placement
)
POOL_MOVING = "rebalancer_pool_members_moving"  # {pool}: members with a plan toward it in flight
POOL_VERSION = "rebalancer_pool_placement_version"  # {pool}: pool placements taken so far
POOL_BALANCEDNESS = (
    "rebalancer_pool_balancedness"  # {pool}: the pool placement on the pool estimate
)
POOL_MEMBER_DIVERGED = "rebalancer_pool_member_diverged"  # {pool, deployment}: 1 while diverged
POOL_DIVERGENCES = "rebalancer_pool_divergences"  # counter {pool}: members that left the estimate
POOL_DECISIONS = "rebalancer_pool_decisions"  # counter {pool}: pool decisions computed
CONTINGENCY_BALANCEDNESS = (
    "rebalancer_contingency_balancedness"  # {deployment, loss, stat}: after a loss
)
CONTINGENCY_UNSERVED = (
    "rebalancer_contingency_unserved_experts"  # {deployment}: left without a slot by a node loss
)
CONTINGENCY_VERSION = (
    "rebalancer_contingency_base_version"  # {deployment}: placement the set derives from
)
REGIME_CURRENT = (
    "rebalancer_regime_current"  # {deployment}: regime of the newest window (regimes policy)
)
REGIME_LIBRARY = "rebalancer_regime_library_size"  # {deployment}: regimes kept
REGIME_LOAD = (
    "rebalancer_regime_decision_load"  # {deployment, load}: 1 for the newest decision's load
)
LOOP_BUSY = "rebalancer_event_loop_busy_seconds"  # counter: wall time the event loop ran callbacks
LOOP_ITERATION = "rebalancer_event_loop_iteration_seconds"  # histogram: callbacks between waits
# counter: worker seconds the policy's decisions took (decision_runner.DecisionBudget)
DECISION_WORKER_BUSY = "rebalancer_decision_worker_busy_seconds"
# gauge: seconds between two decisions of one deployment or pool the worker's share affords
DECISION_SPACING = "rebalancer_decision_spacing_seconds"
# gauge: the worker's share of a core now (decision_cpu_share, less under cpu_cores)
DECISION_SHARE = "rebalancer_decision_cpu_share"
RANK_WINDOWS_FOLDED = (
    "rebalancer_rank_windows_folded"  # counter: rank windows in the estimates, all deployments
)
# Only with per_layer:
LAYER_IMBALANCE = "rebalancer_layer_imbalance"  # {deployment, layer}: max/mean GPU load
RANK_LOAD_SHARE = "rebalancer_rank_load_share"  # {deployment, layer, rank}: share of the layer

# The rebalancing state of a deployment, as vLLM users ask for it.
STATES = ("idle", "preparing", "committing")
# Summaries over layers of the per-layer balancedness (as vLLM's eplb_balancedness_*).
STATS = ("min", "p50", "p90", "avg")
# Plan phases timed by PHASE_SECONDS.
PHASES = ("prepare", "commit")
# An abort's free-text reason -> its label (the first key found in it), else "other".
_ABORT_KEYS = (
    ("timeout", "timeout"),
    ("disconnected", "disconnect"),
    ("failed to prepare", "prepare_failed"),
    ("restarted", "restart"),
)
ABORT_REASONS = (*(label for _, label in _ABORT_KEYS), "other")


def abort_reason(reason: str) -> str:
    """The bounded label for a plan abort's free-text reason."""
    for key, label in _ABORT_KEYS:
        if key in reason:
            return label
    return "other"


def rebalancing_state(plan: Plan | None) -> str:
    """idle, preparing (weights moving), or committing (Commit sent, ranks switching)."""
    if plan is None or plan.state is PlanState.ABORTED:
        return "idle"
    return "preparing" if plan.state is PlanState.PREPARING else "committing"


def layer_summary(per_layer: np.ndarray) -> dict[str, float]:
    """min / p50 / p90 / avg over the layers with load of a per-layer balancedness [L]
    (the percentiles interpolated linearly, as numpy's default); empty when no layer has
    load. One sort: a scrape summarises two of these per deployment."""
    valid = np.sort(per_layer[np.isfinite(per_layer)])
    if not valid.size:
        return {}

    def at(q: float) -> float:
        pos = (valid.size - 1) * q
        low = int(pos)
        high = min(low + 1, valid.size - 1)
        return float(valid[low] + (valid[high] - valid[low]) * (pos - low))

    return {"min": float(valid[0]), "p50": at(0.5), "p90": at(0.9), "avg": float(valid.mean())}


def _per_layer(gpu_load: np.ndarray) -> np.ndarray:
    """Mean / max GPU load of each layer of [L, G] loads; NaN for a layer without load."""
    from rebalancer.placement.metrics import balancedness_of_gpu_loads

    return balancedness_of_gpu_loads(np.asarray(gpu_load, dtype=np.float64))


# The committed placement's balancedness on the load estimate (source "estimated") costs a
# shrunk estimate and a GPU load per deployment: 0.95 s of CPU for 2,048 DeepSeek-V3
# deployments, four times the rest of their scrape. It is computed again when the
# placement changed, else once it is older than this plus a spread of up to as much again
# (from the deployment's name), so that a fleet's refreshes fall on different scrapes.
ESTIMATED_REFRESH_SECONDS = 30.0


def estimated_refresh_after(deployment: str) -> float:
    """Seconds `deployment`'s "estimated" balancedness is kept: ESTIMATED_REFRESH_SECONDS
    to twice that, fixed per name."""
    return ESTIMATED_REFRESH_SECONDS * (1.0 + zlib.crc32(deployment.encode()) / 2**32)


def _any_wanted(families: Iterable[Family], names: Names) -> bool:
    return any(f.wanted(names) for f in families)


class _FleetSeries:
    """The series of each deployment and pool, read from the controller at scrape time and
    written as text (exposition.py). `families` is a generator that stops after each
    deployment or pool, so a scrape on the event loop can let windows in between."""

    def __init__(self, controller: Controller, per_layer: bool) -> None:
        self.controller = controller
        self.per_layer = per_layer
        # deployment -> (the placement and the time it was computed for, per-layer [L])
        self._estimated: dict[str, tuple[np.ndarray, float, np.ndarray]] = {}

    def families(self, names: Names) -> Generator[None, None, list[Family]]:
        """Every family (those `names` does not want left empty, their loop skipped)."""
        out: list[Family] = []
        for part in (self._deployments, self._pools, self._contingency, self._regimes):
            yield from part(out, names)
        return out

    def _deployments(self, out: list[Family], names: Names) -> Iterator[None]:
        g, c = gauge, counter
        bal = g(
            BALANCEDNESS,
            "Mean/max GPU load per layer (1 is perfect), summarised over layers "
            "(stat: min, p50, p90, avg); source actual: the routed tokens of the newest window, "
            "estimated: the committed placement on the load estimate "
            f"(at most {2 * ESTIMATED_REFRESH_SECONDS:.0f} s old).",
            labels=("deployment", "source", "stat"),
        )
        version = g(PLACEMENT_VERSION, "Committed placement version.", labels=("deployment",))
        ranks = g(
            CONNECTED_RANKS,
            "Ranks connected: with a stream of their own, or with one to their pod's "
            "sidecar (as it reports them) while the pod's stream is open.",
            labels=("deployment",),
        )
        expected = g(RANKS, "Ranks of the deployment's EP group (G).", labels=("deployment",))
        streams = g(
            STREAMS,
            "Open worker streams: one per rank, or one per pod through its sidecar.",
            labels=("deployment",),
        )
        state = g(
            STATE,
            "Rebalancing state (1 for the current one): idle, preparing (weights "
            "moving beside serving), committing (ranks switching at an agreed step).",
            labels=("deployment", "state"),
        )
        paused = g(PAUSED, "1 when automatic rebalancing is paused.", labels=("deployment",))
        mixed = g(
            MIXED,
            "1 while the ranks serve a mixed placement (a plan applied in part: "
            "its Commit went out, then a rank failed midway); no plan starts until they restart.",
            labels=("deployment",),
        )
        windows = c(
            WINDOWS_INGESTED,
            "Windows of counts received, one per stream and sequence number.",
            labels=("deployment",),
        )
        folded = c(
            WINDOWS_FOLDED,
            "Windows folded into the load estimate, one per sequence number "
            "merged over all ranks (what status and decisions count; kept across restarts).",
            labels=("deployment",),
        )
        dups = c(
            DUPLICATE_WINDOWS,
            "Resent windows recognised and not counted again.",
            labels=("deployment",),
        )
        plans = c(
            PLANS,
            "Plans finished, by outcome (committed: a rearrangement; aborted: "
            "failed; stopped: aborted as a rank stopped as planned; partial: "
            "applied in part, see rebalancer_mixed_placement).",
            labels=("deployment", "outcome"),
        )
        slots = c(MIGRATED_SLOTS, "Physical slots whose expert changed.", labels=("deployment",))
        moved = c(
            MIGRATED_BYTES, "Expert weight bytes moved by committed plans.", labels=("deployment",)
        )
        layer = g(
            LAYER_IMBALANCE,
            "Max/mean GPU load of each layer's routed tokens in the newest "
            "window (1 is perfect); per_layer_metrics only.",
            labels=("deployment", "layer"),
        )
        share = g(
            RANK_LOAD_SHARE,
            "Share of each layer's routed tokens on each rank in the newest "
            "window (1/G is even); per_layer_metrics only.",
            labels=("deployment", "layer", "rank"),
        )
        out += (
            bal,
            version,
            ranks,
            expected,
            streams,
            state,
            paused,
            mixed,
            windows,
            folded,
            dups,
            plans,
            slots,
            moved,
        )
        if self.per_layer:
            out += (layer, share)
        if not _any_wanted(out, names):
            return
        now, estimated = self.controller.clock(), self._estimated
        self._estimated = {}  # only deployments still there keep theirs
        for dep in list(self.controller.deployments.values()):
            name, stats = dep.name, dep.stats
            for source, per_layer in self._balancedness(dep, estimated, now).items():
                for stat, value in layer_summary(per_layer).items():
                    bal.add((name, source, stat), value)
            version.add((name,), dep.version)
            ranks.add((name,), dep.connected_ranks)
            expected.add((name,), dep.shape.num_gpus)
            streams.add((name,), sum(1 for s in dep.live_sessions() if s.streaming))
            current = rebalancing_state(dep.plan)
            for state_name in STATES:
                state.add((name, state_name), 1.0 if state_name == current else 0.0)
            paused.add((name,), 1.0 if dep.policy.paused else 0.0)
            mixed.add((name,), 1.0 if dep.mixed is not None else 0.0)
            windows.add((name,), stats.windows_ingested)
            folded.add((name,), dep.estimator.windows)
            dups.add((name,), stats.duplicate_windows)
            plans.add((name, "committed"), stats.plans_committed)
            plans.add((name, "aborted"), stats.plans_aborted)
            plans.add((name, "stopped"), stats.plans_stopped)
            plans.add((name, "partial"), stats.plans_partial)
            slots.add((name,), stats.slots_moved)
            moved.add((name,), stats.bytes_moved)
            if self.per_layer and stats.gpu_load is not None:
                loads = np.asarray(stats.gpu_load, dtype=np.float64)
                totals = loads.sum(axis=1)
                for i, b in enumerate(_per_layer(loads)):
                    if math.isfinite(b) and b > 0:
                        layer.add((name, str(i)), 1.0 / b)
                for i, row in enumerate(loads):
                    if totals[i] > 0:
                        for r, value in enumerate(row / totals[i]):
                            share.add((name, str(i), str(r)), float(value))
            yield

    def _regimes(self, out: list[Family], names: Names) -> Iterator[None]:
        """The regimes policy's library (regimes.py), per deployment (0 and the estimate for
        one on the adaptive policy)."""
        from rebalancer.controller.regimes import LOADS

        g = gauge
        current = g(
            REGIME_CURRENT,
            "Id of the load regime the newest window joined (regimes policy; 0: "
            "none yet, or not on the regimes policy); a change is a regime switch, `rebalancer "
            "admin regimes DEP` lists them.",
            labels=("deployment",),
        )
        size = g(
            REGIME_LIBRARY,
            "Load regimes the deployment's library keeps (regimes policy; 0 off it).",
            labels=("deployment",),
        )
        load = g(
            REGIME_LOAD,
            "1 for the load the newest decision of the regimes policy used (regime: a "
            "recognised regime's centroid; forecast: the drift forecast; alternation: the regimes "
            "in play; estimate: the adaptive estimate), 0 for the others.",
            labels=("deployment", "load"),
        )
        out += (current, size, load)
        if not _any_wanted((current, size, load), names):
            return
        for dep in list(self.controller.deployments.values()):
            # A deployment on the adaptive policy has no regime (0) and an empty library,
            # and its decisions use the estimate: every deployment has the series, so the
            # dashboard's row answers for a fleet that has not opted in.
            library = dep.regime_library
            current.add((dep.name,), 0 if library is None else library.current)
            size.add((dep.name,), 0 if library is None else len(library.regimes))
            last = dep.last_decision
            used = last.load.split(" ", 1)[0] if last is not None and last.load else ""
            if library is None:
                used = "estimate"
            for name in LOADS:
                load.add((dep.name, name), 1.0 if name == used else 0.0)
            yield

    def _contingency(self, out: list[Family], names: Names) -> Iterator[None]:
        """The survivor placements planned ahead (contingency.py): how balanced a single
        rank or node loss would leave each deployment, and whether a node loss can be served."""
        g = gauge
        bal = g(
            CONTINGENCY_BALANCEDNESS,
            "Balancedness the planned survivor placement would have after a "
            "single loss (loss: rank, node, or scale_down for a declared one; stat: worst or mean "
            "over the losses of that kind), on the estimate it was planned on; a loss no survivor "
            "placement can serve counts as 0.",
            labels=("deployment", "loss", "stat"),
        )
        unserved = g(
            CONTINGENCY_UNSERVED,
            "Experts per layer that the worst single node loss would leave "
            "without a slot on the survivors (0: every node loss can be served).",
            labels=("deployment",),
        )
        version = g(
            CONTINGENCY_VERSION,
            "Placement version the contingency set was planned on (behind "
            "rebalancer_placement_version while a new set is computed).",
            labels=("deployment",),
        )
        out += (bal, unserved, version)
        if not _any_wanted((bal, unserved, version), names):
            return
        for name in list(self.controller.deployments):
            made = self.controller.contingency.get(name)
            if made is None:
                continue
            summary = made.summary()
            for loss in ("rank", "node", "scale_down"):
                for stat in ("worst", "mean"):
                    value = summary.get(f"{loss}_{stat}", math.nan)
                    if math.isfinite(
                        value
                    ):  # NaN: no loss of that kind (one rank, one node, none declared)
                        bal.add((name, loss, stat), value)
            unserved.add((name,), summary["node_unserved"])
            version.add((name,), made.base_version)
            yield

    def _pools(self, out: list[Family], names: Names) -> Iterator[None]:
        """Replica pools (replica_pools/): members, divergence, rolling progress."""
        from rebalancer import placement

        g, c = gauge, counter
        members = g(POOL_MEMBERS, "Deployments in the replica pool.", labels=("pool",))
        diverged = g(
            POOL_DIVERGED,
            "Pool members whose windows stopped matching the pool estimate (balanced alone).",
            labels=("pool",),
        )
        at = g(POOL_AT_TARGET, "Following members that serve the pool placement.", labels=("pool",))
        moving = g(
            POOL_MOVING,
            "Members with a plan toward the pool placement in flight (at most the rolling cap).",
            labels=("pool",),
        )
        version = g(POOL_VERSION, "Pool placements taken so far (0: none yet).", labels=("pool",))
        bal = g(
            POOL_BALANCEDNESS,
            "Mean/max GPU load of the pool placement on the pool estimate, averaged over layers.",
            labels=("pool",),
        )
        member = g(
            POOL_MEMBER_DIVERGED,
            "1 while the member is diverged from its pool.",
            labels=("pool", "deployment"),
        )
        divergences = c(
            POOL_DIVERGENCES, "Members that left the pool estimate (diverged).", labels=("pool",)
        )
        decisions = c(
            POOL_DECISIONS,
            "Pool decisions computed (one serves every following member).",
            labels=("pool",),
        )
        families = (members, diverged, at, moving, version, bal, member, divergences, decisions)
        out += families
        if not _any_wanted(families, names):
            return
        deployments = self.controller.deployments
        for pool in list(self.controller.fleet.pools.values()):
            name = pool.name
            following = [deployments[m] for m in pool.following() if m in deployments]
            members.add((name,), len(pool.members))
            diverged.add((name,), len(pool.diverged()))
            at.add(
                (name,), sum(1 for d in following if pool.phy2log is not None and pool.at_target(d))
            )
            moving.add((name,), len(pool.members_moving(deployments)))
            version.add((name,), pool.version)
            estimate = pool.estimate()
            if pool.phy2log is not None and estimate.sum() > 0:
                bal.add(
                    (name,),
                    float(placement.balancedness(pool.phy2log, estimate, pool.shape.num_gpus)),
                )
            for m in sorted(pool.members):
                member.add((name, m), 0.0 if pool.is_following(m) else 1.0)
            divergences.add((name,), pool.stats.diverged_events)
            decisions.add((name,), pool.stats.decisions)
            yield

    def _balancedness(
        self,
        dep: Deployment,
        before: dict[str, tuple[np.ndarray, float, np.ndarray]],
        now: float,
    ) -> dict[str, np.ndarray]:
        """Per-layer balancedness [L] by source: measured on the newest window's routed
        tokens, and the committed placement on the load estimate (`before`: the latter as
        the last scrape computed it, kept while the placement is the same and it is
        younger than estimated_refresh_after)."""
        out = {}
        if dep.stats.gpu_load is not None:
            out["actual"] = _per_layer(dep.stats.gpu_load)
        if dep.estimator.windows:
            seen = before.get(dep.name)
            if (
                seen is None
                or seen[0] is not dep.phy2log
                or not 0 <= now - seen[1] < estimated_refresh_after(dep.name)
            ):
                from rebalancer import placement

                load = placement.gpu_load(dep.phy2log, dep.estimate(), dep.shape.num_gpus)
                seen = (dep.phy2log, now, _per_layer(load))
            self._estimated[dep.name] = seen
            out["estimated"] = seen[2]
        return out


# A scrape on the event loop writes for this long, then lets the loop run (windows wait
# for one slice at most, not for a whole scrape of a large fleet). Pausing between slices
# as well (a quarter of the loop at most, tried on issue 32) made a first scrape of 2,048
# deployments beside a 0.8-busy loop take 13 s, past Prometheus' 10 s scrape timeout.
SLICE_SECONDS = 0.005
# A scrape not written by then (the loop stopped, or stalled) is answered 503.
SCRAPE_TIMEOUT_SECONDS = 30.0

# Queued window times folded into the buckets on the loop once this many wait, scraped or
# not: at 16,384 windows a second an unscraped queue would otherwise grow without end.
FOLD_EVERY = 4096
INGEST_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)


class _IngestCollector(Collector):
    """What each window adds to the metrics, taken on the event loop in batches: a window
    only appends its time to a queue and adds its bytes to a dict (no lock, no series
    lookup); a scrape sorts the queued times into the histogram's buckets at once (issue 32:
    two prometheus_client updates a window, each behind a lock, were a share of the loop's
    time per message). Exported as a histogram and a counter, as they were."""

    def __init__(self) -> None:
        self._times: deque[float] = (
            deque()
        )  # appended on the loop, taken by scrapes (thread-safe ends)
        self._bytes: dict[str, int] = {}  # written on the loop only; read by scrapes
        self._lock = threading.Lock()  # scrapes (several threads) fold the queue one at a time
        self._bounds = np.array(INGEST_BUCKETS)
        self._counts = np.zeros(
            len(INGEST_BUCKETS) + 1, dtype=np.int64
        )  # the last: above every bound
        self._sum = 0.0

    def known(self, deployment: str) -> None:
        """A zero series for a deployment from the start."""
        self._bytes.setdefault(deployment, 0)

    def add(self, deployment: str, nbytes: int, seconds: float) -> None:
        byts = self._bytes
        byts[deployment] = byts.get(deployment, 0) + nbytes
        times = self._times
        times.append(seconds)
        if len(times) >= FOLD_EVERY:  # nobody scrapes (or not for long): the queue stays bounded
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Sort the queued times into the buckets (the caller holds the lock)."""
        times = self._times
        taken = np.fromiter((times.popleft() for _ in range(len(times))), dtype=np.float64)
        if taken.size:
            self._counts += np.bincount(
                np.searchsorted(self._bounds, taken, side="left"), minlength=self._counts.size
            )
            self._sum += float(taken.sum())

    def collect(self) -> Iterator[Any]:
        with self._lock:
            self._fold()
            cumulative = np.cumsum(self._counts)
            total = self._sum
        les = [floatToGoString(b) for b in INGEST_BUCKETS] + ["+Inf"]
        yield HistogramMetricFamily(
            INGEST_SECONDS,
            "Decode, validate and merge time of one window.",
            buckets=list(zip(les, (float(c) for c in cumulative), strict=True)),
            sum_value=total,
        )

    def bytes_family(self, out: list[Family], names: Names) -> Iterator[None]:
        """The bytes counter's family into `out`, written in steps (`write_in_steps`)."""
        byts = counter(INGEST_BYTES, "Bytes of count arrays ingested.", ("deployment",))
        out.append(byts)
        yield from write_in_steps(byts, names, [((n,), v) for n, v in list(self._bytes.items())])


class _ProcessCollector(Collector):
    """The controller process's own figures, apart from the fleet's series so that a scrape
    restricted to them (`/metrics?name[]=...`) costs almost nothing."""

    def __init__(self, controller: Controller, loop: TimedSelector | None) -> None:
        self.controller = controller
        self.loop = loop

    def collect(self) -> Iterator[Any]:
        info = InfoMetricFamily(BUILD, "Build of the controller.")
        info.add_metric([], {"version": __version__})
        yield info
        errors = CounterMetricFamily(
            STORE_ERRORS, "Statements the SQLite store refused (disk full, I/O error, locked)."
        )
        errors.add_metric([], self.controller.store.errors)
        yield errors
        folded = CounterMetricFamily(
            RANK_WINDOWS_FOLDED,
            "Rank windows folded into the load estimates, all deployments (a merged "
            "window counts each rank it holds): against the ranks' rate, whether the controller "
            "keeps up.",
        )
        folded.add_metric([], self.controller.folder.rank_windows_folded)
        yield folded
        budget = self.controller.decisions.budget
        worker = CounterMetricFamily(
            DECISION_WORKER_BUSY,
            "Worker seconds the policy's decisions took (and contingency sets); its rate "
            "against rebalancer_decision_cpu_share: at the share, decisions come less often.",
        )
        worker.add_metric([], budget.busy_seconds)
        yield worker
        spacing = GaugeMetricFamily(
            DECISION_SPACING,
            "Seconds between two decisions of one deployment or pool that keep the decision "
            "worker within decision_cpu_share at its mean decision cost (0: no limit).",
        )
        spacing.add_metric([], budget.spacing())
        yield spacing
        share = GaugeMetricFamily(
            DECISION_SHARE,
            "The decision worker's share of a core now: decision_cpu_share, or less where "
            "cpu_cores is set and the controller's own CPU leaves less of it (at least 0.05).",
        )
        share.add_metric([], budget.share)
        yield share
        if self.loop is not None:  # the loop `rebalancer serve` runs (loop_busy.py)
            busy = CounterMetricFamily(
                LOOP_BUSY,
                "Wall seconds the controller's event loop spent running callbacks (not waiting "
                "for I/O or timers); its rate is the loop's busy share: near 1, windows queue.",
            )
            busy.add_metric([], self.loop.busy_seconds())
            yield busy
            counts = np.cumsum(self.loop.iterations)
            yield HistogramMetricFamily(
                LOOP_ITERATION,
                "Wall time of one event-loop iteration: the callbacks run between two waits "
                "for I/O, one after another; a window arriving meanwhile waits for the "
                "iteration to end (a long one is a latency spike even on an idle loop).",
                buckets=list(
                    zip(
                        [floatToGoString(b) for b in ITERATION_BUCKETS] + ["+Inf"],
                        map(float, counts),
                        strict=True,
                    )
                ),
                sum_value=self.loop.iteration_seconds,
            )


class ControllerMetrics:
    """The metrics of one controller, wired to its observers: prometheus_client's registry for
    the process's own series, text families (exposition.py) for the fleet's.

    `per_layer`: also export the per-layer and per-rank series (many: see the module
    docstring)."""

    def __init__(
        self, controller: Controller, per_layer: bool = False, shard: ShardConfig | None = None
    ) -> None:
        # No `*_created` series (process-wide): prometheus_client adds them to the counters and
        # histograms it keeps, not to those read at scrape time, so only some counters had
        # one; creation times are no part of the metrics' contract.
        disable_created_metrics()
        self.controller = controller
        self.registry = CollectorRegistry(auto_describe=True)
        self._fleet = _FleetSeries(controller, per_layer)
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # made outside a loop (a test's, a tool's)
            self._loop = None
        self.registry.register(
            _ProcessCollector(controller, None if self._loop is None else for_loop(self._loop))
        )
        r = self.registry
        ProcessCollector(registry=r)
        shard = shard or ShardConfig()
        Info(
            SHARD,
            "This controller's shard (0 .. shards - 1) among the controller shards that split "
            "the fleet by replica pool (docs/shards.md); shard 0 of 1 owns everything.",
            registry=r,
        ).info({"shard": str(shard.index), "shards": str(shard.count)})
        Gauge(
            SHARDS,
            "How many controller shards split the fleet, as this one was told: a shard "
            "missing from the count of rebalancer_shard_info series is down or not scraped "
            "(RebalancerShardAbsent).",
            registry=r,
        ).set(shard.count)
        dep = ("deployment",)
        self.decisions = Labeled(
            DECISIONS, "counter", "Decisions taken, by outcome.", (*dep, "outcome")
        )
        self.decision_gain = Labeled(
            DECISION_GAIN,
            "gauge",
            "Predicted serving seconds saved over the policy's horizon by the newest "
            "decision of this outcome.",
            (*dep, "outcome"),
        )
        self.decision_cost = Labeled(
            DECISION_COST,
            "gauge",
            "Predicted serving seconds its weight migration costs (transfers beside "
            "serving, commit pause, map swap), newest decision of this outcome.",
            (*dep, "outcome"),
        )
        self.rebalances = Labeled(
            REBALANCES, "counter", "Plans started, by trigger.", (*dep, "trigger")
        )
        self.aborts = Labeled(ABORTS, "counter", "Plans aborted, by reason.", (*dep, "reason"))
        self.phase_seconds = Histogram(
            PHASE_SECONDS,
            "Duration of plan phases (prepare: proposed to all "
            "prepared; commit: all prepared to first commit confirmed).",
            ["phase"],
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.last_plan_seconds = Labeled(
            LAST_PLAN_SECONDS,
            "gauge",
            "Newest committed plan (rearrangement): seconds from proposed to the "
            "first rank's commit confirmed.",
            dep,
        )
        self.last_plan_stall = Labeled(
            LAST_PLAN_STALL,
            "gauge",
            "Newest committed plan: serving stall at its commit (staged experts copied "
            "into live slots on the busiest rank, plus the map swap), as the cost model predicts "
            "it from its transfer list and the deployment's policy.",
            dep,
        )
        self._ingest = _IngestCollector()  # rebalancer_ingest_seconds and _bytes, batched
        r.register(self._ingest)
        self.ingest_refused = Labeled(
            INGEST_REFUSED,
            "counter",
            "Windows refused (bad input, or not acceptable in this state); the stream ends.",
            dep,
        )
        self._events = (
            self.decisions,
            self.decision_gain,
            self.decision_cost,
            self.rebalances,
            self.aborts,
            self.last_plan_seconds,
            self.last_plan_stall,
            self.ingest_refused,
        )
        controller.observers.plan.append(self.on_plan)
        controller.observers.decision.append(self.on_decision)
        controller.observers.deployment.append(self.on_deployment)
        for phase in PHASES:
            self.phase_seconds.labels(phase)
        for name in list(controller.deployments):
            self.on_deployment(name)

    def on_deployment(self, deployment: str) -> None:
        """Zero series for every known label value of the deployment's counters."""
        for outcome in RECORDED_OUTCOMES:
            self.decisions.zero(deployment, outcome)
        for trigger in TRIGGERS:
            self.rebalances.zero(deployment, trigger)
        for reason in ABORT_REASONS:
            self.aborts.zero(deployment, reason)
        self._ingest.known(deployment)
        self.ingest_refused.zero(deployment)

    def on_decision(self, deployment: str, decision: Decision, trigger: str) -> None:
        self.decisions.inc(deployment, decision.outcome)
        for newest, value in (
            (self.decision_gain, decision.predicted_gain_seconds),
            (self.decision_cost, decision.migration_cost_seconds),
        ):
            if math.isfinite(value):
                newest.set(deployment, decision.outcome, value=value)

    def on_plan(self, deployment: str, plan: Plan, what: str) -> None:
        if what == "proposed":
            self.rebalances.inc(deployment, plan.trigger)
        elif what == "prepared" and plan.prepared_at:
            self.phase_seconds.labels("prepare").observe(
                max(0.0, plan.prepared_at - plan.started_at)
            )
        elif what == "committed" and plan.committed_at and plan.prepared_at:
            self.phase_seconds.labels("commit").observe(
                max(0.0, plan.committed_at - plan.prepared_at)
            )
            self.last_plan_seconds.set(
                deployment, value=max(0.0, plan.committed_at - plan.started_at)
            )
            self.last_plan_stall.set(deployment, value=self._stall(deployment, plan))
        elif what == "aborted" and not plan.stopped:  # a planned stop is no failure
            self.aborts.inc(deployment, abort_reason(plan.reason))

    def _stall(self, deployment: str, plan: Plan) -> float:
        dep = self.controller.deployments[deployment]
        shape = dep.shape
        cost = plan_cost(
            plan.transfers, shape.num_gpus, shape.num_nodes, shape.expert_bytes, dep.policy.cost
        )
        return cost.commit_pause_seconds + cost.swap_seconds

    def on_ingest(self, deployment: str, nbytes: int, seconds: float) -> None:
        """Once per window, on the event loop: batched (_IngestCollector)."""
        self._ingest.add(deployment, nbytes, seconds)

    def on_refused(self, deployment: str) -> None:
        self.ingest_refused.inc(deployment)

    def render(self, names: Names = None) -> bytes:
        """The exposition, on the calling thread at once (the loop's own, or a test's):
        everything, or the samples named in `names`."""
        steps = self._steps(names)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    async def render_sliced(self, names: Names = None) -> bytes:
        """The exposition, written on the event loop in slices of SLICE_SECONDS, so that
        windows arriving meanwhile wait for one slice, not for the whole scrape."""
        steps = self._steps(names)
        start = time.perf_counter()
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if time.perf_counter() - start > SLICE_SECONDS:
                await asyncio.sleep(0)
                start = time.perf_counter()

    def scrape(self, names: Names = None) -> bytes:
        """A scrape from the metrics server's thread: written on the controller's event loop
        (where the series change) in slices, else (no loop) on this thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return self.render(names)
        return asyncio.run_coroutine_threadsafe(self.render_sliced(names), loop).result(
            SCRAPE_TIMEOUT_SECONDS
        )

    def _steps(self, names: Names) -> Generator[None, None, bytes]:
        registry = self.registry if names is None else self.registry.restricted_registry(names)
        head = generate_latest(registry)
        families: list[Family] = []
        for labeled in self._events:
            yield from labeled.family(families, names)
        yield from self._ingest.bytes_family(families, names)
        families += yield from self._fleet.families(names)
        body = "".join(f.text() for f in families if f.wanted(names))
        return head + body.encode()
