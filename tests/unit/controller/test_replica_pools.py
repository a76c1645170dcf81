"""Replica pools on the real Controller (SQLite store, decisions inline): membership
checks that change nothing when refused, one decision per pool rolled out with a cap on
members moving, the warm start offered to a fresh member and adopted on its ranks'
confirmation, membership kept across a restart, divergence."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rebalancer.controller.contingency import TAKE_BYTES_PER_SECOND, from_record
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.replica_pools import (
    OFFER_GRACE_SECONDS,
    DivergenceConfig,
    excess_tv,
    sampling_tv,
)
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=2, num_logical=8, num_slots=8, num_gpus=2, expert_bytes=10)
POLICY = PolicyConfig(min_windows=1, min_interval_seconds=0.0, decision_period_seconds=1e-9)
RNG = np.random.default_rng(7)
HOT = np.array([[0.40, 0.20, 0.10, 0.10, 0.05, 0.05, 0.05, 0.05]] * 2)  # the pool's traffic
OTHER = HOT[:, ::-1].copy()  # another workload


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def window(p: np.ndarray, tokens: int = 4000) -> np.ndarray:
    return np.stack([RNG.multinomial(tokens, row) for row in p]).astype(np.int64)


class Fleet:
    """A controller and the plan phases each deployment's ranks were sent."""

    def __init__(self, store: Store, clock: Clock, **kwargs: Any) -> None:
        self.ctl = Controller(store, POLICY, clock=clock, **kwargs)
        self.sent: dict[str, list[tuple[str, int]]] = {}
        self.sessions: dict[str, list[str]] = {}

    def join(
        self, name: str, pool: str = "p", shape: ClusterShape = SHAPE, version: int = 0
    ) -> list[Any]:
        offers = []
        for rank in range(shape.num_gpus):
            session, dep = self.ctl.register(
                name, rank, shape, version, None, f"{name}-w{rank}", pool=pool
            )
            offers.append(self.ctl.warm_offer(dep, version))
            self.sessions.setdefault(name, []).append(session.session_id)
            sent = self.sent.setdefault(name, [])

            def send(
                kind: str, plan: Any, sent: list[tuple[str, int]] = sent, rank: int = rank
            ) -> None:
                if rank == 0 and kind != "planned_loss":
                    sent.append((kind, plan.version))

            self.ctl.attach(session.session_id, send)
        return offers

    def feed(self, name: str, seq: int, p: np.ndarray = HOT) -> None:
        dep = self.ctl.deployment(name)
        half = window(p, 2000)
        for rank in range(SHAPE.num_gpus):
            self.ctl.ingest(dep, rank, seq, dep.version, half, None)

    def finish(self, name: str) -> None:
        """Every rank of `name` prepared and committed its plan in flight."""
        dep = self.ctl.deployment(name)
        assert dep.plan is not None
        v = dep.plan.version
        for sid in self.sessions[name]:
            self.ctl.report(sid, v, "prepared")
        for sid in self.sessions[name]:
            self.ctl.report(sid, v, "committed")


def test_a_member_of_another_shape_or_dispatch_mode_is_refused_and_nothing_changes() -> None:
    fleet = Fleet(Store(":memory:"), Clock())
    fleet.join("a")
    other = replace(SHAPE, num_slots=10)
    with pytest.raises(StateError, match="shape field num_slots is 10, the pool's 8") as err:
        fleet.ctl.register("b", 0, other, 0, None, "w", pool="p")
    assert err.value.code == "FAILED_PRECONDITION"
    with pytest.raises(StateError, match="dispatch mode is 'load', the pool's 'split'"):
        fleet.ctl.register("b", 0, replace(SHAPE, dispatch_mode="load"), 0, None, "w", pool="p")
    assert "b" not in fleet.ctl.deployments and fleet.ctl.store.load_deployments()[-1].name == "a"
    assert fleet.ctl.fleet.pools["p"].members == {"a"} and "b" not in fleet.ctl.store.pool_members()
    # A deployment with live sessions cannot move to another pool.
    with pytest.raises(StateError, match="is in pool 'p', this registration names 'q'"):
        fleet.ctl.register("a", 1, SHAPE, 0, None, "w9", pool="q")


def test_one_decision_per_pool_rolled_out_one_member_at_a_time() -> None:
    fleet = Fleet(Store(":memory:"), Clock())
    for name in ("a", "b", "c"):
        fleet.join(name)
    pool = fleet.ctl.fleet.pools["p"]
    for name in ("a", "b", "c"):
        fleet.feed(name, 0)
    assert pool.version == 1 and pool.stats.decisions == 1
    # Only one member moves; the others wait for it.
    moving = [n for n in ("a", "b", "c") if fleet.ctl.deployment(n).plan is not None]
    assert len(moving) == 1 and fleet.sent[moving[0]] == [("prepare", 1)]
    assert all(
        not d.loop.last_decision for d in fleet.ctl.deployments.values()
    )  # no per-member decision
    done = set()
    for _ in range(3):
        (name,) = [n for n in ("a", "b", "c") if fleet.ctl.deployment(n).plan is not None]
        fleet.finish(name)
        done.add(name)
        fleet.ctl.tick()
    assert done == {"a", "b", "c"}
    for name in ("a", "b", "c"):
        dep = fleet.ctl.deployment(name)
        assert dep.version == 1 and np.array_equal(dep.phy2log, pool.phy2log)
        history = fleet.ctl.store.decisions(name, 5)
        assert history[0]["pool"] == "p" and history[0]["plan_version"] == 1


def test_a_fresh_member_is_offered_the_pool_placement_and_adopts_it_when_its_ranks_confirm() -> (
    None
):
    fleet = Fleet(Store(":memory:"), Clock())
    fleet.join("a")
    fleet.feed("a", 0)
    fleet.finish("a")
    pool = fleet.ctl.fleet.pools["p"]
    assert pool.phy2log is not None
    offers = fleet.join("new")
    # Every rank of the deployment is told the same version and placement.
    (w, placement), (w2, placement2) = offers
    assert (
        w == w2 == 1
        and np.array_equal(placement, pool.phy2log)
        and np.array_equal(placement2, placement)
    )
    dep = fleet.ctl.deployment("new")
    assert dep.version == 0 and fleet.ctl.store.plans("new")[0].state == "offered"
    for sid in fleet.sessions["new"]:
        fleet.ctl.report(sid, w, "committed")
    assert dep.version == 1 and np.array_equal(dep.phy2log, pool.phy2log)
    assert fleet.ctl.store.load_deployments()[-1].committed_version == 1
    # Not offered to a member already serving a version, nor to a deployment without a pool.
    assert fleet.ctl.warm_offer(dep, 1) is None
    session, solo = fleet.ctl.register("solo", 0, SHAPE, 0, None, "w")
    assert fleet.ctl.warm_offer(solo, 0) is None


def test_the_offer_is_adopted_when_ranks_register_on_either_side_of_their_switch() -> None:
    """SGLang's ranks register early (for the offer), then again from the adapter: one may
    register serving W (adopted), the next still on v0 with no rank streaming (v0 adopted
    back), before their COMMITTED of W comes. No Commit of W was ever sent to them, and
    W is still adopted: it was offered (CI beside a hog, the SGLang warm start test)."""
    fleet = Fleet(Store(":memory:"), Clock())
    fleet.join("a")
    fleet.feed("a", 0)
    fleet.finish("a")
    ((w, placement), _) = fleet.join("new")
    for sid in fleet.sessions["new"]:
        fleet.ctl.detach(sid)
    dep = fleet.ctl.deployment("new")
    first, _ = fleet.ctl.register("new", 0, SHAPE, w, None, "new-w0b", pool="p")
    assert dep.version == w
    second, _ = fleet.ctl.register("new", 1, SHAPE, 0, None, "new-w1b", pool="p")
    assert dep.version == 0
    for session in (first, second):
        fleet.ctl.report(session.session_id, w, "committed")
    assert dep.version == w and np.array_equal(dep.phy2log, placement)


def test_ranks_that_never_install_the_offer_keep_v0_and_the_next_plan_goes_past_it() -> None:
    clock = Clock()
    fleet = Fleet(Store(":memory:"), clock)
    fleet.join("a")
    fleet.feed("a", 0)
    fleet.finish("a")
    fleet.join("late")
    dep = fleet.ctl.deployment("late")
    assert dep.version == 0
    fleet.ctl.tick()  # its ranks may be installing the offer: no plan from v0 yet
    assert dep.plan is None
    clock.now += OFFER_GRACE_SECONDS
    fleet.ctl.tick()  # they did not: the rolling finds it off the pool placement
    plan = dep.plan
    assert plan is not None and plan.version == 2 and plan.base_version == 0
    assert fleet.sent["late"] == [("prepare", 2)]


def test_membership_and_the_pool_placement_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    clock = Clock()
    fleet = Fleet(Store(path), clock)
    fleet.join("a")
    fleet.join("b")
    fleet.feed("a", 0)
    placement = fleet.ctl.fleet.pools["p"].phy2log
    fleet.ctl.store.close()
    again = Controller(Store(path), POLICY, clock=clock)
    pool = again.fleet.pools["p"]
    assert (
        pool.members == {"a", "b"} and pool.version == 1 and np.array_equal(pool.phy2log, placement)
    )
    assert {m: p.name for m, p in again.fleet.member_of.items()} == {"a": "p", "b": "p"}


def test_a_member_fed_another_workload_is_diverged_balanced_alone_and_rejoins() -> None:
    fleet = Fleet(
        Store(":memory:"), Clock(), divergence=DivergenceConfig(threshold=0.08, windows=3)
    )
    for name in ("a", "b", "c"):
        fleet.join(name)
    pool = fleet.ctl.fleet.pools["p"]
    fleet.ctl.set_paused("a", True)  # no member plans: the test is about the estimate
    for name in ("b", "c"):
        fleet.ctl.set_paused(name, True)
    for seq in range(3):
        fleet.feed("a", seq)
        fleet.feed("b", seq)
    for seq in range(3):
        fleet.feed("c", seq, OTHER)
        assert ("c" in pool.diverged()) == (seq == 2)
        assert pool.following_count() == len(pool.following()) == (2 if seq == 2 else 3)
    windows = pool.loop.estimator.windows
    fleet.feed("c", 3, OTHER)
    assert pool.loop.estimator.windows == windows  # out of the pool estimate
    assert fleet.ctl.deployment("c").loop.estimator.windows == 4  # its own estimate goes on
    assert fleet.ctl.store.decisions("c", 1)[0]["outcome"] == "pool_diverged"
    for seq in range(4, 7):
        fleet.feed("c", seq)
    assert (
        pool.diverged() == [] and fleet.ctl.store.decisions("c", 1)[0]["outcome"] == "pool_rejoined"
    )
    assert pool.following_count() == 3
    # The count of members in the pool estimate follows leaves of either kind.
    for seq in range(7, 10):
        fleet.feed("c", seq, OTHER)
    assert pool.following_count() == 2
    pool.leave("c")  # diverged: the count stays
    pool.leave("b")
    assert pool.following_count() == len(pool.following()) == 1


def test_the_divergence_statistic_is_near_zero_on_sampling_noise_alone() -> None:
    """Same distribution: the excess total variation stays well under the threshold at
    small windows; another workload is far above it."""
    same = [excess_tv(window(HOT, 500), HOT * 1e6) for _ in range(200)]
    assert abs(float(np.mean(same))) < 0.01 and max(same) < 0.08
    assert excess_tv(window(OTHER, 500), HOT) > 0.3
    assert sampling_tv(HOT, np.array([500.0, 500.0])).shape == (2,)


def test_force_names_an_unknown_pool() -> None:
    fleet = Fleet(Store(":memory:"), Clock())
    with pytest.raises(StateError, match="unknown pool 'nope'") as err:
        fleet.ctl.force_pool("nope")
    assert err.value.code == "NOT_FOUND"
    fleet.join("a")
    with pytest.raises(StateError, match="no counts ingested yet for pool 'p'"):
        fleet.ctl.force_pool("p")


def test_no_module_but_the_pools_own_assigns_a_pools_fields() -> None:
    """A pool's state has one owner, `ReplicaPool` (replica_pools/replica_pool.py): every other
    module asks it through its transitions (the rule test_deployment_owns_its_state.py holds for
    deployments)."""
    import ast

    root = Path(__file__).resolve().parents[3] / "rebalancer"
    owner = root / "controller" / "replica_pools" / "replica_pool.py"
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == owner or "v1" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign | ast.Delete)
                else [node.target]
                if isinstance(node, ast.AugAssign | ast.AnnAssign)
                else []
            )
            for target in targets:
                for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                    base = item.value if isinstance(item, ast.Subscript) else item
                    chain = []
                    while isinstance(base, ast.Attribute):
                        chain.append(base.attr)
                        base = base.value
                    if chain and isinstance(base, ast.Name) and base.id in ("pool", "member_pool"):
                        found.append(f"{path.name}:{node.lineno}")
    assert found == []


def test_no_module_but_the_pools_own_calls_through_a_pools_parts() -> None:
    """`pool.loop.force(...)`, `pool.tracks[m]...`: the pool's own verbs do that."""
    from tests.unit.controller.test_deployment_owns_its_state import calls_through_parts

    root = Path(__file__).resolve().parents[3] / "rebalancer"
    owner = root / "controller" / "replica_pools" / "replica_pool.py"
    parts = {"loop", "tracks", "members", "reference", "stats"}
    found = [
        c
        for path in sorted(root.rglob("*.py"))
        if path != owner and "v1" not in path.parts
        for c in calls_through_parts(path, {"pool", "member_pool"}, parts, parts)
    ]
    assert found == []


def test_no_module_but_the_pools_own_reads_through_a_pools_policy_loop() -> None:
    """`pool.loop.last_decision`: the pool tells it (`pool.last_decision`)."""
    from tests.unit.controller.test_deployment_owns_its_state import reads_through_parts

    root = Path(__file__).resolve().parents[3] / "rebalancer"
    owner = root / "controller" / "replica_pools" / "replica_pool.py"
    found = [
        r
        for path in sorted(root.rglob("*.py"))
        if path != owner and "v1" not in path.parts
        for r in reads_through_parts(path, {"pool", "member_pool"})
    ]
    assert found == []


def test_the_statistic_against_the_normalised_reference_is_the_direct_one() -> None:
    """`excess_tv_of` on `expected_of(reference)` (normalised once a round for many tests)
    is the statistic computed straight from the definition, layers without load skipped."""
    from rebalancer.controller.replica_pools.divergence import excess_tv_of, expected_of

    rng = np.random.default_rng(3)
    reference = rng.gamma(1.0, 1.0, (6, 16)) * 1000
    reference[2] = 0.0  # a layer without load in the reference
    window = rng.multinomial(400, np.full(16, 1 / 16), size=6).astype(np.float64)
    window[4] = 0.0  # and one in the window
    layers = [0, 1, 3, 5]
    q = window[layers] / window[layers].sum(axis=1, keepdims=True)
    p = reference[layers] / reference[layers].sum(axis=1, keepdims=True)
    direct = np.mean(0.5 * np.abs(q - p).sum(axis=1) - sampling_tv(p, window[layers].sum(axis=1)))
    assert excess_tv_of(window, expected_of(reference)) == pytest.approx(direct, rel=1e-12)
    assert excess_tv(window, reference) == pytest.approx(direct, rel=1e-12)
    assert np.isnan(excess_tv(np.zeros((6, 16)), reference))
    # every layer loaded on both sides (the usual case, read without masked copies)
    full = rng.gamma(1.0, 1.0, (6, 16)) * 1000
    counts = rng.multinomial(400, np.full(16, 1 / 16), size=6)
    q, p = counts / counts.sum(axis=1, keepdims=True), full / full.sum(axis=1, keepdims=True)
    direct = np.mean(0.5 * np.abs(q - p).sum(axis=1) - sampling_tv(p, counts.sum(axis=1)))
    assert excess_tv_of(counts, expected_of(full)) == pytest.approx(direct, rel=1e-12)


def test_a_tick_yields_after_each_pool_that_started_plans() -> None:
    """The server runs a tick in steps (Controller.tick_steps), letting windows in between:
    a step ends after each pool whose roll-out started plans, and the steps together do
    what one tick does."""
    fleet = Fleet(Store(":memory:"), Clock())
    pools = ("p", "q", "r")
    for pool in pools:
        for member in "ab":
            fleet.join(f"{pool}-{member}", pool=pool)
    for pool in pools:
        for member in "ab":
            fleet.feed(f"{pool}-{member}", 0)

    def moving(pool: str) -> list[str]:
        return [m for m in "ab" if fleet.ctl.deployment(f"{pool}-{m}").plan is not None]

    first = {pool: moving(pool) for pool in pools}
    assert all(len(m) == 1 for m in first.values())  # one member of each pool moves
    for pool in ("p", "q"):  # their movers finish: the other members start at the next tick
        fleet.finish(f"{pool}-{first[pool][0]}")
    assert moving("p") == moving("q") == []
    steps = fleet.ctl.tick_steps()
    next(steps)  # the first pool's start; the server's loop runs other callbacks here
    assert moving("p") == [m for m in "ab" if m not in first["p"]] and moving("q") == []
    assert sum(1 for _ in steps) == 1  # the second pool's start; the third started nothing
    assert moving("q") == [m for m in "ab" if m not in first["q"]]
    assert moving("r") == first["r"]


def test_members_serving_the_pool_placement_share_one_contingency_set() -> None:
    """The members that follow their pool and serve its placement take one contingency set,
    planned once on the decision worker for the pool (on the pool's estimate), each under
    its own version, at most TAKE_BYTES_PER_SECOND of sets a second; a member that
    diverges plans its own on its own estimate."""
    clock = Clock()
    fleet = Fleet(Store(":memory:"), clock, divergence=DivergenceConfig(threshold=0.08, windows=3))
    names = ("a", "b", "c")
    # 4 ranks of 3 slots: a rank's loss leaves a slot for every expert.
    spare = replace(SHAPE, num_slots=12, num_gpus=4)

    def feed(name: str, seq: int, p: np.ndarray = HOT) -> None:
        dep = fleet.ctl.deployment(name)
        for rank in range(spare.num_gpus):
            fleet.ctl.ingest(dep, rank, seq, dep.version, window(p, 1000), None)

    for name in names:
        fleet.join(name, shape=spare)
    pool = fleet.ctl.fleet.pools["p"]
    planner = fleet.ctl.contingency
    # Each set asked of the worker: its estimate and placement, and the pool's and c's
    # estimates then.
    planned: list[tuple[np.ndarray, ...]] = []
    submit = planner.submit

    def counting(fn: Any, done: Any) -> None:
        own = fleet.ctl.deployment("c").estimate()
        planned.append((fn.args[0], fn.args[1], pool.estimate(), own))
        submit(fn, done)

    planner.submit = counting
    for name in names:
        feed(name, 0)
    for name in names:  # still on v0 while the pool placement rolls out: one set for all
        feed(name, 1)
    assert len(planned) == 1 and all(fleet.ctl.deployment(n).version == 0 for n in names)
    v0 = [planner.get(n) for n in names]
    assert all(s is not None and s.base_version == 0 for s in v0)
    assert v0[0].losses is v0[1].losses is v0[2].losses  # type: ignore[union-attr]

    def stored_arrays() -> list[str]:  # the shared sets in the store, by digest
        rows = fleet.ctl.store._db.execute("SELECT digest FROM contingency_arrays")
        return sorted(d for (d,) in rows)

    assert len(stored_arrays()) == 1  # stored once for the three rows
    planned.clear()
    for _ in names:  # the pool placement rolled out, one member at a time
        (moving,) = [n for n in names if fleet.ctl.deployment(n).plan is not None]
        fleet.finish(moving)
        fleet.ctl.tick()
    assert all(np.array_equal(fleet.ctl.deployment(n).phy2log, pool.phy2log) for n in names)
    for name in names:
        fleet.ctl.set_paused(name, True)  # no more plans: the test is about the sets
    planner.take_bytes_per_second = 1.0  # a set in hundreds of seconds: one member takes it
    for seq in (2, 3):
        for name in names:
            feed(name, seq)
    assert [planner.get(n).base_version for n in names].count(1) == 1  # type: ignore[union-attr]
    planner.take_bytes_per_second = TAKE_BYTES_PER_SECOND
    clock.now += 1.0  # a second's worth: the other two take theirs at their next window
    for name in names:
        feed(name, 4)
    assert len(planned) == 1  # one set for the three members
    np.testing.assert_array_equal(planned[0][1], pool.phy2log)
    np.testing.assert_array_equal(planned[0][0], planned[0][2])  # on the pool's estimate
    sets = [planner.get(n) for n in names]
    assert all(s is not None and s.base_version == 1 for s in sets)
    assert sets[0].losses is sets[1].losses is sets[2].losses  # type: ignore[union-attr]
    assert [loss.lost for loss in sets[0].of("rank")] == [(0,), (1,), (2,), (3,)]  # type: ignore[union-attr]
    assert all(loss.feasible for loss in sets[0].losses)  # type: ignore[union-attr]
    # The v0 arrays went with the last row that named them: one stored set, the v1 one.
    taken = [p.packed.digest for p in planner._pool_sets.values() if p.losses is sets[0].losses]  # type: ignore[union-attr]
    assert stored_arrays() == taken
    for name, made in zip(names, sets, strict=True):  # each stored, read back as taken
        stored = fleet.ctl.store.contingency(name)
        assert stored is not None
        back = from_record(*stored)
        assert back.base_version == 1 and back.healthy == made.healthy  # type: ignore[union-attr]
        for a, b in zip(back.losses, made.losses, strict=True):  # type: ignore[union-attr]
            assert (a.kind, a.lost, a.unserved) == (b.kind, b.lost, b.unserved)
            assert (a.phy2log is None) == (b.phy2log is None)
            if a.phy2log is not None:
                np.testing.assert_array_equal(a.phy2log, b.phy2log)
    # A member fed another workload leaves the pool estimate and plans its own set.
    for seq in range(5, 9):
        feed("c", seq, OTHER)
    assert pool.diverged() == ["c"]
    c = planner.get("c")
    assert c is not None and c.losses is not sets[0].losses  # type: ignore[union-attr]
    assert len(planned) == 2
    np.testing.assert_array_equal(planned[1][0], planned[1][3])  # on its own estimate
    np.testing.assert_array_equal(planned[1][1], fleet.ctl.deployment("c").phy2log)
    assert len(stored_arrays()) == 1  # a and b still name the pool's; c's own is its row's
    stored_c = fleet.ctl.store.contingency("c")
    assert stored_c is not None and stored_c[0]["computed_at"] == c.computed_at


def test_at_target_follows_a_replaced_member_or_pool_placement() -> None:
    """`at_target` remembers its answer per member (every tick asks for every member):
    a member's placement replaced, or a new pool placement, is compared afresh."""
    from types import SimpleNamespace

    from rebalancer.controller.replica_pools.replica_pool import ReplicaPool

    pool = ReplicaPool("p", SHAPE, POLICY)
    base = np.tile(np.arange(8), (2, 1))
    member = SimpleNamespace(name="a", phy2log=base.copy())
    assert pool.at_target(member)  # no pool placement yet
    pool.take(base)
    assert pool.at_target(member) and pool.at_target(member)
    pool.take(base[:, ::-1])  # a new pool placement
    assert not pool.at_target(member)
    member.phy2log = base[:, ::-1].copy()  # the member committed it
    assert pool.at_target(member)
    member.phy2log = base.copy()  # served mixed, or back on the one before
    assert not pool.at_target(member)
    pool.restore(pool.version, base.copy())  # read back after a restart
    assert pool.at_target(member)
    pool.leave("a")
    assert "a" not in pool._at_target
