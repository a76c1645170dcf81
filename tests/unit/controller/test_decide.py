"""Decision policy: every gate outcome, forced and dry runs, validation."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from rebalancer.controller.decide import PolicyConfig, decide
from rebalancer.controller.policy_loop import PolicyLoop
from rebalancer.errors import InputError
from rebalancer.placement import balancedness, compute_placement, gpu_load, trivial_placement
from rebalancer.wire.shape import ClusterShape

L, E, P, G = 4, 16, 24, 4
SHAPE = ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=10**8)


def _skewed_load(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    load = rng.pareto(1.2, size=(L, E)) * 1000 + 10
    return load


def _trivial() -> np.ndarray:
    return np.asarray(trivial_placement(L, E, P, G))


def _policy(**changes) -> PolicyConfig:
    # No migration budget unless a test sets one: the gate, not the budget, is under test.
    return PolicyConfig(max_moved_fraction=1.0).with_settings(changes)


def _decide(policy: PolicyConfig | None = None, **kwargs):
    args = dict(
        estimate=_skewed_load(),
        current=_trivial(),
        shape=SHAPE,
        policy=policy or _policy(),
        now=1000.0,
        last_rebalance=None,
        windows=10,
    )
    args.update(kwargs)
    return decide(**args)


def _assert_filled(d) -> None:
    for name in (
        "balancedness_current",
        "balancedness_candidate",
        "bound_balancedness",
        "moved_fraction",
        "predicted_gain_seconds",
        "migration_cost_seconds",
    ):
        assert math.isfinite(getattr(d, name)), name
    assert 0 < d.balancedness_current <= d.bound_balancedness + 1e-9
    assert d.balancedness_candidate <= d.bound_balancedness + 1e-9
    assert d.reason


def test_skewed_load_on_trivial_placement_rebalances() -> None:
    policy = _policy()
    d = _decide(policy)
    assert d.outcome == "rebalance" and d.take
    _assert_filled(d)
    assert d.candidate is not None and d.candidate.shape == (L, P)
    assert d.balancedness_candidate > d.balancedness_current + 0.02
    assert d.balancedness_candidate == pytest.approx(balancedness(d.candidate, _skewed_load(), G))
    assert d.predicted_gain_seconds > d.migration_cost_seconds
    assert d.slots_moved > 0
    assert d.moved_fraction == pytest.approx(d.slots_moved / (L * P))
    assert d.bytes_to_move <= d.slots_moved * SHAPE.expert_bytes
    # cost = busiest receiver's transfer time x overlap penalty + the commit pause (the
    # busiest receiver's experts copied from staging into live slots) + one map swap
    received = np.bincount(
        np.argwhere(d.candidate != _trivial())[:, 1] // (P // G), minlength=G
    ).max()
    commit = (
        received * SHAPE.expert_bytes / (policy.cost.commit_gbps * 1e9) + policy.cost.swap_seconds
    )
    assert d.migration_cost_seconds == pytest.approx(
        d.transfer_seconds * policy.cost.overlap_penalty + commit
    )


def test_candidate_respects_the_migration_budget() -> None:
    for budget in (0.1, 0.25, 0.5):
        d = _decide(_policy(max_moved_fraction=budget))
        assert d.moved_fraction <= budget + 1e-9
        assert d.slots_moved == round(d.moved_fraction * L * P)


def test_no_load() -> None:
    d = _decide(estimate=np.zeros((L, E)))
    assert d.outcome == "skip_no_load" and not d.take and d.candidate is None
    assert "no load" in d.reason


def test_paused() -> None:
    d = _decide(_policy(paused=True))
    assert d.outcome == "skip_paused" and d.candidate is None
    _assert_filled(d)  # the numbers are there even when skipped
    assert d.balancedness_candidate > d.balancedness_current


def test_min_windows() -> None:
    d = _decide(windows=1)
    assert d.outcome == "skip_min_windows" and not d.take
    assert _decide(windows=2).outcome == "rebalance"


def test_min_interval() -> None:
    policy = _policy(min_interval_seconds=30.0)
    d = _decide(policy, last_rebalance=990.0)
    assert d.outcome == "skip_min_interval" and not d.take
    assert "10.0 s ago" in d.reason
    assert _decide(policy, last_rebalance=970.0).outcome == "rebalance"


def test_noise_margin_stops_chasing_sparse_counts() -> None:
    # Uniform traffic seen through ~10 tokens per expert: the apparent skew is noise.
    noise = np.random.default_rng(1).poisson(10.0, size=(L, E)).astype(np.float64)
    fitted = np.asarray(compute_placement(np.ones((L, E)), P, G).phy2log)
    d = _decide(estimate=noise, current=fitted, windows=3, effective_windows=1.9)
    assert d.outcome == "skip_gain" and "noise margin" in d.reason
    assert d.noise_margin > 0.1
    # The bound leaves less than the margin: no candidate fitted, and the dry run's (what
    # a fit would give) looks worth it but the gate would refuse it the same.
    assert "no candidate fitted" in d.reason and d.slots_moved == 0
    dry = _decide(estimate=noise, current=fitted, windows=3, effective_windows=1.9, dry_run=True)
    assert dry.balancedness_candidate - dry.balancedness_current > 0.03  # looks worth it
    assert "gate: skip_gain" in dry.reason
    no_margin = _decide(_policy(noise_z=0.0), estimate=noise, current=fitted, windows=3)
    assert no_margin.outcome == "rebalance"
    # Real skew seen through plenty of tokens beats the (now small) margin.
    rich = _decide(estimate=_skewed_load() * 100, windows=3, effective_windows=1.9)
    assert rich.outcome == "rebalance" and rich.noise_margin < 0.01


def test_gain_below_threshold() -> None:
    d = _decide(_policy(gain_threshold=0.99))
    assert d.outcome == "skip_gain" and "threshold" in d.reason


def test_gain_does_not_beat_cost() -> None:
    # Very slow links make moving weights cost more than the horizon's gain (SHAPE is
    # one node: its transfers run at intra_node_gbps; link_bandwidth_gbps is across nodes).
    d = _decide(_policy(intra_node_gbps=1e-6, overlap_penalty=1.0))
    assert d.outcome == "skip_gain" and "cost" in d.reason
    assert d.migration_cost_seconds >= d.predicted_gain_seconds
    assert _decide(_policy(link_bandwidth_gbps=1e-6, overlap_penalty=1.0)).take
    two_nodes = dataclasses.replace(SHAPE, num_nodes=2)
    d = _decide(_policy(link_bandwidth_gbps=1e-6, overlap_penalty=1.0), shape=two_nodes)
    assert d.outcome == "skip_gain" and "cost" in d.reason
    assert d.migration_cost_seconds >= d.predicted_gain_seconds


def test_a_fitted_placement_is_kept() -> None:
    load = _skewed_load()
    fitted = np.asarray(compute_placement(load, P, G).phy2log)
    d = _decide(current=fitted)
    assert d.outcome == "skip_gain"


def test_forced_skips_the_gate() -> None:
    d = _decide(_policy(paused=True), forced=True, windows=0, last_rebalance=999.0)
    assert d.outcome == "forced" and d.take and d.gate == "skip_paused"
    assert d.candidate is not None


def test_dry_run_computes_but_takes_nothing() -> None:
    d = _decide(dry_run=True)
    assert d.outcome == "dry_run" and not d.take and d.gate == "rebalance"
    assert d.candidate is not None
    assert d.to_dict()["outcome"] == "dry_run" and "candidate" not in d.to_dict()


@pytest.mark.parametrize(
    "change",
    [
        {"decay": 1.5},
        {"gain_threshold": -0.1},
        {"max_moved_fraction": 0.0},
        {"min_windows": -1},
        {"horizon_seconds": float("nan")},
        {"link_bandwidth_gbps": 0.0},
        {"intra_node_gbps": -1.0},
        {"decision_period_seconds": -1.0},
        {"overlap_penalty": 2.0},
        {"paused": "yes"},
        {"shrink": 1},
        {"prior_decay": 1.5},
    ],
)
def test_policy_validation(change: dict) -> None:
    policy = PolicyConfig().with_settings(change)
    with pytest.raises(InputError):
        policy.validate()
    with pytest.raises(InputError):
        _decide(policy)


def test_policy_from_dict() -> None:
    assert PolicyConfig.from_dict({"decay": 0.5}).estimator.decay == 0.5
    with pytest.raises(InputError, match="unknown"):
        PolicyConfig.from_dict({"decy": 0.5})


def test_bad_shapes() -> None:
    with pytest.raises(InputError):
        _decide(estimate=np.ones((L, E + 1)))
    with pytest.raises(InputError):
        _decide(current=np.zeros((L, P + 1), dtype=np.int64))
    with pytest.raises(InputError):
        _decide(estimate=-np.ones((L, E)))
    with pytest.raises(InputError):
        dataclasses.replace(SHAPE, num_slots=P + 1).validate()


def test_policy_loop_timing() -> None:
    policy = _policy(decision_period_seconds=5.0, min_interval_seconds=20.0, min_windows=2)
    loop = PolicyLoop(SHAPE, policy)
    current = _trivial()
    load = _skewed_load().round().astype(np.int64)
    first = loop.on_window(load, current, now=0.0)
    assert first is not None and first.outcome == "skip_min_windows"
    assert loop.on_window(load, current, now=2.0) is None  # not due yet
    taken = loop.on_window(load, current, now=5.0)
    assert taken is not None and taken.outcome == "rebalance"
    assert loop.last_rebalance is None  # a take is no rebalance until its plan starts
    loop.started(5.0)
    assert loop.last_rebalance == 5.0
    assert loop.on_window(load, current, now=10.0, in_flight=True) is None
    later = loop.on_window(load, current, now=15.0)
    assert later is not None and later.outcome == "skip_min_interval"
    assert loop.estimator.windows == 5


def test_policy_loop_force_and_set_policy() -> None:
    loop = PolicyLoop(SHAPE, _policy())
    current = _trivial()
    load = _skewed_load().round().astype(np.int64)
    loop.observe(load)
    dry = loop.force(current, now=1.0, dry_run=True)
    assert dry.outcome == "dry_run" and loop.last_decision is None  # a dry run records nothing
    forced = loop.force(current, now=2.0)
    assert (
        forced.outcome == "forced" and loop.last_decision is forced and loop.last_rebalance is None
    )
    before = loop.estimator.estimate()
    loop.set_policy(_policy(decay=0.9))  # same mode: the estimate is kept
    np.testing.assert_allclose(loop.estimator.estimate(), before)
    assert loop.estimator.config.decay == 0.9
    loop.set_policy(_policy(estimate_window=3))  # another mode: it starts afresh
    assert loop.estimator.windows == 0
    with pytest.raises(InputError):
        loop.set_policy(_policy(decay=2.0))
    assert loop.estimator.config.window == 3  # a refused policy changes nothing


def _sparse_loop(
    shares: np.ndarray,
    tokens: int,
    current: np.ndarray,
    shrink: bool,
    windows: int = 60,
    seed: int = 0,
) -> list[int]:
    """Windows of `tokens` routings per layer drawn from `shares`; the windows rebalanced at."""
    rng = np.random.default_rng(seed)
    loop = PolicyLoop(SHAPE, _policy(shrink=shrink))
    taken = []
    for w in range(windows):
        counts = np.stack([rng.multinomial(tokens, shares[layer]) for layer in range(L)])
        d = loop.on_window(counts, current, now=5.0 * w)
        if d is not None and d.take:
            current = d.candidate
            taken.append(w)
    return taken


@pytest.mark.parametrize("tokens", [10, 40, 400, 40000])
def test_pure_noise_keeps_a_placement_fitted_to_uniform(tokens: int) -> None:
    # Uniform traffic on a placement that balances it: every refit would only fit noise.
    fitted = np.asarray(compute_placement(np.ones((L, E)), P, G).phy2log)
    uniform = np.full((L, E), 1.0 / E)
    for seed in range(3):
        assert _sparse_loop(uniform, tokens, fitted, shrink=True, seed=seed) == []


def test_strong_skew_still_rebalances_at_once() -> None:
    rng = np.random.default_rng(1)
    skew = np.stack([rng.dirichlet(np.full(E, 0.5)) for _ in range(L)])
    assert _sparse_loop(skew, 100000, _trivial(), shrink=True, windows=4)[:1] == [1]


def test_sparse_real_skew_becomes_significant_as_tokens_accumulate() -> None:
    # 40 routings per layer and window: the short-run estimate (~2 windows) never clears
    # the noise margin, but the shrunk estimate leans on the long-run prior, whose noise
    # falls as windows accumulate, so the real skew is acted on once it is significant.
    rng = np.random.default_rng(1)
    skew = np.stack([rng.dirichlet(np.full(E, 2.0)) for _ in range(L)])
    assert _sparse_loop(skew, 40, _trivial(), shrink=False) == []
    taken = _sparse_loop(skew, 40, _trivial(), shrink=True)
    assert taken and taken[0] > 2  # not on the first noisy windows


def test_with_one_slot_per_gpu_every_placement_balances_alike() -> None:
    # P == G: each GPU holds one expert, so the GPU loads of a layer are its expert loads
    # in some order and the busiest GPU carries the hottest expert whatever the placement.
    # No policy can beat another on balance there; the gate never finds a gain.
    shape = ClusterShape(num_layers=L, num_logical=G, num_slots=G, num_gpus=G)
    rng = np.random.default_rng(0)
    load = rng.pareto(1.2, size=(L, G)) * 1000 + 10
    perms = [np.stack([rng.permutation(G) for _ in range(L)]) for _ in range(5)]
    busiest = {tuple(np.round(gpu_load(p, load, G).max(axis=1), 9)) for p in perms}
    assert len(busiest) == 1
    for p in perms:
        d = decide(load, p, shape, _policy(), now=100.0, last_rebalance=None, windows=10)
        assert d.outcome == "skip_gain"
        assert d.balancedness_candidate == pytest.approx(d.balancedness_current)


def test_a_forced_decision_that_moves_nothing_starts_no_plan() -> None:
    """Forced on a placement the candidate equals: outcome skip_gain, no candidate, so no
    plan starts (a plan that moved 0 slots was started, only bumping the version); a dry
    run still reports it. Every decision carries the time it was taken at."""
    fitted = compute_placement(_skewed_load(), P, G).phy2log
    d = _decide(current=fitted, forced=True)
    assert d.slots_moved == 0 and d.outcome == "skip_gain" and not d.take and d.candidate is None
    assert d.reason.startswith("forced, but the candidate equals the current placement")
    assert d.time == 1000.0
    dry = _decide(current=fitted, dry_run=True, now=1234.5)
    assert dry.outcome == "dry_run" and dry.slots_moved == 0 and dry.time == 1234.5
    assert _decide(forced=True).outcome == "forced"  # moves slots: a plan starts


def test_a_decision_the_bound_settles_fits_no_candidate(monkeypatch) -> None:
    """Where the best reachable balancedness is less than the gate's margin above the
    current placement's, the decision is the gate's without a fit (the fit is most of a
    decision's cost), with the same outcome a fit would have given."""
    import rebalancer.controller.decide as decide_module

    fitted_calls = []
    fit = decide_module._fit_candidate

    def counting_fit(*args, **kwargs):
        fitted_calls.append(1)
        return fit(*args, **kwargs)

    monkeypatch.setattr(decide_module, "_fit_candidate", counting_fit)
    rng = np.random.default_rng(7)
    settled = 0
    for trial in range(40):
        base = _skewed_load() * rng.uniform(5, 50)
        current = np.asarray(compute_placement(base, P, G).phy2log)
        shift = rng.uniform(0.5, 2.0, size=(1, E)) if trial % 2 else 1.0  # odd: a new mix
        load = rng.poisson(base * shift).astype(np.float64)
        policy = _policy(gain_threshold=float(rng.choice([0.0, 0.005, 0.02, 0.1])))
        kwargs = dict(estimate=load, current=current, windows=10, effective_windows=4.0)
        before = len(fitted_calls)
        d = _decide(policy, **kwargs)
        fitted = len(fitted_calls) > before
        full = _decide(policy, dry_run=True, **kwargs)  # always fitted
        gate = full.reason.split("gate: ")[1].split(")")[0]
        assert d.outcome == gate, (trial, d.reason, full.reason)
        if not fitted:  # settled by the bound
            settled += 1
            assert "no candidate fitted" in d.reason and d.candidate is None
            assert full.balancedness_candidate - full.balancedness_current < (
                policy.gain_threshold + d.noise_margin
            )
            assert d.bound_balancedness == full.bound_balancedness
    assert 5 <= settled < 40  # both paths ran
    # Another dispatch mode's balancedness is not capped by the split bound: always fitted.
    load_mode = dataclasses.replace(SHAPE, dispatch_mode="load")
    before = len(fitted_calls)
    _decide(_policy(gain_threshold=0.5), shape=load_mode, windows=10)
    assert len(fitted_calls) == before + 1


def test_split_balance_is_what_the_placement_metrics_say() -> None:
    """Under split dispatch a decision packs a placement's GPU load once for both of its
    figures: they must be `balancedness` and `cost.imbalance_ratio` exactly."""
    from rebalancer.controller.cost import imbalance_ratio
    from rebalancer.controller.decide import predicted_balance

    for seed in range(6):
        load = _skewed_load(seed)
        if seed % 2:
            load[0] = 0.0  # a layer without load: skipped by the balancedness mean
        for phy2log in (_trivial(), compute_placement(_skewed_load(seed + 9), P, G).phy2log):
            b, ratio = predicted_balance(phy2log, load, SHAPE)
            assert b == balancedness(phy2log, load, G)
            assert ratio == imbalance_ratio(phy2log, load, G)


def test_a_prepared_decision_computes_its_estimate_where_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The controller prepares a decision on its event loop and runs it in the decision
    worker: preparing copies the estimator's sums and computes no estimate; the call
    computes it and decides as `decide` on the estimator's estimate would, however many
    windows were folded meanwhile, and survives the pickle to the worker."""
    import pickle

    from rebalancer.controller import estimate as estimate_module

    policy = _policy(min_interval_seconds=0.0)
    loop = PolicyLoop(SHAPE, policy)
    rng = np.random.default_rng(5)
    for _ in range(6):
        loop.observe(rng.poisson(_skewed_load()))
    expected_estimate, expected_noise = loop.estimator.estimate_and_noise()
    expected = decide(
        expected_estimate,
        _trivial(),
        SHAPE,
        policy,
        now=10.0,
        last_rebalance=None,
        windows=6,
        effective_windows=expected_noise,
    )
    calls = []
    real = estimate_module.shrink_shares
    monkeypatch.setattr(estimate_module, "shrink_shares", lambda *a: calls.append(1) or real(*a))
    work = loop.prepare_decision(_trivial(), now=10.0)
    assert calls == []  # nothing of the estimate on the caller's thread
    loop.observe(rng.poisson(3 * _skewed_load(1)))  # folded after: not in this decision
    got = pickle.loads(pickle.dumps(work))()
    assert len(calls) == 2  # the two levels of the shrunk estimate, in the call
    assert got.to_dict() == expected.to_dict()
    np.testing.assert_array_equal(got.candidate, expected.candidate)
