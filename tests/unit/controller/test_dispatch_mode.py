"""The controller predicts a placement's balance under the deployment's dispatch mode."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rebalancer.controller.decide import PolicyConfig, decide, predicted_balance
from rebalancer.errors import InputError
from rebalancer.placement import balancedness, trivial_placement
from rebalancer.placement.metrics import gpu_load
from rebalancer.wire.shape import ClusterShape, dispatch_shape, shape_key

L, E, P, G = 2, 16, 24, 4


def skewed() -> np.ndarray:
    rng = np.random.default_rng(0)
    load = rng.integers(50, 150, size=(L, E)).astype(np.float64)
    load[:, 0] = 3000.0  # one hot expert
    return load


def test_split_prediction_is_unchanged() -> None:
    shape = ClusterShape(L, E, P, G)
    ph = trivial_placement(L, E, P, G)
    b, r = predicted_balance(ph, skewed(), shape)
    assert b == pytest.approx(balancedness(ph, skewed(), G), abs=0)
    loads = gpu_load(ph, skewed(), G)
    assert r == pytest.approx(loads.max(axis=1).sum() / (loads.sum() / G))


def test_load_modes_predict_better_balance_with_replicas_to_use() -> None:
    ph = trivial_placement(L, E, P, G)
    ph[:, E:] = 0  # the hot expert everywhere: the water-fill can use its replicas
    load = skewed()
    split = predicted_balance(ph, load, ClusterShape(L, E, P, G))
    by_load = predicted_balance(ph, load, ClusterShape(L, E, P, G, dispatch_mode="load"))
    shared = predicted_balance(
        ph, load, ClusterShape(L, E, P, G, dispatch_mode="load+shared", top_k=2)
    )
    assert split[0] < by_load[0] <= shared[0] + 1e-12
    assert split[1] > by_load[1]


def test_a_placement_good_enough_under_load_is_kept() -> None:
    ph = trivial_placement(L, E, P, G)
    ph[:, E:] = 0
    load = skewed()
    policy = PolicyConfig(min_windows=1, min_interval_seconds=0.0, gain_threshold=0.02)
    split = decide(load, ph, ClusterShape(L, E, P, G), policy, 100.0, None, 10)
    by_load = decide(
        load,
        ph,
        ClusterShape(L, E, P, G, dispatch_mode="load+shared", top_k=2),
        policy,
        100.0,
        None,
        10,
    )
    assert by_load.balancedness_current > split.balancedness_current
    assert by_load.predicted_gain_seconds < split.predicted_gain_seconds


def test_register_shape_carries_the_mode() -> None:
    shape = dispatch_shape(ClusterShape(L, E, P, G), "", 0)
    assert shape.dispatch_mode == "split"
    shape = dispatch_shape(ClusterShape(L, E, P, G), "load+shared", 8)
    assert shape_key(shape)["dispatch_mode"] == "load+shared" and shape_key(shape)["top_k"] == 8
    assert ClusterShape(**shape_key(shape)) == shape  # stored and read back
    with pytest.raises(InputError, match="unknown dispatch mode"):
        dispatch_shape(ClusterShape(L, E, P, G), "hash", 0)
    with pytest.raises(InputError, match="top_k"):
        dispatch_shape(ClusterShape(L, E, P, G), "load", E + 1)
    assert dataclasses.replace(shape, dispatch_mode="split") != shape


def test_a_deployment_stored_before_dispatch_modes_adopts_them(tmp_path) -> None:
    """A store written before the shape had dispatch_mode/top_k: ranks that now send them
    are not refused; the first one's values are kept (in the store too) and then held."""
    from rebalancer.controller.registry import Registry
    from rebalancer.controller.store import Store
    from rebalancer.errors import StateError

    db = tmp_path / "c.db"
    old_row = {
        k: v
        for k, v in shape_key(ClusterShape(L, E, P, G)).items()
        if k not in ("dispatch_mode", "top_k")
    }
    store = Store(db)
    store.create_deployment(
        "d", old_row, PolicyConfig().to_flat(), 0, trivial_placement(L, E, P, G), now=0.0
    )
    store.close()

    def registry() -> tuple[Registry, Store]:
        s = Store(db)
        r = Registry(s, lambda: 100.0, PolicyConfig())
        r.load()
        return r, s

    reg, store = registry()
    assert reg.deployment("d").shape.top_k == 0
    sent = dispatch_shape(ClusterShape(L, E, P, G), "load+shared", 8)
    _, dep = reg.register("d", 0, sent, 0, None, "w0")
    assert (dep.shape.dispatch_mode, dep.shape.top_k, dep.loop.shape.top_k) == ("load+shared", 8, 8)
    reg.register(
        "d", 1, dispatch_shape(ClusterShape(L, E, P, G), "load+shared", 0), 0, None, "w1"
    )  # 0: unknown
    for bad in (
        dispatch_shape(ClusterShape(L, E, P, G), "load", 8),
        dispatch_shape(ClusterShape(L, E, P, G), "load+shared", 6),
    ):
        with pytest.raises(StateError, match="registered with shape"):
            reg.register("d", 2, bad, 0, None, "w2")
    store.close()
    reg, store = registry()  # a restart reads the adopted values back
    assert (reg.deployment("d").shape.dispatch_mode, reg.deployment("d").shape.top_k) == (
        "load+shared",
        8,
    )
    assert reg.deployment("d").unknown_fields == frozenset()
    store.close()


def test_a_stored_split_deployment_refuses_another_mode_once_known(tmp_path) -> None:
    from rebalancer.controller.registry import Registry
    from rebalancer.controller.store import Store
    from rebalancer.errors import StateError

    store = Store(tmp_path / "c.db")
    old_row = {k: v for k, v in shape_key(ClusterShape(L, E, P, G)).items() if k != "dispatch_mode"}
    store.create_deployment(
        "d", old_row, PolicyConfig().to_flat(), 0, trivial_placement(L, E, P, G), now=0.0
    )
    reg = Registry(store, lambda: 100.0, PolicyConfig())
    reg.load()
    reg.register(
        "d", 0, dispatch_shape(ClusterShape(L, E, P, G), "", 0), 0, None, "w0"
    )  # no mode: split
    with pytest.raises(StateError, match="registered with shape"):
        reg.register("d", 1, dispatch_shape(ClusterShape(L, E, P, G), "load", 0), 0, None, "w1")
    store.close()
