"""The hook's windows across a commit: each carries the steps of one placement, its
counts per expert and per slot read with that placement's rows, never the next one's.

One rank of a gloo world of one (the hook's real agreement, plan driver, executor moving
weights into spare rows, dispatch and recorder); the agent is built, not started: the
windows are read from what it holds to send.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.placement import trivial_placement
from rebalancer.wire.shape import ClusterShape
from tests.unit.worker_hooks.test_hook_switching import E, L, P, prepare
from worker_hooks.hook import CommitConfig, HookConfig, Link, RebalanceHook, WindowConfig

SPARE = 2
STEPS_V0, STEPS_V1 = 3, 2


def _expected(
    picks: list[tuple[int, np.ndarray, np.ndarray]], row_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Logical [L, E] and per slot [L, P] counts of `picks` (layer, logical ids, rows
    they went to), the rows read as slots with `row_ids` (the placement they ran on)."""
    logical = np.zeros((L, E), dtype=np.int64)
    physical = np.zeros((L, P), dtype=np.int64)
    for layer, ids, rows in picks:
        np.add.at(logical[layer], ids.ravel(), 1)
        slot_of_row = {int(row): slot for slot, row in enumerate(row_ids[layer])}
        np.add.at(physical[layer], [slot_of_row[int(r)] for r in rows.ravel()], 1)
    return logical, physical


def test_a_commit_closes_the_window_of_the_placement_it_leaves(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        config = HookConfig(
            link=Link("127.0.0.1:1", deployment="d"),
            rank=0,
            shape=ClusterShape(
                num_layers=L, num_logical=E, num_slots=P, num_gpus=1, expert_bytes=0
            ),
            windows=WindowConfig(steps=10**6),
            commit=CommitConfig(agree_every=1, spare_rows=SPARE),
        )
        old = trivial_placement(L, E, P, 1)
        new = np.stack([np.roll(old[layer], 1) for layer in range(L)])
        weights = {"w": torch.arange(L * (P + SPARE), dtype=torch.float32).reshape(L, P + SPARE, 1)}
        hook = RebalanceHook(config, old, weights, dist.group.WORLD, dist.group.WORLD)
        rng = np.random.default_rng(0)
        runs: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {0: [], 1: []}
        row_ids = {0: hook.served.row_ids.copy()}

        def serve(steps: int) -> None:
            for _ in range(steps):
                version = hook.version
                for layer in range(L):
                    ids = rng.integers(0, E, size=(8, 2))
                    rows = hook.route(layer, torch.from_numpy(ids)).numpy()
                    runs[version].append((layer, ids, rows))
                hook.step_end()

        serve(STEPS_V0)
        hook.plans._prepare(prepare(1, 0, old, new))
        assert hook.stats.prepared == 1
        hook.plans.on_commit(1)
        while hook.version == 0:  # the agreement's result is read one step after it started
            serve(1)
        assert hook.stats.commits and hook.stats.commits[0][1] == 1
        row_ids[1] = hook.served.row_ids.copy()
        assert not np.array_equal(row_ids[0], row_ids[1])  # the plan moved rows: a map to get wrong
        serve(STEPS_V1)
        hook._close_window()
        windows = list(hook.agent._pending)
        assert [w.version for w in windows] == [0, 1]
        steps_v0 = len(runs[0]) // L
        assert (windows[0].first_step, windows[0].num_steps) == (0, steps_v0)
        assert (windows[1].first_step, windows[1].num_steps) == (steps_v0, len(runs[1]) // L)
        for window, version in zip(windows, (0, 1), strict=True):
            logical, physical = _expected(runs[version], row_ids[version])
            np.testing.assert_array_equal(
                window.logical, logical, err_msg=f"v{version}: counts per expert"
            )
            np.testing.assert_array_equal(
                window.physical, physical, err_msg=f"v{version}: counts per slot"
            )
    finally:
        dist.destroy_process_group()
