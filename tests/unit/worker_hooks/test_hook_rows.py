"""RebalanceHook with spare rows: dispatch hands out row ids, the controller still gets
its counts by slot. HookConfig refuses bad enumerated values by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rebalancer.placement import trivial_placement
from rebalancer.wire.shape import ClusterShape
from worker_hooks.hook import (
    CommitConfig,
    HookConfig,
    Link,
    MigrationConfig,
    RebalanceHook,
    WindowConfig,
)
from worker_hooks.plans import dispatch_map
from worker_hooks.transports.ipc import IpcTransport

L, E, P, G, SPARE = 2, 4, 8, 2, 2
S = P // G


def test_rows_are_dispatched_and_counts_reported_by_slot() -> None:
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="d"),
        rank=0,
        shape=ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=0),
        windows=WindowConfig(steps=1),
        commit=CommitConfig(agree_every=10**6, spare_rows=SPARE),
    )
    phy2log = trivial_placement(L, E, P, G)  # slot s holds expert s % 4
    weights = {"w": torch.zeros(L, S + SPARE, 1)}
    hook = RebalanceHook(config, phy2log, weights, agree_group=None, migrate_group=None)
    # Rows as after a plan that moved slot 1 of rank 0 and slot 2 of rank 1 (layer 1)
    # into their first spare rows; the hook's commit makes these same three calls.
    rows = hook.rows.rows.copy()
    rows[0, 1, 1], rows[1, 1, 2] = S, S
    hook.rows.switch(rows)
    hook.served.switch(hook.version, hook.phy2log, hook.rows.row_ids())
    hook.dispatch.update_(dispatch_map(config, hook.phy2log, hook.served.row_ids))

    # Layer 1, expert 1 lives in slots 1 (rank 0) and 5 (rank 1); rank 0 prefers its own.
    out = hook.route(1, torch.tensor([[1], [1], [2]]))
    assert out[:2].tolist() == [[S], [S]]  # rank 0's row S, not row 1 (now free)
    # Expert 2: slot 2 (rank 0, row 2) is local.
    assert out[2].tolist() == [2]
    hook.step_end()  # window_steps=1: the window goes to the agent
    (window,) = list(hook.agent._pending)
    assert window.physical is not None and window.physical.shape == (L, P)
    expected = np.zeros((L, P), dtype=np.int64)
    expected[1, 1], expected[1, 2] = 2, 1  # by slot, as the controller numbers them
    np.testing.assert_array_equal(window.physical, expected)
    np.testing.assert_array_equal(window.logical[1], [0, 2, 1, 0])


def test_weights_without_the_spare_rows_are_refused() -> None:
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="d"),
        rank=0,
        shape=ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=0),
        commit=CommitConfig(spare_rows=SPARE),
    )
    phy2log = trivial_placement(L, E, P, G)
    with pytest.raises(ValueError, match=r"does not fit weights \[2, 4\]"):
        RebalanceHook(config, phy2log, {"w": torch.zeros(L, S, 1)}, None, None)
    with pytest.raises(ValueError, match="spare_rows must be >= 0"):
        RebalanceHook(
            dataclasses.replace(config, commit=CommitConfig(spare_rows=-1)),
            phy2log,
            {"w": torch.zeros(L, S, 1)},
            None,
            None,
        )


def test_bad_hook_settings_are_refused_by_name() -> None:
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="d"),
        rank=0,
        shape=ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=0),
    )
    with pytest.raises(ValueError, match="transport must be one of p2p, ipc, outbox, got 'rdma'"):
        dataclasses.replace(config, migration=MigrationConfig(transport="rdma"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_gbps"):
        dataclasses.replace(config, migration=MigrationConfig(max_gbps=-1.0))
    with pytest.raises(ValueError, match="rank < num_gpus"):
        dataclasses.replace(config, rank=G)
    with pytest.raises(ValueError, match="not a multiple of num_gpus"):
        dataclasses.replace(config, shape=dataclasses.replace(config.shape, num_slots=P + 1))
    phy2log = trivial_placement(L, E, P, G)
    with pytest.raises(ValueError, match="run on cpu or cuda, got device 'meta'"):
        RebalanceHook(config, phy2log, {"w": torch.zeros(L, S, 1)}, None, None, device="meta")
    # The factory picks the transport's class from the config.
    hook = RebalanceHook(
        dataclasses.replace(config, migration=MigrationConfig(transport="ipc")),
        phy2log,
        {"w": torch.zeros(L, S, 1)},
        None,
        None,
    )
    assert isinstance(hook.executor.transport, IpcTransport)


def test_wrong_types_are_refused_at_construction_with_what_was_given() -> None:
    """What an integrator may pass by mistake (the README once let a tensor through to a
    `RuntimeError: Boolean value of Tensor ... is ambiguous` deep in the executor): a
    TypeError or ValueError that names the argument and what it got, before any thread."""
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="d"),
        rank=0,
        shape=ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=0),
    )
    phy2log = trivial_placement(L, E, P, G)
    w = torch.zeros(L, S, 3)
    for args, error, words in (
        (
            (config, phy2log, w),
            TypeError,
            r"weights must be a dict of name -> torch.Tensor .* got one Tensor "
            r"of shape \[2, 4, 3\]: name it, e.g. \{'w': weights\}",
        ),
        ((config, phy2log, [w]), TypeError, "weights must be a dict .*, got list"),
        ((config, phy2log, {"w": w.numpy()}), TypeError, "got 'w': ndarray"),
        ((config, phy2log, {}), ValueError, "it names no tensor"),
        ((config, phy2log, {"w": torch.zeros(L)}), ValueError, r"'w' has shape \[2\]"),
        (
            (config, phy2log[:, :S], {"w": w}),
            ValueError,
            r"phy2log has shape \[2, 4\], the config says "
            r"\[num_layers=2, num_slots=8\]",
        ),
        ((config, phy2log * 0, {"w": w}), ValueError, "layer 0 has no replica of expert 1"),
        ((config, phy2log + 0.5, {"w": w}), ValueError, "must hold integers"),
        (
            (dataclasses.asdict(config), phy2log, {"w": w}),
            TypeError,
            "config must be a HookConfig, got dict",
        ),
    ):
        with pytest.raises(error, match=words):
            RebalanceHook(*args, None, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="HookConfig.shape.num_layers must be an int, got str '2'"):
        dataclasses.replace(config, shape=dataclasses.replace(config.shape, num_layers="2"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="HookConfig.shape must be a ClusterShape, got dict"):
        dataclasses.replace(config, shape=dataclasses.asdict(config.shape))  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="HookConfig.link.address must be a non-empty str, got None"
    ):
        dataclasses.replace(config, link=Link(None, deployment="d"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="HookConfig.link must be a Link, got str"):
        dataclasses.replace(config, link="127.0.0.1:1")  # type: ignore[arg-type]
    numpy_layers = dataclasses.replace(config.shape, num_layers=np.int64(L))  # type: ignore[arg-type]
    assert dataclasses.replace(config, shape=numpy_layers).shape.num_layers == L  # ints too
    with pytest.raises(
        TypeError, match=r"agree_group must be a torch.distributed group .* got list"
    ):
        RebalanceHook(config, phy2log, {"w": w}, [0, 1], None)  # type: ignore[arg-type]
    hook = RebalanceHook(
        config, torch.from_numpy(phy2log), {"w": w}, None, None
    )  # a tensor map is fine
    assert hook.phy2log.dtype == np.int64 and hook.phy2log.shape == (L, P)
