"""Contingency plans: a survivor placement ready for every single-rank and single-node
loss of each deployment, and for each scale-down it declares it may take
(`ContingencyConfig.scale_down_nodes`), before anything fails (docs/operations.md, "When
a GPU dies").

`ContingencyPlanner` owns every deployment's newest `ContingencySet`: it asks for one
after each committed placement and whenever the estimate has moved by `REFRESH_SHIFT`
(the share of load that changed experts) since the last, at most every
`MIN_INTERVAL_SECONDS`; the placement math (`placement.survivors`) runs on the decision
worker like a policy decision, never on the event loop. The members of a replica pool
that follow it and serve one placement (its placement, or the one before while it rolls
out) share one set, planned once on the pool's estimate (the load the pool decides on);
a member that diverges plans its own. A
set is versioned by the placement it derives from, stored (it survives a restart) and
recorded in the deployment's history (`admin history`). Operators read it with
`rebalancer admin contingency` and in the metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from rebalancer.controller.store import PackedArrays, pack_arrays
from rebalancer.errors import InputError
from rebalancer.placement import balancedness
from rebalancer.placement.survivors import survivor_placements
from rebalancer.wire.layout import placement_digest

if TYPE_CHECKING:  # annotations only: policy_config imports this module for its section
    from rebalancer.controller.clock import Clock
    from rebalancer.controller.deployment import Deployment, Session
    from rebalancer.controller.store import Store
    from rebalancer.wire.shape import ClusterShape

log = logging.getLogger("rebalancer.controller")

# A set is planned again when this share of the load moved between experts since the
# estimate it was planned on (half the L1 distance of the normalised loads, per layer,
# averaged), or when the committed placement changed.
REFRESH_SHIFT = 0.1
# For a moved estimate, no more often than this per deployment (a new placement is
# planned for at once): a set costs a few policy decisions of the worker's time.
MIN_INTERVAL_SECONDS = 300.0
# Bytes a second at which the members of pools take their pool's set, all pools together
# (the default of `[server] contingency_take_mb_per_second`): each take sends the
# survivors' placements to the member's ranks (2.1 MB at DeepSeek-V3 EP32) on the event
# loop's streams; the store holds them once for all the members (their rows name them by
# digest: store.py). 16 MB/s is about 8 sets a second, 2,048 members in 4-5 minutes; all
# of a fleet's members taking theirs at once held the loop and the streams for minutes.
TAKE_BYTES_PER_SECOND = 16e6

# A failure domain: one rank, one node, or the tail nodes a declared scale-down removes.
LossKind = Literal["rank", "node", "scale_down"]


@dataclass(frozen=True)
class ContingencyConfig:
    """The contingency planner's settings: the `contingency` section of a deployment's
    PolicyConfig (flat name on the wire and in TOML: scale_down_nodes)."""

    scale_down_nodes: list[int] = field(default_factory=list)
    """Node counts the deployment declares it may be scaled down to (elastic EP), e.g.
    [7] for "down to 7 of 8 nodes": a survivor placement is planned for each, beside the
    single rank and node losses. The nodes that go are the highest-numbered ones (ranks
    numbered node by node, so the tail ranks: what vLLM's elastic scale-down removes by
    default). Each an integer from 1 to the deployment's nodes less one; set on a
    deployment (`rebalancer admin policy DEP scale_down_nodes=6,7`), a count its shape
    cannot take is refused; in TOML's [policy] (the default of new deployments), such a
    count is left out for that deployment (`scale_downs`)."""

    def validate(self) -> None:
        check_scale_down_nodes(self.scale_down_nodes)


def check_scale_down_nodes(counts: object, num_nodes: int | None = None) -> list[int]:
    """The declared node counts, checked: a list of distinct integers >= 1, and below
    `num_nodes` when given (a deployment's shape). InputError naming the bad one."""
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence):
        raise InputError(f"policy scale_down_nodes must be a list of node counts, got {counts!r}")
    out: list[int] = []
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
            raise InputError(f"policy scale_down_nodes: {count!r} is not a whole number of nodes")
        if count < 1:
            raise InputError(
                f"policy scale_down_nodes: {count} nodes: a deployment scales down "
                "to 1 node at least"
            )
        if num_nodes is not None and count >= num_nodes:
            raise InputError(
                f"policy scale_down_nodes: {count} nodes is no scale-down of a deployment of "
                f"{num_nodes} node{'s' if num_nodes != 1 else ''} (at most {num_nodes - 1})"
            )
        if count in out:
            raise InputError(f"policy scale_down_nodes: {count} nodes given twice")
        out.append(int(count))
    return out


def scale_downs(shape: ClusterShape, counts: Sequence[int]) -> list[tuple[int, ...]]:
    """The ranks each declared scale-down removes, largest count first: going down to n
    of N nodes, the ranks of nodes n..N-1 (ranks numbered node by node, G / N to a node).
    A count the shape cannot take (n >= N, or below 1) is left out."""
    G, N = shape.num_gpus, shape.num_nodes
    per_node = G // N
    return [tuple(range(n * per_node, G)) for n in sorted(set(counts), reverse=True) if 1 <= n < N]


@dataclass(frozen=True)
class Loss:
    """One failure planned for: the ranks lost and what their survivors would serve."""

    kind: LossKind
    lost: tuple[int, ...]
    balancedness: float  # on the estimate it was planned on; NaN when infeasible
    slots_moved: int  # slots the survivors must refill
    from_storage: int  # (layer, expert) pairs no survivor holds: weights from storage
    unserved: int  # experts per layer left without a slot (infeasible when > 0)
    phy2log: np.ndarray | None  # [L, P'] the survivors' placement, None when infeasible

    @property
    def feasible(self) -> bool:
        return self.phy2log is not None and self.unserved == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "lost": list(self.lost),
            "balancedness": self.balancedness,
            "slots_moved": self.slots_moved,
            "from_storage": self.from_storage,
            "unserved": self.unserved,
        }


@dataclass(frozen=True)
class Told:
    """One loss of a set as a session's stream carries it (`version`: the placement it
    was planned on, as a plan phase's payload names its version)."""

    version: int
    loss: Loss
    set_size: int


@dataclass(frozen=True)
class ContingencySet:
    """Every single-rank and single-node loss of one deployment, and each scale-down it
    declares, planned on the placement of `base_version` and the estimate of `computed_at`."""

    base_version: int
    computed_at: float
    healthy: float  # the placement in use, balancedness on the same estimate
    losses: tuple[Loss, ...]

    def of(self, kind: LossKind) -> list[Loss]:
        return [loss for loss in self.losses if loss.kind == kind]

    def summary(self) -> dict[str, Any]:
        """Worst and mean balancedness after a loss of each kind (a declared scale-down's
        only when there is one), and the experts a node loss leaves without a slot (what
        metrics and the decision history show)."""
        out: dict[str, Any] = {"base_version": self.base_version, "healthy": self.healthy}
        for kind in ("rank", "node"):
            # a loss no placement can serve counts as 0: part of the model is not served
            values = [loss.balancedness if loss.feasible else 0.0 for loss in self.of(kind)]  # type: ignore[arg-type]
            out[f"{kind}_worst"] = min(values) if values else float("nan")
            out[f"{kind}_mean"] = float(np.mean(values)) if values else float("nan")
        out["node_unserved"] = max((loss.unserved for loss in self.of("node")), default=0)
        downs = [loss.balancedness if loss.feasible else 0.0 for loss in self.of("scale_down")]
        if downs:  # only where the deployment declares scale-downs: older records lack them
            out["scale_down_worst"], out["scale_down_mean"] = min(downs), float(np.mean(downs))
        return out


def to_record(made: ContingencySet) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A set as the store keeps it: a JSON record and the survivors' placements."""
    return _record(made), _arrays(made.losses)


def _record(made: ContingencySet) -> dict[str, Any]:
    return {
        "base_version": made.base_version,
        "computed_at": made.computed_at,
        "healthy": made.healthy,
        "losses": [loss.to_dict() for loss in made.losses],
    }


def _arrays(losses: Sequence[Loss]) -> dict[str, np.ndarray]:
    return {
        f"loss{i}": loss.phy2log.astype(np.int32)
        for i, loss in enumerate(losses)
        if loss.phy2log is not None
    }


def _told(version: int, losses: Sequence[Loss]) -> list[Told]:
    """One Told per loss for every session: its message is encoded once (service.py)."""
    return [Told(version, loss, len(losses)) for loss in losses]


def from_record(record: dict[str, Any], arrays: dict[str, np.ndarray]) -> ContingencySet:
    losses = tuple(
        Loss(
            d["kind"],
            tuple(d["lost"]),
            float(d["balancedness"]),
            int(d["slots_moved"]),
            int(d["from_storage"]),
            int(d["unserved"]),
            arrays[f"loss{i}"].astype(np.int64) if f"loss{i}" in arrays else None,
        )
        for i, d in enumerate(record["losses"])
    )
    return ContingencySet(
        int(record["base_version"]), float(record["computed_at"]), float(record["healthy"]), losses
    )


def failure_domains(
    shape: ClusterShape, scale_down_nodes: Sequence[int] = ()
) -> list[tuple[LossKind, tuple[int, ...]]]:
    """Every single rank, every single node when there are several (ranks numbered node
    by node, G / N to a node), then each declared scale-down's tail ranks (`scale_downs`)."""
    G, N = shape.num_gpus, shape.num_nodes
    out: list[tuple[LossKind, tuple[int, ...]]] = (
        [("rank", (g,)) for g in range(G)] if G > 1 else []
    )
    if N > 1:
        per_node = G // N
        out += [("node", tuple(range(n * per_node, (n + 1) * per_node))) for n in range(N)]
    out += [("scale_down", lost) for lost in scale_downs(shape, scale_down_nodes)]
    return out


def plan_losses(
    load: np.ndarray, phy2log: np.ndarray, shape: ClusterShape, scale_down_nodes: Sequence[int] = ()
) -> list[Loss]:
    """The survivor placement of every failure domain (decision worker; pure). Going down
    to N - 1 nodes loses the same ranks as the last node's loss: planned once, listed as both.

    load: [L, E] the estimate, phy2log: [L, P] the committed placement."""
    domains = failure_domains(shape, scale_down_nodes)
    unique = list(dict.fromkeys(lost for _, lost in domains))
    plans = dict(
        zip(unique, survivor_placements(load, phy2log, shape.num_gpus, unique), strict=True)
    )
    return [
        Loss(
            kind,
            lost,
            plans[lost].balancedness,
            plans[lost].slots_moved,
            plans[lost].from_storage,
            plans[lost].unserved,
            plans[lost].phy2log,
        )
        for kind, lost in domains
    ]


def _plan(
    load: np.ndarray, phy2log: np.ndarray, shape: ClusterShape, scale_down_nodes: Sequence[int] = ()
) -> tuple[float, list[Loss]]:
    """The decision worker's job: the placement in use on `load`, and every loss planned."""
    return balancedness(phy2log, load, shape.num_gpus), plan_losses(
        load, phy2log, shape, scale_down_nodes
    )


def load_shift(a: np.ndarray, b: np.ndarray) -> float:
    """The share of load that moved between experts from `a` to `b` (both [L, E]),
    averaged over the layers with load in both; 1.0 when either has none."""
    sa, sb = a.sum(axis=1, keepdims=True), b.sum(axis=1, keepdims=True)
    both = (sa[:, 0] > 0) & (sb[:, 0] > 0)
    if not both.any():
        return 1.0
    na, nb = a[both] / sa[both], b[both] / sb[both]
    return float(0.5 * np.abs(na - nb).sum(axis=1).mean())


Submit = Callable[[Callable[[], Any], Callable[[Any], None]], None]


class SharedLoad(Protocol):
    """A replica pool as the planner reads it (replica_pools/replica_pool.py): the members
    that follow it serve one load, so the members serving one placement share one set."""

    @property
    def key(self) -> str: ...

    members: set[str]

    def estimate(self) -> np.ndarray: ...


# (deployment) -> the pool whose members share its sets: its pool, when it follows it
# (`Fleet.sharing_pool`); None: a set of its own.
SharingPool = Callable[["Deployment"], SharedLoad | None]


# A pool's set: (pool key, the placement's digest, the scale-downs its members declare).
PoolSetKey = tuple[str, int, tuple[tuple[int, ...], ...]]


@dataclass(frozen=True)
class _PoolSet:
    """A set planned once for the members of a pool serving one placement (the members
    rolled to the pool placement, or not yet: each a set), on the pool's estimate
    (`planned_on`); each member takes it under its own version. `generation` tells one
    such set from the one before."""

    computed_at: float
    healthy: float
    losses: tuple[Loss, ...]
    planned_on: np.ndarray
    generation: int
    packed: PackedArrays  # the survivors' placements, stored once for the members' rows
    # The messages of the set per member version, made once for the members at that
    # version (their encoding is cached by message: service.py).
    told: dict[int, list[Told]] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """What one member's take moves: its ranks' messages (the arrays are stored once
        for every member, their rows name them)."""
        return len(self.packed.blob)

    def told_at(self, version: int) -> list[Told]:
        if version not in self.told:
            self.told[version] = _told(version, self.losses)
        return self.told[version]


class ContingencyPlanner:
    """The contingency sets of every deployment (module docstring).

    The members of a replica pool that follow it and serve one placement share one set,
    planned once on the pool's estimate (`sharing_pool`): a fleet of pools of 8 plans an
    eighth of the sets (each a few policy decisions of the worker's time)."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        submit: Submit,
        has_room: Callable[[], bool],
        sharing_pool: SharingPool | None = None,
        take_bytes_per_second: float = TAKE_BYTES_PER_SECOND,
    ) -> None:
        self.store = store
        self.clock = clock
        self.submit = submit
        self.has_room = has_room  # the decision worker idle: policy decisions keep their room
        self.sharing_pool = sharing_pool
        self.sets: dict[str, ContingencySet] = {}
        self._planned_on: dict[str, np.ndarray] = {}  # the estimate each set was planned on
        self._asked: dict[str, float] = {}  # when a set was last asked for or looked at
        self._running: set[str] = set()
        # Pool sets; per member, (its version, its placement's digest) and the generation
        # of the pool set it holds.
        self._pool_sets: dict[PoolSetKey, _PoolSet] = {}
        self._pool_running: set[PoolSetKey] = set()
        self._pool_asked: dict[PoolSetKey, float] = {}
        self._digests: dict[str, tuple[int, int]] = {}
        self._taken: dict[str, int] = {}
        self._generations = 0
        self.take_bytes_per_second = take_bytes_per_second
        self._take_credit = 0.0  # bytes the members may take now (up to a second's worth)
        self._take_at = -np.inf
        # The members whose stored rows name each shared arrays' digest, and the reverse.
        self._named: dict[str, set[str]] = {}
        self._shared_of: dict[str, str] = {}  # member -> digest its row names

    def load(self, names: list[str]) -> None:
        """The stored sets, at start."""
        self._shared_of = self.store.shared_contingency()
        for name, digest in self._shared_of.items():
            self._named.setdefault(digest, set()).add(name)
        for name in names:
            stored = self.store.contingency(name)
            if stored is not None:
                self.sets[name] = from_record(*stored)

    def get(self, name: str) -> ContingencySet | None:
        return self.sets.get(name)

    def tell(self, dep: Deployment, sessions: list[Session] | None = None) -> None:
        """Send the deployment's set to `sessions` (default: every one with a stream), one
        message per loss: ranks keep it to act on with the controller gone."""
        made = self.sets.get(dep.name)
        if made is None:
            return
        self._send(dep, _told(made.base_version, made.losses), sessions)

    @staticmethod
    def _send(dep: Deployment, told: list[Told], sessions: list[Session] | None = None) -> None:
        for session in dep.live_sessions() if sessions is None else sessions:
            if session.send is not None:
                for one in told:
                    session.send("planned_loss", one)

    def due(self, dep: Deployment, now: float) -> bool:
        """Whether `dep` needs a new set: none yet, one of another placement or of other
        declared scale-downs, or the estimate moved by REFRESH_SHIFT; never while one is computed,
        never more often than MIN_INTERVAL_SECONDS, and only with counts to plan on and a loss to
        plan for."""
        # Asked at every window a deployment folds: the cheap refusals first. One GPU has no
        # loss to plan for (`failure_domains` is empty exactly then: a node or a scale-down
        # loses some of several GPUs).
        if dep.name in self._running or dep.mixed is not None or dep.shape.num_gpus < 2:
            return False
        declared = dep.policy.contingency.scale_down_nodes
        current = self.sets.get(dep.name)
        stale = (
            current is None
            or current.base_version != dep.version
            or [loss.lost for loss in current.of("scale_down")] != scale_downs(dep.shape, declared)
        )
        if not stale and now - self._asked.get(dep.name, -np.inf) < MIN_INTERVAL_SECONDS:
            return False
        estimate = dep.estimate()
        if estimate.sum() <= 0:
            return False
        planned_on = self._planned_on.get(dep.name)
        if stale or planned_on is None or load_shift(planned_on, estimate) >= REFRESH_SHIFT:
            return True
        self._asked[dep.name] = now  # looked: the next look after the interval, not at every window
        return False

    def refresh(self, dep: Deployment, now: float) -> None:
        """Plan `dep`'s set on the decision worker when due; a pool member serving its
        pool's placement takes the pool's set instead (planned once for the pool)."""
        pool = self.sharing_pool(dep) if self.sharing_pool is not None else None
        if pool is not None:
            self._refresh_member(dep, pool, now)
            return
        if not self.has_room() or not self.due(dep, now):
            return
        estimate = dep.estimate()
        version, phy2log, shape, name = dep.version, dep.phy2log.copy(), dep.shape, dep.name
        declared = list(dep.policy.contingency.scale_down_nodes)
        self._running.add(name)
        self._asked[name] = now

        def done(result: tuple[float, list[Loss]] | None) -> None:
            self._running.discard(name)
            if result is None:
                return
            healthy, losses = result
            self._install(dep, ContingencySet(version, self.clock(), healthy, tuple(losses)))
            self._planned_on[name] = estimate
            self._taken.pop(name, None)

        self.submit(partial(_plan, estimate, phy2log, shape, declared), done)

    def _digest(self, dep: Deployment) -> int:
        """The digest of the placement `dep` serves, computed once per its version."""
        seen = self._digests.get(dep.name)
        if seen is None or seen[0] != dep.version:
            seen = self._digests[dep.name] = (dep.version, placement_digest(dep.phy2log))
        return seen[1]

    def _refresh_member(self, dep: Deployment, pool: SharedLoad, now: float) -> None:
        """A member takes the set of its pool's members serving its placement when it has
        not yet; that set is planned (on the worker, once for all of them) when there is
        none, or the pool's estimate moved by REFRESH_SHIFT."""
        if dep.mixed is not None or dep.shape.num_gpus < 2:
            return
        downs = tuple(scale_downs(dep.shape, dep.policy.contingency.scale_down_nodes))
        key = (pool.key, self._digest(dep), downs)
        shared = self._pool_sets.get(key)
        if shared is not None:
            current = self.sets.get(dep.name)
            if (
                current is None
                or current.base_version != dep.version
                or self._taken.get(dep.name) != shared.generation
            ):
                if not self._may_take(shared.bytes, now):
                    return  # another member's turn first: at its next window
                made = ContingencySet(
                    dep.version, shared.computed_at, shared.healthy, shared.losses
                )
                self._install(dep, made, shared.packed, shared.told_at(dep.version))
                self._planned_on[dep.name] = shared.planned_on
                self._taken[dep.name] = shared.generation
                # Planned on the pool's load: should the member leave the pool, the shift
                # from its own estimate decides at once whether it plans its own.
                self._asked.pop(dep.name, None)
                return
        if key in self._pool_running or not self.has_room():
            return
        if shared is not None and now - self._pool_asked.get(key, -np.inf) < MIN_INTERVAL_SECONDS:
            return
        estimate = pool.estimate()
        if estimate.sum() <= 0:
            return
        if shared is not None and load_shift(shared.planned_on, estimate) < REFRESH_SHIFT:
            self._pool_asked[key] = now  # looked: the next look after the interval
            return
        phy2log = dep.phy2log.copy()
        self._pool_running.add(key)
        self._pool_asked[key] = now

        def done(result: tuple[float, list[Loss]] | None) -> None:
            self._pool_running.discard(key)
            if result is None:
                return
            healthy, losses = result
            self._generations += 1
            # The pool's sets of placements none of its members serves any more go.
            served = {key}
            served |= {
                (pool.key, self._digests[m][1], downs) for m in pool.members if m in self._digests
            }
            for old in [k for k in self._pool_sets if k[0] == pool.key and k not in served]:
                del self._pool_sets[old]
                self._pool_asked.pop(old, None)
            self._pool_sets[key] = _PoolSet(
                self.clock(),
                healthy,
                tuple(losses),
                estimate,
                self._generations,
                pack_arrays(_arrays(losses)),
            )
            # The members take it at their next window each (their store rows spread).

        declared = list(dep.policy.contingency.scale_down_nodes)
        self.submit(partial(_plan, estimate, phy2log, dep.shape, declared), done)

    def _names(self, name: str, digest: str | None) -> None:
        """`name`'s stored row names the shared arrays `digest` now (None: its own)."""
        old = self._shared_of.pop(name, None)
        if digest is not None:
            self._shared_of[name] = digest
            self._named.setdefault(digest, set()).add(name)
        if old is not None and old != digest:
            named = self._named.get(old, set())
            named.discard(name)
            if not named:  # no row names them: they go (a later take stores them again)
                self._named.pop(old, None)
                self.store.drop_contingency_arrays(old)

    def _may_take(self, size: int, now: float) -> bool:
        """Spend `size` bytes of the members' take budget (TAKE_BYTES_PER_SECOND), when
        there is that much; a set larger than a second's worth goes once the budget is full."""
        rate = self.take_bytes_per_second
        self._take_credit = min(rate, self._take_credit + (now - self._take_at) * rate)
        self._take_at = now
        if self._take_credit < min(size, rate):
            return False
        self._take_credit -= size
        return True

    def _install(
        self,
        dep: Deployment,
        made: ContingencySet,
        packed: PackedArrays | None = None,
        told: list[Told] | None = None,
    ) -> None:
        """`made` is `dep`'s set now: told to its ranks, stored, logged. `packed` and
        `told`: its arrays and messages made once for a pool's members."""
        name, version = dep.name, made.base_version
        self.sets[name] = made
        self._send(dep, _told(version, made.losses) if told is None else told)
        summary = made.summary()
        try:
            arrays = _arrays(made.losses) if packed is None else packed
            self.store.save_contingency(name, _record(made), arrays)
            self.store.record_contingency(name, made.computed_at, summary)
        except Exception as exc:  # noqa: BLE001 - a full disk must not lose the set in memory
            log.error("%s: the store refused the contingency set (%s)", name, exc)
        else:
            self._names(name, None if packed is None else packed.digest)
        if summary["node_unserved"]:
            log.warning(
                "%s: a node loss would leave %d experts per layer without a slot (v%d)",
                name,
                summary["node_unserved"],
                version,
            )
        log.info(
            "%s: contingency set on v%d: rank loss worst %.3f, node loss worst %.3f",
            name,
            version,
            summary["rank_worst"],
            summary["node_worst"],
        )
