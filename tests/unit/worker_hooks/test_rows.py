"""RowMap: the deterministic rule that puts incoming experts into free rows."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.placement import transfers, trivial_placement
from rebalancer.wire.layout import DST_RANK, DST_SLOT, LAYER, SRC_RANK, SRC_SLOT
from worker_hooks.rows import RowMap

L, E, P, G = 4, 8, 12, 3
S = P // G


def _plan_moves(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    old = trivial_placement(L, E, P, G)
    new = np.stack([rng.permutation(old[layer]) for layer in range(L)])
    return transfers(old, new, G, 1)


def _fresh(rows: RowMap, after: np.ndarray, moves: np.ndarray) -> np.ndarray:
    """Per transfer row: does its expert get a free row (its slot's row changes)?"""
    at = (moves[:, DST_RANK], moves[:, LAYER], moves[:, DST_SLOT])
    return after[at] != rows.rows[at]


def test_without_spare_rows_nothing_moves_rows() -> None:
    rows = RowMap(G, L, S)
    after = rows.plan(_plan_moves(0))
    np.testing.assert_array_equal(after, rows.rows)
    np.testing.assert_array_equal(rows.row_ids(), np.broadcast_to(np.arange(P), (L, P)))


def test_incoming_experts_take_free_rows_then_fall_back() -> None:
    moves = _plan_moves(1)
    per_dest = np.bincount(moves[:, DST_RANK] * L + moves[:, LAYER], minlength=G * L)
    spare = 2
    rows = RowMap(G, L, S, spare)
    after = rows.plan(moves)
    fresh = _fresh(rows, after, moves)
    # Each (rank, layer) gives free rows to its first `spare` destinations in the order
    # of their sources (rank, then row: identity rows here, so slot).
    assert fresh.sum() == np.minimum(per_dest, spare).sum()
    for rank in range(G):
        for layer in range(L):
            mine = (moves[:, DST_RANK] == rank) & (moves[:, LAYER] == layer)
            by_source = np.flatnonzero(mine)[
                np.lexsort((moves[mine, SRC_SLOT], moves[mine, SRC_RANK]))
            ]
            np.testing.assert_array_equal(np.flatnonzero(mine & fresh), np.sort(by_source[:spare]))
            fresh_slots = np.sort(moves[mine & fresh, DST_SLOT])
            # Free rows go out in row order along the sources.
            got_rows = after[rank, layer, moves[by_source[:spare], DST_SLOT]]
            assert (np.diff(got_rows) > 0).all()
            # Rows stay a permutation-free assignment: distinct, in range.
            got = after[rank, layer]
            assert len(set(got.tolist())) == S and got.max() < S + spare
            # Fresh destinations moved to rows nobody used before.
            assert set(got[fresh_slots].tolist()) <= set(range(S, S + spare))
            unchanged = np.setdiff1d(np.arange(S), fresh_slots)
            np.testing.assert_array_equal(got[unchanged], rows.rows[rank, layer, unchanged])


def test_rows_chain_over_plans_and_ids_follow() -> None:
    rows = RowMap(G, L, S, S)  # as many spare rows as slots: every move finds a free row
    for seed in range(3):
        moves = _plan_moves(seed)
        after = rows.plan(moves)
        assert _fresh(rows, after, moves).all()
        before = rows.rows
        rows.switch(after)
        changed = np.zeros((G, L, S), dtype=bool)
        changed[moves[:, DST_RANK], moves[:, LAYER], moves[:, DST_SLOT]] = True
        assert (rows.rows[changed] != before[changed]).all()
        assert (rows.rows[~changed] == before[~changed]).all()
    ids = rows.row_ids()
    for rank in range(G):
        np.testing.assert_array_equal(
            ids[:, rank * S : (rank + 1) * S], rank * 2 * S + rows.rows[rank]
        )


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="spare_rows >= 0"):
        RowMap(G, L, S, -1)
    with pytest.raises(ValueError, match="positive"):
        RowMap(0, L, S)


def test_rows_change_only_through_switch() -> None:
    """The rows are read by dispatch and moved by the executor alone: a write anywhere
    else (the hook once reassigned them, the executor moved the shared map unseen) fails
    loudly instead of leaving this rank's rows apart from its peers'."""
    rows = RowMap(G, L, S, 1)
    with pytest.raises(ValueError, match="read-only"):
        rows.rows[0, 0, 0] = S
    with pytest.raises(AttributeError):
        rows.rows = rows.rows.copy()  # type: ignore[misc]
    moved = rows.rows.copy()
    moved[0, 0, 0] = S
    rows.switch(moved)
    assert rows.rows[0, 0, 0] == S and not rows.rows.flags.writeable
    moved[0, 0, 0] = 0  # the caller's array is copied, not kept
    assert rows.rows[0, 0, 0] == S
    with pytest.raises(ValueError, match=r"rows of shape \[1, 2\]"):
        rows.switch(np.zeros((1, 2), dtype=np.int64))
