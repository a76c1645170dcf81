"""ReplicaDispatch on CPU: even spread, determinism, local preference, in-place swap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_hooks.dispatch import ReplicaDispatch, candidate_table

# 2 layers, 4 logical experts, 2 GPUs x 3 slots = 6 physical slots.
#   expert 0: slots 0 (rank 0) and 3 (rank 1)
#   expert 1: slot 1 (rank 0)
#   expert 2: slots 2 (rank 0), 4 and 5 (rank 1)
#   expert 3: no replica in layer 0 (degenerate), slot 5 in layer 1
LOG2PHY = np.array(
    [
        [[0, 3, -1], [1, -1, -1], [2, 4, 5], [-1, -1, -1]],
        [[0, 3, -1], [1, -1, -1], [2, 4, -1], [5, -1, -1]],
    ],
    dtype=np.int64,
)


def _owner(slot: torch.Tensor) -> torch.Tensor:
    return slot // 3


def test_output_is_a_replica_of_the_routed_expert() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(-1, 3, (257, 4), generator=gen)
    for rank in (0, 1):
        out = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=rank).dispatch(0, ids)
        assert out.shape == ids.shape and out.dtype == ids.dtype
        for e in range(3):
            assert set(out[ids == e].tolist()) <= set(LOG2PHY[0, e][LOG2PHY[0, e] >= 0].tolist())
        assert (out[ids == -1] == -1).all()


def test_local_replica_preferred() -> None:
    ids = torch.tensor([[0, 1, 2]] * 100)
    out0 = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=0).dispatch(1, ids)
    assert (out0[:, 0] == 0).all() and (out0[:, 1] == 1).all() and (out0[:, 2] == 2).all()
    out1 = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=1).dispatch(1, ids)
    assert (out1[:, 0] == 3).all() and (out1[:, 2] == 4).all()
    # Expert 1 has no replica on rank 1: the remote one is used.
    assert (out1[:, 1] == 1).all()


def test_spreads_evenly_over_replicas() -> None:
    # Expert 0 has 4 replicas on ranks 1-2, none on rank 0 (P = 9, 3 per GPU).
    log2phy = np.array([[[3, 4, 6, 8], [0, -1, -1, -1]]])
    disp = ReplicaDispatch(log2phy, num_gpus=3, rank=0)
    ids = torch.zeros(1000, 1, dtype=torch.int32)
    counts = np.bincount(disp.dispatch(0, ids).reshape(-1).numpy(), minlength=9)
    assert counts[[3, 4, 6, 8]].tolist() == [250, 250, 250, 250]
    # On rank 2 the two local replicas share the expert's tokens.
    counts2 = np.bincount(
        ReplicaDispatch(log2phy, num_gpus=3, rank=2).dispatch(0, ids).reshape(-1).numpy(),
        minlength=9,
    )
    assert counts2[[6, 8]].tolist() == [500, 500] and counts2.sum() == 1000


def test_local_preference_keeps_replica_loads_equal_with_uniform_sources() -> None:
    # 4 ranks, expert 0 replicated on ranks 0 and 2 (slots 0, 4); every rank sends
    # the same number of tokens: each replica must get half of the expert's load.
    log2phy = np.array([[[0, 4], [1, -1]]])
    total = np.zeros(8, dtype=np.int64)
    for rank in range(4):
        out = ReplicaDispatch(log2phy, num_gpus=4, rank=rank, num_physical=8).dispatch(
            0, torch.zeros(400, 1, dtype=torch.int64)
        )
        total += np.bincount(out.reshape(-1).numpy(), minlength=8)
    assert total[0] == total[4] == 800


def test_deterministic_per_token() -> None:
    disp = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=1)
    ids = torch.randint(0, 3, (64, 8), generator=torch.Generator().manual_seed(1))
    first = disp.dispatch(0, ids)
    assert torch.equal(first, disp.dispatch(0, ids))
    assert torch.equal(first, ReplicaDispatch(LOG2PHY, num_gpus=2, rank=1).dispatch(0, ids))
    # A token's choice depends on its row, not on the other rows of the batch.
    assert torch.equal(first[:10], disp.dispatch(0, ids[:10]))


def test_expert_without_replica_maps_to_minus_one() -> None:
    out = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=0).dispatch(0, torch.tensor([[3, 0]]))
    assert out.tolist() == [[-1, 0]]


def test_int32_and_shapes() -> None:
    disp = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=0)
    ids = torch.tensor([[[0, 1], [2, -1]]], dtype=torch.int32)
    out = disp.dispatch(1, ids)
    assert out.dtype == torch.int32 and out.shape == ids.shape
    assert out.tolist() == [[[0, 1], [2, -1]]]


def test_update_in_place_keeps_storage_and_changes_routing() -> None:
    disp = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=0, max_replicas=4)
    ptrs = disp.table.data_ptr(), disp.log2phy.data_ptr()
    ids = torch.tensor([[0, 1, 2]] * 8)
    before = disp.dispatch(1, ids)
    assert (before == torch.tensor([0, 1, 2])).all()
    # New placement: experts 0 and 1 swap slots; expert 2 moves wholly to rank 1.
    new = LOG2PHY.copy()
    new[1] = [[1, -1, -1], [0, 3, -1], [4, 5, -1], [2, -1, -1]]
    disp.update_(torch.from_numpy(new))
    assert (disp.table.data_ptr(), disp.log2phy.data_ptr()) == ptrs
    after = disp.dispatch(1, ids)
    assert (after[:, 0] == 1).all() and (after[:, 1] == 0).all()
    assert sorted(set(after[:, 2].tolist())) == [4, 5]
    assert disp.log2phy[1, 2].tolist() == [4, 5, -1, -1]
    # Layer 0 is unchanged.
    assert torch.equal(disp.dispatch(0, ids), ReplicaDispatch(LOG2PHY, 2, 0).dispatch(0, ids))


def test_stage_then_commit() -> None:
    disp = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=0)
    ids = torch.tensor([[1]])
    new = LOG2PHY.copy()
    new[0, 1] = [5, -1, -1]
    disp.stage(new)
    assert disp.dispatch(0, ids).item() == 1  # not live before commit
    disp.commit()
    assert disp.dispatch(0, ids).item() == 5
    with pytest.raises(RuntimeError):
        disp.commit()


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 5, 3), dtype=np.int64),  # wrong E
        np.zeros((3, 4, 3), dtype=np.int64),  # wrong L
        np.full((2, 4, 3), 6, dtype=np.int64),  # slot out of range
        np.full((2, 4, 3), -2, dtype=np.int64),
        np.zeros((2, 4), dtype=np.int64),
        np.zeros((2, 4, 3), dtype=np.float32),
    ],
)
def test_bad_update_changes_nothing(bad: np.ndarray) -> None:
    disp = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=0)
    table = disp.table.clone()
    with pytest.raises(ValueError):
        disp.update_(bad)
    assert torch.equal(disp.table, table)


def test_more_replicas_than_max_rejected_padding_accepted() -> None:
    disp = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=0)
    with pytest.raises(ValueError, match="max_replicas"):
        disp.update_(np.concatenate([LOG2PHY, np.full((2, 4, 1), 5)], axis=2))
    disp.update_(np.concatenate([LOG2PHY, np.full((2, 4, 2), -1)], axis=2))
    narrow = LOG2PHY[:, :, :2].copy()
    narrow[0, 2] = [4, -1]
    disp.update_(narrow)
    assert disp.dispatch(0, torch.tensor([[2]])).item() == 4


def test_layer_index_checked() -> None:
    disp = ReplicaDispatch(LOG2PHY, num_gpus=2, rank=0)
    with pytest.raises(ValueError):
        disp.dispatch(2, torch.tensor([[0]]))


def test_num_physical_default_and_check() -> None:
    assert ReplicaDispatch(LOG2PHY, num_gpus=2, rank=0).num_physical == 6
    with pytest.raises(ValueError):
        ReplicaDispatch(LOG2PHY, num_gpus=4, rank=0, num_physical=6)


def test_candidate_table_columns() -> None:
    table = candidate_table(LOG2PHY, num_physical=6, num_gpus=2, rank=1, max_replicas=3)
    assert table[0, 2].tolist() == [2, 4, 5, -1]  # two local replicas on rank 1
    assert table[0, 1].tolist() == [1, 1, -1, -1]  # remote only
    assert table[0, 3].tolist() == [1, -1, -1, -1]  # none: one candidate, -1
