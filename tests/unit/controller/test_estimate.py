"""Load estimator: decay math, sliding window, persistence, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.controller.estimate import EstimatorConfig, LoadEstimator, shrink_shares
from rebalancer.errors import InputError


def _windows(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, size=(3, 5)) for _ in range(n)]


def test_zero_before_any_window() -> None:
    est = LoadEstimator(3, 5)
    assert est.windows == 0
    np.testing.assert_array_equal(est.estimate(), np.zeros((3, 5)))


def test_decay_is_a_normalised_exponential_mean() -> None:
    a, b, c = _windows(3)
    est = LoadEstimator(3, 5, EstimatorConfig(shrink=False, decay=0.7))
    est.add(a)
    np.testing.assert_allclose(est.estimate(), a)  # no start-up bias toward zero
    est.add(b)
    est.add(c)
    expected = (0.49 * a + 0.7 * b + c) / (0.49 + 0.7 + 1.0)
    np.testing.assert_allclose(est.estimate(), expected)
    assert est.windows == 3


def test_decay_extremes() -> None:
    ws = _windows(4, seed=1)
    last = LoadEstimator(3, 5, EstimatorConfig(shrink=False, decay=0.0))
    mean = LoadEstimator(3, 5, EstimatorConfig(shrink=False, decay=1.0))
    for w in ws:
        last.add(w)
        mean.add(w)
    np.testing.assert_allclose(last.estimate(), ws[-1])
    np.testing.assert_allclose(mean.estimate(), np.mean(ws, axis=0))


def test_sliding_window_keeps_only_the_last_windows() -> None:
    ws = _windows(40, seed=2)
    est = LoadEstimator(3, 5, EstimatorConfig(shrink=False, window=3))
    for i, w in enumerate(ws):
        est.add(w)
        lo = max(0, i - 2)
        np.testing.assert_allclose(est.estimate(), np.mean(ws[lo : i + 1], axis=0))


def test_state_dict_round_trip_continues_identically() -> None:
    ws = _windows(6, seed=3)
    for config in (
        EstimatorConfig(shrink=False, decay=0.5),
        EstimatorConfig(shrink=False, window=2),
    ):
        a = LoadEstimator(3, 5, config)
        for w in ws[:4]:
            a.add(w)
        b = LoadEstimator(3, 5)
        b.load_state_dict(a.state_dict())
        assert b.config == config and b.windows == 4
        for w in ws[4:]:
            a.add(w)
            b.add(w)
        np.testing.assert_allclose(a.estimate(), b.estimate())


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((3, 4)),
        np.full((3, 5), np.nan),
        -np.ones((3, 5)),
        np.array([["x"] * 5] * 3),
    ],
)
def test_bad_window_is_refused_and_changes_nothing(bad: np.ndarray) -> None:
    est = LoadEstimator(3, 5, EstimatorConfig(shrink=False))
    good = _windows(1)[0]
    est.add(good)
    with pytest.raises(InputError):
        est.add(bad)
    assert est.windows == 1
    np.testing.assert_allclose(est.estimate(), good)


@pytest.mark.parametrize(
    "config",
    [
        EstimatorConfig(shrink=False, decay=1.5),
        EstimatorConfig(shrink=False, decay=-0.1),
        EstimatorConfig(shrink=False, window=-1),
        EstimatorConfig(shrink=False, prior_decay=1.1),
    ],
)
def test_bad_config(config: EstimatorConfig) -> None:
    with pytest.raises(InputError):
        LoadEstimator(3, 5, config)


def test_state_of_another_shape_is_refused() -> None:
    a = LoadEstimator(3, 5)
    a.add(_windows(1)[0])
    with pytest.raises(InputError):
        LoadEstimator(4, 5).load_state_dict(a.state_dict())


def test_state_dict_is_json_ready() -> None:
    import json

    est = LoadEstimator(3, 5, EstimatorConfig(shrink=False, window=2))
    for w in _windows(3):
        est.add(w)
    again = LoadEstimator(3, 5)
    again.load_state_dict(json.loads(json.dumps(est.state_dict())))
    np.testing.assert_allclose(again.estimate(), est.estimate())


def test_effective_windows() -> None:
    ws = _windows(30, seed=5)
    decayed = LoadEstimator(3, 5, EstimatorConfig(shrink=False, decay=0.5))
    sliding = LoadEstimator(3, 5, EstimatorConfig(shrink=False, window=4))
    assert decayed.effective_windows == 0.0 and sliding.effective_windows == 0.0
    decayed.add(ws[0])
    assert decayed.effective_windows == 1.0
    for w in ws:
        decayed.add(w)
        sliding.add(w)
    assert decayed.effective_windows == pytest.approx((1 + 0.5) / (1 - 0.5), rel=1e-6)
    assert sliding.effective_windows == 4.0
    assert LoadEstimator(3, 5, EstimatorConfig(shrink=False, decay=1.0)).effective_windows == 0.0


def test_shrink_replaces_noise_and_keeps_signal() -> None:
    rng = np.random.default_rng(0)
    E = 16
    uniform = np.full(E, 1.0 / E)
    noise = np.stack([rng.multinomial(50, uniform) for _ in range(200)]).astype(float)
    shares, weight = shrink_shares(noise, uniform)
    assert weight.mean() > 0.8  # chance deviations go back to the prior
    raw_error = np.abs(noise / noise.sum(axis=1, keepdims=True) - uniform).mean()
    assert np.abs(shares - uniform).mean() < 0.3 * raw_error
    skew = rng.dirichlet(np.full(E, 0.5), size=20)
    dense = np.stack([rng.multinomial(100000, s) for s in skew]).astype(float)
    shares, weight = shrink_shares(dense, uniform)
    assert weight.max() < 0.01  # far beyond noise: kept as observed
    np.testing.assert_allclose(shares, skew, atol=0.01)
    np.testing.assert_allclose(shares.sum(axis=1), 1.0)
    _, empty = shrink_shares(np.zeros((2, E)), uniform)
    np.testing.assert_array_equal(empty, 1.0)


def test_shrunk_estimate_accumulates_evidence() -> None:
    # Sparse windows from a fixed skew: the short-run estimate stays as noisy as ~2
    # windows, the shrunk one gets closer to the truth and is worth more windows.
    rng = np.random.default_rng(3)
    L, E = 8, 8
    truth = rng.dirichlet(np.full(E, 2.0), size=L)
    est = LoadEstimator(L, E, EstimatorConfig(shrink=False, decay=0.3))
    worth = []
    for _ in range(40):
        est.add(np.stack([rng.multinomial(32, truth[layer]) for layer in range(L)]))
        worth.append(float(np.median(est.shrunk()[1])))
    fast = est.estimate() / est.estimate().sum(axis=1, keepdims=True)
    shrunk, _ = est.shrunk()
    np.testing.assert_allclose(shrunk.sum(axis=1), est.estimate().sum(axis=1))
    shrunk = shrunk / shrunk.sum(axis=1, keepdims=True)
    assert np.abs(shrunk - truth).mean() < 0.6 * np.abs(fast - truth).mean()
    assert worth[-1] > 3 * est.effective_windows and worth[-1] > worth[2]


def test_shrunk_state_round_trip_and_old_state() -> None:
    a = LoadEstimator(3, 5, EstimatorConfig(decay=0.3, prior_decay=0.9, shrink=True))
    for w in _windows(6):
        a.add(w)
    np.testing.assert_array_equal(a.estimate(), a.shrunk()[0])  # shrink: what decisions see
    np.testing.assert_array_equal(a.estimate_and_noise()[1], a.shrunk()[1])
    b = LoadEstimator(3, 5)
    b.load_state_dict(a.state_dict())
    assert b.config == a.config
    for x, y in zip(a.shrunk(), b.shrunk(), strict=True):
        np.testing.assert_allclose(x, y)
    old = {k: v for k, v in a.state_dict().items() if not k.startswith("prior") and k != "shrink"}
    c = LoadEstimator(3, 5)
    c.load_state_dict(old)  # saved before the prior existed: it starts afresh
    np.testing.assert_allclose(c.estimate(), a.smoothed())
    c.add(_windows(1)[0])
    assert np.all(np.isfinite(c.shrunk()[0]))


def test_checked_windows_fold_the_same_without_the_count_scans() -> None:
    """The controller's merged windows were checked at decode (each part finite,
    non-negative, at most 2^53): `checked` folds them the same, checking their shape only."""
    a, b = (w.astype(np.float64) for w in _windows(2))
    plain, checked = LoadEstimator(3, 5), LoadEstimator(3, 5)
    for w in (a, b):
        plain.add(w)
        checked.add(w, checked=True)
    np.testing.assert_array_equal(plain.estimate(), checked.estimate())
    with pytest.raises(InputError, match="shape"):
        checked.add(np.zeros((3, 4)), checked=True)
    with pytest.raises(InputError, match="negative"):
        plain.add(-a)  # unchecked input is still scanned


def test_shrink_without_masks_gives_the_masked_numbers() -> None:
    """`shrink_shares` skips its masks where every layer is loaded and the prior rules out
    no expert: each row must be what the masked computation gives it, bit for bit (a row
    of zeros beside them sends the same rows down the masked path)."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        counts = rng.poisson(rng.gamma(0.4, 200.0, size=(6, 32))).astype(np.float64) + 1.0
        prior = rng.dirichlet(np.ones(32))
        fast = shrink_shares(counts, prior)
        masked = shrink_shares(np.vstack([counts, np.zeros((1, 32))]), prior)
        np.testing.assert_array_equal(fast[0], masked[0][:-1])
        np.testing.assert_array_equal(fast[1], masked[1][:-1])
        assert masked[1][-1] == 1.0  # the empty layer is the prior's


@pytest.mark.parametrize("config", [EstimatorConfig(), EstimatorConfig(window=3, shrink=False)])
def test_a_copy_of_the_sums_gives_the_estimate_of_its_time(config: EstimatorConfig) -> None:
    """What a decision reads travels as the estimator's sums (`sums(copy=True)`) and the
    estimate is computed from them in the decision worker: the same numbers as the
    estimator's own, and windows folded after the copy change none of them."""
    rng = np.random.default_rng(4)
    est = LoadEstimator(3, 8, config)
    for _ in range(5):
        est.add(rng.poisson(40.0, size=(3, 8)))
    sums = est.sums(copy=True)
    estimate, noise = est.estimate_and_noise()
    got = sums.estimate_and_noise()
    np.testing.assert_array_equal(got[0], estimate)
    np.testing.assert_array_equal(got[1], noise)
    np.testing.assert_array_equal(sums.estimate(), est.estimate())
    for _ in range(4):
        est.add(rng.poisson(400.0, size=(3, 8)))
    assert not np.array_equal(est.estimate(), estimate)
    np.testing.assert_array_equal(sums.estimate_and_noise()[0], estimate)
