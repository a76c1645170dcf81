"""Dispatch by load (worker_hooks/waterfill.py) against the placement math, and the hook.

G ranks are emulated in one process: every rank gets the same gathered counts, as the
all-gather gives them (the real collective runs in tests/integration/test_dispatch_modes.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rebalancer.placement.metrics import dispatch_allocation, gpu_replicas
from rebalancer.wire.layout import log2phy_of, trivial_placement
from rebalancer.wire.shape import ClusterShape
from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.hook import DispatchConfig, HookConfig, Link, RebalanceHook

G, E, P, L, T, K = 4, 16, 24, 3, 40, 3


def placement(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ph = trivial_placement(L, E, P, G)
    ph[:, E:] = rng.integers(0, 6, size=(L, P - E))  # hot experts replicated anywhere
    return ph


def routing(seed: int, shared: bool) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    probs = np.r_[np.full(6, 4.0), np.ones(E - 6)]
    probs /= probs.sum()
    out = []
    for r in range(G):
        ids = torch.from_numpy(rng.choice(E, size=(T + 7 * r, K), p=probs))  # uneven ranks
        ids[0, 0] = -1  # padding is neither counted nor dispatched
        if shared:
            ids = torch.cat([ids, torch.full((ids.shape[0], 1), E)], dim=1)
        out.append(ids)
    return out


def dispatchers(ph: np.ndarray, shared: bool) -> list[ReplicaDispatch]:
    return [
        ReplicaDispatch(
            log2phy_of(ph, E),
            G,
            r,
            max_replicas=P - E + 1,
            num_physical=P,
            by_load=True,
            shared_expert=shared,
        )
        for r in range(G)
    ]


def gpu_of(ids: np.ndarray) -> np.ndarray:
    return np.where(ids >= P, ids - P, ids // (P // G))


@pytest.mark.parametrize(
    ("mode", "seed"), [("load", 0), ("load", 1), ("load+shared", 2), ("load+shared", 3)]
)
def test_each_gpu_computes_what_the_placement_math_allocates(mode: str, seed: int) -> None:
    shared = mode == "load+shared" or seed % 2 == 1  # load with and without a shared expert
    ph = placement(seed)
    ds = dispatchers(ph, shared)
    ids = routing(seed, shared)
    for layer in range(L):
        counts = torch.stack([d.count_picks(i) for d, i in zip(ds, ids, strict=True)])
        phys = [
            d.dispatch_by_load(layer, i, counts, mode == "load+shared")
            for d, i in zip(ds, ids, strict=True)
        ]
        per_gpu = np.zeros(G, dtype=np.int64)
        for i, p in zip(ids, phys, strict=True):
            p_np, i_np = p.numpy(), i.numpy()
            assert ((p_np == -1) == (i_np == -1)).all()
            routed = i_np[:, :K] >= 0
            # every pick lands on a slot that holds its expert (the shared one on its own ids)
            assert (ph[layer][p_np[:, :K][routed]] == i_np[:, :K][routed]).all()
            if shared:
                assert (p_np[:, K] >= P).all()
            np.add.at(per_gpu, gpu_of(p_np[p_np >= 0]), 1)
        c = counts.numpy()
        rep = gpu_replicas(ph[layer : layer + 1], E, G)
        alloc = dispatch_allocation(c[None, :, :E], rep, mode, c[None, :, E] if shared else None)[0]
        np.testing.assert_array_equal(per_gpu, alloc.sum(axis=0))
        # never worse than the hash split's expectation on the same step
        split = dispatch_allocation(
            c[None, :, :E], rep, "split", c[None, :, E] if shared else None
        )[0]
        assert per_gpu.max() <= split.sum(axis=0).max() + E  # rounding: under a token per expert


def test_dispatch_by_load_is_deterministic_and_agrees_across_ranks() -> None:
    ph = placement(5)
    ids = routing(5, True)
    a, b = dispatchers(ph, True), dispatchers(ph, True)
    counts = torch.stack([d.count_picks(i) for d, i in zip(a, ids, strict=True)])
    for r in range(G):
        x = a[r].dispatch_by_load(1, ids[r], counts, True)
        y = b[r].dispatch_by_load(1, ids[r].clone(), counts.clone(), True)
        assert torch.equal(x, y)


def test_split_is_unchanged_by_the_load_tables() -> None:
    ph = placement(7)
    plain = ReplicaDispatch(log2phy_of(ph, E), G, 2, max_replicas=P - E + 1, num_physical=P)
    loaded = dispatchers(ph, True)[2]
    ids = routing(7, False)[2]
    for layer in range(L):
        assert torch.equal(plain.dispatch(layer, ids), loaded.dispatch(layer, ids))


def test_map_swap_updates_the_load_tables_in_place() -> None:
    d = dispatchers(placement(8), False)[0]
    replicas, slot_on = d.replicas.data_ptr(), d.slot_on.data_ptr()
    new = placement(9)
    d.update_(log2phy_of(new, E))
    assert (d.replicas.data_ptr(), d.slot_on.data_ptr()) == (replicas, slot_on)
    np.testing.assert_array_equal(d.replicas.numpy(), gpu_replicas(new, E, G))


def hook(mode: str, shared: bool) -> RebalanceHook:
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="t"),
        rank=0,
        shape=ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=1, expert_bytes=0),
        shared_expert=shared,
        dispatch=DispatchConfig(mode=mode),
    )  # type: ignore[arg-type]
    weights = {"w1": torch.zeros(L, P, 2)}
    return RebalanceHook(config, trivial_placement(L, E, P, 1), weights, None, None)


def test_config_refuses_bad_modes() -> None:
    with pytest.raises(ValueError, match="load\\+shared"):
        hook("load+shared", False)
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        hook("even", False)


@pytest.mark.parametrize("mode", ["split", "load", "load+shared"])
def test_the_shared_expert_is_counted_in_its_own_column_and_layer(mode: str) -> None:
    h = hook(mode, True)
    ids = torch.randint(0, E, (T, K))
    phys = h.route(1, ids)  # a hash-routed layer is just another layer index
    assert phys.shape == (T, K + 1)
    assert (phys[:, K] == P).all()  # one GPU: the shared expert stays home
    logical, physical = h.recorder.take_window()
    assert logical.shape == (L, E + 1)
    assert logical[1, E] == T and logical[1, :E].sum() == T * K
    assert logical[[0, 2]].sum() == 0
    assert physical is not None and physical[1, P] == T  # the shared replica of GPU 0


@pytest.mark.parametrize("passes", [1, 2, 8])
def test_the_pass_count_is_honoured_alike_by_worker_and_placement_math(passes: int) -> None:
    ph = placement(11)
    ids = routing(11, True)
    ds = [
        ReplicaDispatch(
            log2phy_of(ph, E),
            G,
            r,
            max_replicas=P - E + 1,
            num_physical=P,
            by_load=True,
            shared_expert=True,
            waterfill_passes=passes,
        )
        for r in range(G)
    ]
    counts = torch.stack([d.count_picks(i) for d, i in zip(ds, ids, strict=True)])
    c = counts.numpy()
    rep = gpu_replicas(ph[2:3], E, G)
    want = dispatch_allocation(c[None, :, :E], rep, "load+shared", c[None, :, E], passes)[0]
    per_gpu = np.zeros(G, dtype=np.int64)
    for d, i in zip(ds, ids, strict=True):
        p = d.dispatch_by_load(2, i, counts, True).numpy()
        np.add.at(per_gpu, gpu_of(p[p >= 0]), 1)
    np.testing.assert_array_equal(per_gpu, want.sum(axis=0))
    with pytest.raises(ValueError, match="waterfill passes"):
        ReplicaDispatch(log2phy_of(ph, E), G, 0, by_load=True, waterfill_passes=0)
