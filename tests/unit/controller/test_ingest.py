"""WindowMerger: windows summed per sequence number, each counted once, released in order."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.controller.errors import StateError
from rebalancer.controller.ingest import WindowMerger


def counts(value: int) -> np.ndarray:
    return np.full((2, 3), value, dtype=np.uint32)


def test_complete_windows_fold_in_order_with_the_sum_of_ranks() -> None:
    m = WindowMerger(num_ranks=3)
    for rank in range(3):
        assert m.add(rank, 0, counts(rank + 1), None)
        assert m.add(rank, 1, counts(10), counts(1)[:, :2])
        if rank < 2:
            assert list(m.ready()) == []
    released = list(m.ready())
    assert [w.seq for w in released] == [0, 1]
    np.testing.assert_array_equal(released[0].logical, np.full((2, 3), 6.0))
    assert released[0].physical is None and released[1].physical is not None
    np.testing.assert_array_equal(released[1].physical, np.full((2, 2), 3.0))


def test_duplicates_are_counted_once_and_gaps_refused() -> None:
    m = WindowMerger(num_ranks=1)
    assert m.add(0, 0, counts(1), None)
    assert not m.add(0, 0, counts(1), None)  # the caller counts it as a duplicate
    with pytest.raises(StateError, match="expected 1") as info:
        m.add(0, 3, counts(1), None)
    assert info.value.code == "FAILED_PRECONDITION"
    assert m.next_seq == {0: 1}
    assert sum(w.logical.sum() for w in m.ready()) == 6  # the duplicate was not added


def test_a_lagging_rank_does_not_hold_the_others() -> None:
    m = WindowMerger(num_ranks=2, fold_lag=2)
    for seq in range(3):
        m.add(0, seq, counts(1), None)  # rank 1 is silent
    released = list(m.ready())
    assert [w.seq for w in released] == [0] and released[0].ranks == {0}


def test_restore_resumes_after_the_saved_cursor() -> None:
    m = WindowMerger(num_ranks=2)
    m.restore({0: 5, 1: 4})
    assert not m.add(0, 4, counts(1), None)
    assert m.add(1, 4, counts(1), None)
    assert m.newest_seq == 4
