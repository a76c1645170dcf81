"""Load estimator: decay math, sliding window, persistence, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.controller.estimate import EstimatorConfig, LoadEstimator
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
    est = LoadEstimator(3, 5, EstimatorConfig(decay=0.7))
    est.add(a)
    np.testing.assert_allclose(est.estimate(), a)  # no start-up bias toward zero
    est.add(b)
    est.add(c)
    expected = (0.49 * a + 0.7 * b + c) / (0.49 + 0.7 + 1.0)
    np.testing.assert_allclose(est.estimate(), expected)
    assert est.windows == 3


def test_decay_extremes() -> None:
    ws = _windows(4, seed=1)
    last = LoadEstimator(3, 5, EstimatorConfig(decay=0.0))
    mean = LoadEstimator(3, 5, EstimatorConfig(decay=1.0))
    for w in ws:
        last.add(w)
        mean.add(w)
    np.testing.assert_allclose(last.estimate(), ws[-1])
    np.testing.assert_allclose(mean.estimate(), np.mean(ws, axis=0))


def test_sliding_window_keeps_only_the_last_windows() -> None:
    ws = _windows(40, seed=2)
    est = LoadEstimator(3, 5, EstimatorConfig(window=3))
    for i, w in enumerate(ws):
        est.add(w)
        lo = max(0, i - 2)
        np.testing.assert_allclose(est.estimate(), np.mean(ws[lo : i + 1], axis=0))


def test_state_dict_round_trip_continues_identically() -> None:
    ws = _windows(6, seed=3)
    for config in (EstimatorConfig(decay=0.5), EstimatorConfig(window=2)):
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
    est = LoadEstimator(3, 5)
    good = _windows(1)[0]
    est.add(good)
    with pytest.raises(InputError):
        est.add(bad)
    assert est.windows == 1
    np.testing.assert_allclose(est.estimate(), good)


@pytest.mark.parametrize(
    "config", [EstimatorConfig(decay=1.5), EstimatorConfig(decay=-0.1), EstimatorConfig(window=-1)]
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

    est = LoadEstimator(3, 5, EstimatorConfig(window=2))
    for w in _windows(3):
        est.add(w)
    again = LoadEstimator(3, 5)
    again.load_state_dict(json.loads(json.dumps(est.state_dict())))
    np.testing.assert_allclose(again.estimate(), est.estimate())


def test_effective_windows() -> None:
    ws = _windows(30, seed=5)
    decayed = LoadEstimator(3, 5, EstimatorConfig(decay=0.5))
    sliding = LoadEstimator(3, 5, EstimatorConfig(window=4))
    assert decayed.effective_windows == 0.0 and sliding.effective_windows == 0.0
    decayed.add(ws[0])
    assert decayed.effective_windows == 1.0
    for w in ws:
        decayed.add(w)
        sliding.add(w)
    assert decayed.effective_windows == pytest.approx((1 + 0.5) / (1 - 0.5), rel=1e-6)
    assert sliding.effective_windows == 4.0
    assert LoadEstimator(3, 5, EstimatorConfig(decay=1.0)).effective_windows == 0.0
