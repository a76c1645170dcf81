"""The regimes policy (controller/regimes.py): regimes told apart by what placement cares
about, a returning regime recognised within a window and decided on with its ready
placement, a drift forecast, a max-min placement for regimes that alternate fast, the
library in the store across a controller restart, and the default policy unchanged."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from rebalancer.controller.decide import PolicyConfig, decide
from rebalancer.controller.policy_loop import PolicyLoop
from rebalancer.controller.regimes import (
    RegimeConfig,
    RegimeLibrary,
    balance,
    decide_regimes,
    distances,
    fit,
    forecast,
    maxmin_placement,
    observe,
    share_distance,
    shares,
)
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.errors import InputError
from rebalancer.placement import trivial_placement
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=3, num_logical=16, num_slots=24, num_gpus=4, expert_bytes=10)
TOKENS = 200_000


def _regime_load(seed: int) -> np.ndarray:
    """A skewed per-layer distribution [L, E]: a few hot experts, different per seed."""
    rng = np.random.default_rng(seed)
    p = rng.pareto(1.2, size=(SHAPE.num_layers, SHAPE.num_logical)) + 0.05
    return p / p.sum(axis=1, keepdims=True)


A, B, C = _regime_load(1), _regime_load(2), _regime_load(3)


def _window(dist: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.stack([rng.multinomial(TOKENS, row) for row in dist]).astype(np.float64)


def test_windows_of_one_load_join_one_regime_another_load_starts_its_own() -> None:
    rng = np.random.default_rng(0)
    lib = RegimeLibrary()
    config = RegimeConfig()
    ids = [observe(lib, _window(A, rng), float(t), SHAPE, config).regime for t in range(5)]
    assert len(set(ids)) == 1 and len(lib.regimes) == 1
    first = observe(lib, _window(B, rng), 5.0, SHAPE, config)
    assert first.new and first.regime != ids[0] and len(lib.regimes) == 2
    # The distance is the balancedness a regime's fit loses: small on its own load, large elsewhere.
    d = distances(lib, shares(_window(A, rng)), SHAPE.num_gpus)
    assert d[0] <= config.match_distance < d[1]
    back = observe(lib, _window(A, rng), 6.0, SHAPE, config)
    assert back.regime == ids[0] and back.returned and not back.new
    assert lib.get(ids[0]).visits == 2  # type: ignore[union-attr]


def test_a_full_library_evicts_the_least_seen_regime_never_the_current() -> None:
    rng = np.random.default_rng(1)
    lib = RegimeLibrary()
    config = RegimeConfig(capacity=2)
    for t in range(3):
        observe(lib, _window(A, rng), float(t), SHAPE, config)
    a = lib.current
    b = observe(lib, _window(B, rng), 3.0, SHAPE, config).regime
    c = observe(lib, _window(C, rng), 4.0, SHAPE, config).regime  # B is current: A goes
    assert {r.id for r in lib.regimes} == {b, c}
    observe(lib, _window(B, rng), 5.0, SHAPE, config)
    d = observe(lib, _window(A, rng), 6.0, SHAPE, config).regime  # C: the least seen
    assert {r.id for r in lib.regimes} == {b, d} and d not in (a, c)


def test_the_forecast_follows_a_linear_drift_closer_than_the_last_window() -> None:
    lib = RegimeLibrary()
    config = RegimeConfig(match_distance=1.0)  # one regime: the drift alone
    steps = 12
    for t in range(steps):
        observe(lib, ((1 - t / 40) * A + (t / 40) * B) * TOKENS, float(t), SHAPE, config)
    nxt = (1 - steps / 40) * A + (steps / 40) * B
    last = (1 - (steps - 1) / 40) * A + ((steps - 1) / 40) * B
    assert share_distance(forecast(lib, config), nxt) < 0.5 * share_distance(last, nxt)


def test_a_decision_on_the_forecast_fits_the_load_its_horizon_ahead() -> None:
    """`forecast_horizon_windows`: on a drift, the decision fits the forecast that many
    windows ahead, so its placement serves the later load better than a fit a window ahead."""
    policy = PolicyConfig(min_interval_seconds=0.0, max_moved_fraction=1.0)
    start = trivial_placement(SHAPE.num_layers, SHAPE.num_logical, SHAPE.num_slots, SHAPE.num_gpus)
    steps, ahead = 12, 8

    def drift(t: float) -> np.ndarray:
        return (1 - t / 24) * A + (t / 24) * B

    placed = {}
    for horizon in (1.0, float(ahead)):
        config = RegimeConfig(match_distance=1.0, forecast_horizon_windows=horizon)
        lib = RegimeLibrary()
        for t in range(steps - 1):
            observe(lib, drift(t) * TOKENS, float(t), SHAPE, config)
        counts = drift(steps - 1) * TOKENS
        d = decide_regimes(
            lib,
            [(counts, float(steps - 1))],
            counts,
            start,
            SHAPE,
            policy,
            now=float(steps - 1),
            last_rebalance=None,
            windows=100,
            config=config,
        )
        assert d.load.startswith("forecast") and d.take and d.candidate is not None
        placed[horizon] = d.candidate
    later, nxt = drift(steps - 1 + ahead), drift(steps)
    near, far = placed[1.0], placed[float(ahead)]
    assert balance(far, later, SHAPE.num_gpus) > balance(near, later, SHAPE.num_gpus) + 0.01
    assert balance(near, nxt, SHAPE.num_gpus) > balance(far, nxt, SHAPE.num_gpus)


def test_the_maxmin_placement_is_no_worse_in_its_worst_case_than_each_regimes_own_fit() -> None:
    loads = np.stack([A, B])
    placement, worst = maxmin_placement(loads, SHAPE, rounds=4)
    assert worst == pytest.approx(min(balance(placement, x, SHAPE.num_gpus) for x in loads))
    for own in (fit(A, SHAPE), fit(B, SHAPE)):
        assert worst >= min(balance(own, x, SHAPE.num_gpus) for x in loads) - 1e-9


def _drive(
    lib: RegimeLibrary,
    current: np.ndarray,
    dist: np.ndarray,
    windows: int,
    t0: float,
    rng: np.random.Generator,
    policy: PolicyConfig,
) -> tuple[np.ndarray, list]:
    """Decide after every window, taking every plan at once; (placement, decisions)."""
    decisions = []
    for t in range(windows):
        counts = _window(dist, rng)
        d = decide_regimes(
            lib,
            [(counts, t0 + t)],
            counts,
            current,
            SHAPE,
            policy,
            now=t0 + t,
            last_rebalance=None,
            windows=100,
        )
        decisions.append(d)
        if d.take and d.candidate is not None:
            current = d.candidate
    return current, decisions


def test_a_returning_regime_is_recognised_in_one_window_and_decided_on_its_ready_placement() -> (
    None
):
    rng = np.random.default_rng(2)
    policy = PolicyConfig(min_interval_seconds=0.0, max_moved_fraction=0.2)
    lib = RegimeLibrary()
    start = trivial_placement(SHAPE.num_layers, SHAPE.num_logical, SHAPE.num_slots, SHAPE.num_gpus)
    current, _ = _drive(lib, start, A, 8, 0.0, rng, policy)
    regime_a = lib.current
    served_a = current
    current, _ = _drive(lib, current, B, 8, 8.0, rng, policy)
    assert lib.current != regime_a
    counts = _window(A, rng)
    d = decide_regimes(
        lib,
        [(counts, 16.0)],
        counts,
        current,
        SHAPE,
        policy,
        now=16.0,
        last_rebalance=None,
        windows=100,
    )
    assert lib.current == regime_a
    assert f"regime {regime_a} recognised" in d.load
    assert d.take and d.candidate is not None
    # The candidate serves A at least as well as the placement A had when it left.
    assert balance(d.candidate, A, SHAPE.num_gpus) >= balance(served_a, A, SHAPE.num_gpus) - 0.01
    assert balance(d.candidate, A, SHAPE.num_gpus) > balance(current, A, SHAPE.num_gpus) + 0.02
    assert d.to_dict()["load"] == d.load and "state" not in d.to_dict()


def test_regimes_that_alternate_fast_get_one_placement_for_all() -> None:
    rng = np.random.default_rng(3)
    policy = PolicyConfig(min_interval_seconds=0.0)
    config = RegimeConfig(known_windows=2, fast_run_windows=3.0)
    lib = RegimeLibrary()
    current = trivial_placement(
        SHAPE.num_layers, SHAPE.num_logical, SHAPE.num_slots, SHAPE.num_gpus
    )
    loads = []
    for t in range(24):
        counts = _window(A if (t // 2) % 2 == 0 else B, rng)
        d = decide_regimes(
            lib,
            [(counts, float(t))],
            counts,
            current,
            SHAPE,
            policy,
            now=float(t),
            last_rebalance=None,
            windows=100,
            config=config,
        )
        loads.append(d.load)
        if d.take and d.candidate is not None:
            current = d.candidate
    assert any(load.startswith("alternation") for load in loads[-8:])
    # What serves at the end is good for both, not fitted to one of them.
    worst = min(balance(current, x, SHAPE.num_gpus) for x in (A, B))
    assert worst >= min(balance(fit(A, SHAPE), x, SHAPE.num_gpus) for x in (A, B)) - 0.01


def test_the_library_round_trips_through_the_store(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    lib = RegimeLibrary()
    for t, dist in enumerate([A, A, A, B, B, A]):
        observe(lib, _window(dist, rng), float(t), SHAPE, RegimeConfig())
    lib.regimes[0].ready = fit(A, SHAPE)
    store = Store(tmp_path / "s.sqlite")
    header, rows, removed = lib.changes()
    assert set(rows) == {r.id for r in lib.regimes} and removed == []  # nothing stored yet
    store.save_regimes("d", header, rows, removed)
    lib.mark_saved()
    observe(lib, _window(A, rng), 7.0, SHAPE, RegimeConfig())
    header, rows, removed = lib.changes()
    assert set(rows) == {lib.current}  # only the regime that took the window is written again
    store.save_regimes("d", header, rows, removed)
    store.close()
    saved = Store(tmp_path / "s.sqlite").regimes("d")
    assert saved is not None
    back = RegimeLibrary.from_rows(*saved)
    assert RegimeLibrary.from_record(*lib.to_record()).summary() == lib.summary()
    assert back.summary() == lib.summary()
    for old, new in zip(lib.regimes, back.regimes, strict=True):
        np.testing.assert_array_equal(old.total, new.total)
        np.testing.assert_array_equal(old.fit, new.fit)
    np.testing.assert_array_equal(back.regimes[0].ready, lib.regimes[0].ready)
    assert back.jumps == lib.jumps and back.recent == lib.recent


def _feed(
    ctl: Controller,
    clock: list[float],
    dist: np.ndarray,
    windows: int,
    seq0: int,
    rng: np.random.Generator,
) -> None:
    dep = ctl.deployment("d")
    for seq in range(seq0, seq0 + windows):
        clock[0] += 1.0
        counts = _window(dist, rng) / SHAPE.num_gpus
        for rank in range(SHAPE.num_gpus):
            ctl.ingest(dep, rank, seq, dep.version, np.round(counts), None)


def test_a_restarted_controller_recognises_a_regime_learned_before_the_restart(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(5)
    db = tmp_path / "c.sqlite"
    clock = [100.0]
    policy = PolicyConfig(regimes=True, min_windows=1)
    ctl = Controller(Store(db), policy, clock=lambda: clock[0])
    for rank in range(SHAPE.num_gpus):  # registered, no streams: plans are skipped, decisions run
        ctl.register("d", rank, SHAPE, 0, None, f"w{rank}")
    _feed(ctl, clock, A, 6, 0, rng)
    library = ctl.deployment("d").loop.regimes
    assert library is not None and len(library.regimes) == 1
    regime_a = library.current
    _feed(ctl, clock, B, 6, 6, rng)
    assert ctl.deployment("d").loop.regimes.current != regime_a  # type: ignore[union-attr]
    ctl.persist_all()
    ctl.store.close()

    again = Controller(Store(db), PolicyConfig(), clock=lambda: clock[0])
    dep = again.deployment("d")
    assert dep.policy.regimes  # the opt-in is stored with the deployment
    restored = dep.loop.regimes
    assert restored is not None and {r.id for r in restored.regimes} >= {regime_a}
    for rank in range(SHAPE.num_gpus):
        again.register("d", rank, SHAPE, 0, None, f"w{rank}")
    _feed(again, clock, A, 1, 12, rng)
    decision = dep.loop.last_decision
    assert decision is not None and f"regime {regime_a} recognised" in decision.load
    assert again.store.decisions("d", 1)[0]["load"] == decision.load
    again.store.close()


def test_the_default_policy_keeps_no_library_and_records_what_it_always_did() -> None:
    loop = PolicyLoop(SHAPE, PolicyConfig())
    assert loop.regimes is None
    rng = np.random.default_rng(6)
    for t in range(3):
        loop.on_window(_window(A, rng), trivial_placement(3, 16, 24, 4), now=float(t))
    assert loop.regimes is None and loop.last_decision is not None
    assert "load" not in loop.last_decision.to_dict()
    assert "regimes" not in PolicyConfig().to_stored()
    same = decide(
        _window(A, rng), trivial_placement(3, 16, 24, 4), SHAPE, PolicyConfig(), 0.0, None, 5
    )
    assert same.load == "" and same.state is None


@pytest.mark.parametrize(
    "bad",
    [
        {"match_distance": -0.1},
        {"capacity": 0},
        {"forecast_slow": 0.1},
        {"gain_threshold": float("nan")},
        {"known_windows": True},
        {"forecast_horizon_windows": 0.5},
        {"hedge_jumps": 1},
    ],
)
def test_a_bad_regime_setting_is_refused_naming_it(bad: dict) -> None:
    with pytest.raises(InputError, match=next(iter(bad))):
        dataclasses.replace(RegimeConfig(), **bad).validate()


def test_a_bad_regimes_policy_value_is_refused() -> None:
    with pytest.raises(InputError, match="regimes must be a boolean"):
        PolicyConfig.from_dict({"regimes": "yes"})


def test_an_evicted_regime_leaves_the_store_with_the_next_save(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    lib = RegimeLibrary()
    config = RegimeConfig(capacity=2)
    store = Store(tmp_path / "s.sqlite")
    for t, dist in enumerate([A, A, B]):
        observe(lib, _window(dist, rng), float(t), SHAPE, config)
    store.save_regimes("d", *lib.changes())
    lib.mark_saved()
    gone = lib.regimes[0].id  # A: B is current when C comes
    observe(lib, _window(C, rng), 3.0, SHAPE, config)
    assert lib.evicted == [gone]
    store.save_regimes("d", *lib.changes())
    lib.mark_saved()
    saved = store.regimes("d")
    assert (
        saved is not None and set(saved[2]) == {r.id for r in lib.regimes} and gone not in saved[2]
    )
    assert RegimeLibrary.from_rows(*saved).summary() == lib.summary()
    store.close()


def test_a_pools_library_survives_a_restart_and_warms_a_new_member(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    db = tmp_path / "c.sqlite"
    clock = [100.0]
    ctl = Controller(Store(db), PolicyConfig(regimes=True, min_windows=1), clock=lambda: clock[0])
    for name in ("a", "b"):
        for rank in range(SHAPE.num_gpus):
            ctl.register(name, rank, SHAPE, 0, None, f"{name}{rank}", pool="p")
    for seq in range(4):  # one load: a sudden switch makes the members diverge from the pool
        clock[0] += 1.0
        counts = np.round(_window(A, rng) / (2 * SHAPE.num_gpus))
        for name in ("a", "b"):
            dep = ctl.deployment(name)
            for rank in range(SHAPE.num_gpus):
                ctl.ingest(dep, rank, seq, dep.version, counts, None)
    learned = ctl.fleet.pool("p").loop.regimes
    assert learned is not None and len(learned.regimes) == 1 and learned.windows >= 3
    ids = {r.id for r in learned.regimes}
    ctl.persist_all()
    ctl.store.close()

    again = Controller(Store(db), PolicyConfig(regimes=True, min_windows=1), clock=lambda: clock[0])
    restored = again.fleet.pool("p").loop.regimes
    assert restored is not None and {r.id for r in restored.regimes} == ids
    assert again.deployment("a").loop.regimes is not None  # each member's own, stored too
    for rank in range(SHAPE.num_gpus):
        again.register("c", rank, SHAPE, 0, None, f"c{rank}", pool="p")
    warm = again.deployment("c").loop.regimes
    assert warm is not None and {r.id for r in warm.regimes} == ids and warm is not restored
    again.store.close()


def test_a_trivial_placement_is_left_after_one_window_a_small_gain_waits_for_min_windows() -> None:
    rng = np.random.default_rng(8)
    policy = PolicyConfig(min_interval_seconds=0.0)  # min_windows 2
    trivial = trivial_placement(
        SHAPE.num_layers, SHAPE.num_logical, SHAPE.num_slots, SHAPE.num_gpus
    )
    counts = _window(A, rng)

    def first(current: np.ndarray, config: RegimeConfig) -> object:
        return decide_regimes(
            RegimeLibrary(),
            [(counts, 0.0)],
            counts,
            current,
            SHAPE,
            policy,
            now=0.0,
            last_rebalance=None,
            windows=1,
            config=config,
        )

    d = first(trivial, RegimeConfig())
    assert d.take and d.balancedness_candidate - d.balancedness_current >= RegimeConfig().sure_gain
    # Off, or a placement already near the load's: the policy's min_windows holds.
    assert first(trivial, RegimeConfig(sure_gain=0.0)).outcome == "skip_min_windows"
    near = fit(0.6 * A + 0.4 * B, SHAPE)
    assert first(near, RegimeConfig()).outcome == "skip_min_windows"


def test_plans_only_the_smaller_hysteresis_takes_stay_within_their_share_of_the_slots() -> None:
    # The policy's own threshold is out of reach, so the refinement of regime A's
    # placement (gain about 0.06) is an extra plan, taken by the regime's smaller one.
    policy = PolicyConfig(min_interval_seconds=0.0, gain_threshold=0.3)
    config = RegimeConfig(extra_slots_share=0.15)

    def drive(slots_main: int) -> tuple[RegimeLibrary, list]:
        rng = np.random.default_rng(7)
        lib = RegimeLibrary(slots_main=slots_main)
        current = fit(0.6 * A + 0.4 * B, SHAPE)
        decisions = []
        for t in range(8):
            counts = _window(A, rng)
            d = decide_regimes(
                lib,
                [(counts, float(t))],
                counts,
                current,
                SHAPE,
                policy,
                now=float(t),
                last_rebalance=None,
                windows=100,
                config=config,
            )
            decisions.append(d)
            if d.take and d.candidate is not None:
                current = d.candidate
        return lib, decisions

    lib, decisions = drive(slots_main=0)  # no main plan yet: no extra slots to spend
    assert not any(d.take for d in decisions) and lib.slots_extra == 0
    assert any("extra slots spent" in d.reason for d in decisions)
    lib, decisions = drive(slots_main=1000)
    taken = [d for d in decisions if d.take]
    assert taken and lib.slots_extra == sum(d.slots_moved for d in taken)
    assert lib.slots_main == 1000 and lib.slots_extra <= config.extra_slots_share * 1000
    # The tally survives the store.
    back = RegimeLibrary.from_record(*lib.to_record())
    assert (back.slots_main, back.slots_extra) == (lib.slots_main, lib.slots_extra)


def test_a_jump_to_a_load_never_seen_is_hedged_once_such_a_load_went_back() -> None:
    """`hedge_jumps`: a burst (4 experts 6 times hotter for a window) is a jump to a new
    regime. Once an earlier burst went back, the plan serves the burst far better than the
    placement before it, and serves the load the burst goes back to better than a fit to
    the burst window alone; before any load went back (a phase change), it is that fit."""
    shape = ClusterShape(num_layers=3, num_logical=64, num_slots=72, num_gpus=8, expert_bytes=10)
    rng = np.random.default_rng(2)
    base = rng.dirichlet(np.full(64, 2.0), size=3)

    def hot(experts: np.ndarray) -> np.ndarray:
        h = base.copy()
        h[:, experts] *= 6.0
        return h / h.sum(axis=1, keepdims=True)

    def window(dist: np.ndarray) -> np.ndarray:
        return np.stack([rng.multinomial(400_000, row) for row in dist]).astype(np.float64)

    burst = hot(rng.permutation(64)[:4])
    earlier = [window(base) for _ in range(4)] + [window(hot(rng.permutation(64)[:4]))]
    earlier += [window(base) for _ in range(2)]  # the earlier burst went back
    counts = window(burst)
    current = fit(base, shape)
    placed = {}
    for hedge, before in ((True, earlier), (False, earlier), (None, earlier[:4])):
        config = RegimeConfig(hedge_jumps=hedge is not False)
        lib = RegimeLibrary()
        for t, w in enumerate(before):
            observe(lib, w, float(t), shape, config)
        assert lib.went_back == (1 if len(before) > 4 else 0)
        d = decide_regimes(
            lib,
            [(counts, 10.0)],
            counts,
            current,
            shape,
            PolicyConfig(min_interval_seconds=0.0),
            now=10.0,
            last_rebalance=None,
            windows=100,
            config=config,
        )
        assert "a jump to a new regime" in d.load
        assert ("hedged with regime" in d.load) == (hedge is True)
        assert d.take and d.candidate is not None
        assert balance(d.candidate, burst, 8) > balance(current, burst, 8) + 0.2
        placed[hedge] = d.candidate
    assert balance(placed[True], base, 8) > balance(placed[False], base, 8) + 0.02
    worst = {h: min(balance(p, base, 8), balance(p, burst, 8)) for h, p in placed.items()}
    assert worst[True] > worst[False] + 0.02
    # Where no load went back the fit on the burst window is what the policy takes.
    assert np.array_equal(placed[None], placed[False])
    back = RegimeLibrary.from_record(*lib.to_record())
    assert (back.went_back, back.came_from) == (lib.went_back, lib.came_from)


def test_a_sure_gain_waits_only_the_min_interval_scaled_to_its_gain() -> None:
    """A burst right after a plan: a gain of `sure_gain` or more repays a plan that many
    times sooner than the smallest accepted gain, so the min interval shrinks by that
    ratio; a small gain still waits the whole interval."""
    rng = np.random.default_rng(10)
    policy = PolicyConfig(min_interval_seconds=4.0)
    config = RegimeConfig(sure_gain=0.05)  # this small shape's burst gains about 0.09
    hot = A.copy()
    hot[:, [0, 5, 11]] *= 6.0
    burst = hot / hot.sum(axis=1, keepdims=True)

    def after_plan(dist: np.ndarray, current: np.ndarray) -> object:
        lib = RegimeLibrary()
        for t in range(6):
            observe(lib, _window(A, rng), float(t), SHAPE, config)
        counts = _window(dist, rng)
        return decide_regimes(
            lib,
            [(counts, 6.0)],
            counts,
            current,
            SHAPE,
            policy,
            now=6.0,
            last_rebalance=5.0,  # 1 s ago, within the 4 s interval
            windows=100,
            config=config,
        )

    d = after_plan(burst, fit(A, SHAPE))
    gain = d.balancedness_candidate - d.balancedness_current
    assert gain >= config.sure_gain and 4.0 * policy.gain_threshold / gain < 1.0
    assert d.take
    small = after_plan(A, fit(0.9 * A + 0.1 * B, SHAPE))
    assert small.balancedness_candidate - small.balancedness_current < config.sure_gain
    assert small.outcome == "skip_min_interval"
