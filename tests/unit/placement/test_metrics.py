from __future__ import annotations

import numpy as np
import pytest

from rebalancer.placement import (
    balancedness,
    balancedness_per_layer,
    gpu_load,
    log2phy_of,
    logcnt_of,
    moved_fraction,
    trivial_placement,
)
from rebalancer.placement.metrics import argsort_rows, pack_sums

from .conftest import random_load


def test_trivial_placement_is_contiguous():
    p2l = trivial_placement(3, 8, 12, 4)
    assert p2l.shape == (3, 12) and p2l.dtype == np.int64
    assert p2l[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert (p2l == p2l[0]).all()


def test_logcnt_and_log2phy_agree_with_phy2log():
    rng = np.random.default_rng(1)
    p2l = np.stack(
        [rng.permutation(np.r_[np.arange(10), rng.integers(0, 10, 6)]) for _ in range(4)]
    )
    cnt = logcnt_of(p2l, 10)
    l2p = log2phy_of(p2l, 10)
    assert cnt.sum(axis=1).tolist() == [16] * 4
    assert l2p.shape == (4, 10, cnt.max())
    for layer in range(4):
        for expert in range(10):
            slots = l2p[layer, expert]
            real = slots[slots >= 0]
            assert len(real) == cnt[layer, expert]
            assert (slots[len(real) :] == -1).all()
            assert real.tolist() == sorted(np.flatnonzero(p2l[layer] == expert).tolist())


def test_log2phy_padding_width():
    p2l = trivial_placement(2, 4, 8, 2)
    assert log2phy_of(p2l, 4, max_replicas=5).shape == (2, 4, 5)
    with pytest.raises(ValueError):
        log2phy_of(p2l, 4, max_replicas=1)


def test_gpu_load_splits_replicas_evenly():
    p2l = np.array([[0, 1, 0, 2]])  # expert 0 twice: GPU0 = {0, 1}, GPU1 = {0, 2}
    load = np.array([[10.0, 4.0, 6.0]])
    assert gpu_load(p2l, load, 2).tolist() == [[9.0, 11.0]]
    assert balancedness(p2l, load, 2) == pytest.approx(10 / 11)


def test_gpu_load_conserves_total():
    load = random_load(3, layers=5, experts=12)
    p2l = trivial_placement(5, 12, 16, 4)
    assert np.allclose(gpu_load(p2l, load, 4).sum(axis=1), load.sum(axis=1))


def test_zero_layers_are_nan_and_skipped():
    load = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [4, 0, 0, 0]])
    p2l = trivial_placement(3, 4, 4, 2)
    per_layer = balancedness_per_layer(p2l, load, 2)
    assert np.isnan(per_layer[0])
    assert per_layer[1] == pytest.approx(1.0) and per_layer[2] == pytest.approx(0.5)
    assert balancedness(p2l, load, 2) == pytest.approx(0.75)
    assert balancedness(p2l, np.zeros((3, 4)), 2) == 1.0


def test_moved_fraction_counts_changed_slots():
    old = trivial_placement(2, 4, 8, 2)
    new = old.copy()
    new[0, :2] = [3, 2]
    assert moved_fraction(old, new) == pytest.approx(2 / 16)
    assert moved_fraction(old, old) == 0.0


def test_argsort_rows_orders_like_a_stable_argsort():
    rng = np.random.default_rng(3)
    for width in (1, 2, 31, 32, 33, 288, 600):
        values = rng.random((5, width)) * 10.0 ** rng.integers(-3, 6)
        values[0] = np.floor(values[0])  # ties: broken by column index
        assert (argsort_rows(values) == np.argsort(values, axis=1, kind="stable")).all()
        descending = np.argsort(-values, axis=1, kind="stable")
        assert (argsort_rows(values, descending=True) == descending).all()
    # -0.0 sorts as 0.0
    assert argsort_rows(np.array([[0.0, -0.0, 1.0]]), descending=True).tolist() == [[2, 0, 1]]


def test_pack_sums_match_numpy_sums():
    rng = np.random.default_rng(4)
    for packs, per_pack in ((1, 5), (4, 1), (32, 9), (256, 2)):
        values = rng.random((3, packs * per_pack))
        expected = values.reshape(3, packs, per_pack).sum(axis=2)
        assert np.allclose(pack_sums(values, packs), expected, rtol=1e-14, atol=0)
