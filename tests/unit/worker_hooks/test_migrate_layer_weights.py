"""MigrationExecutor on per-layer weights (`LayerWeights`: an engine's own tensors, one per
layer, as SGLang holds them): prepare stages, commit writes the staged rows in place,
abort leaves the live weights untouched. One rank here; the 4-rank path runs in
tests/engines/sglang (the SGLang adapter's staged update)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_hooks.config import MigrationConfig
from worker_hooks.migration import MigrationExecutor

SLOTS = 4
LAYERS = (1, 3)  # sparse: layers 0 and 2 hold no routed experts (dense layers)


def weights() -> dict[str, dict[int, torch.Tensor]]:
    """Row s of layer l holds the value 10 * l + s (w13 bf16, w2 float32: dtypes differ)."""
    return {
        "w13": {
            layer: torch.arange(SLOTS, dtype=torch.bfloat16)[:, None, None]
            .expand(SLOTS, 4, 3)
            .clone()
            + 10 * layer
            for layer in LAYERS
        },
        "w2": {
            layer: torch.arange(SLOTS, dtype=torch.float32)[:, None].expand(SLOTS, 5).clone()
            + 10 * layer
            for layer in LAYERS
        },
    }


def values(w: dict[str, dict[int, torch.Tensor]], name: str, layer: int) -> list[float]:
    return [float(w[name][layer][s].flatten()[0]) for s in range(SLOTS)]


# Layer 1: slot 0 <- slot 2, slot 2 <- slot 0; layer 3: slot 3 <- slot 1.
MOVES = np.array([[1, 0, 0, 0, 2], [1, 0, 2, 0, 0], [3, 0, 3, 0, 1]])


def test_commit_writes_each_staged_row_into_its_layer_tensor_in_place() -> None:
    w = weights()
    storage = {name: {layer: t.data_ptr() for layer, t in per.items()} for name, per in w.items()}
    executor = MigrationExecutor(0, 1, w, None, MigrationConfig(transport="p2p"))
    stats = executor.prepare(1, MOVES)
    assert stats.experts_received == 3
    assert values(w, "w2", 1) == [10, 11, 12, 13]  # staged only: nothing live changed
    assert executor.commit(1) == 3
    for name in w:
        assert values(w, name, 1) == [12, 11, 10, 13]
        assert values(w, name, 3) == [30, 31, 32, 31]
    assert {
        name: {layer: t.data_ptr() for layer, t in per.items()} for name, per in w.items()
    } == storage


def test_abort_drops_the_staging_and_changes_nothing() -> None:
    w = weights()
    executor = MigrationExecutor(0, 1, w, None)
    executor.prepare(1, MOVES)
    executor.abort(1)
    with pytest.raises(RuntimeError, match="commit of v1 but staged is vNone"):
        executor.commit(1)
    assert values(w, "w13", 1) == [10, 11, 12, 13] and values(w, "w2", 3) == [30, 31, 32, 33]


def test_a_layer_without_weights_and_peer_memory_transports_are_refused() -> None:
    with pytest.raises(ValueError, match="layers that hold no expert weights"):
        MigrationExecutor(0, 1, weights(), None).prepare(1, np.array([[2, 0, 0, 0, 1]]))
    with pytest.raises(ValueError, match="per-layer weights move with 'p2p'"):
        MigrationExecutor(0, 1, weights(), None, MigrationConfig(transport="ipc"))
    bad = weights()
    bad["w2"][3] = torch.zeros(SLOTS + 1, 5)
    with pytest.raises(ValueError, match="weight 'w2' of layer 3"):
        MigrationExecutor(0, 1, bad, None)


def test_a_plan_with_nothing_for_this_rank_stages_and_commits_nothing() -> None:
    """A layer group in which a rank gains no expert (its peers do): an empty staging,
    an empty commit (regression: the run split failed on an empty list)."""
    w = weights()
    executor = MigrationExecutor(0, 1, w, None)
    assert executor.prepare(1, np.zeros((0, 5), dtype=np.int64)).experts_received == 0
    assert executor.commit(1) == 0
    assert values(w, "w2", 1) == [10, 11, 12, 13]
