"""The one window merge of ranks, sidecars and the controller (rebalancer.wire.windows), and
the bounded buffer of agents and sidecars (invariant 3: merged, never queued unbounded; and
no count lost or counted twice on the way)."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.errors import StateError
from rebalancer.wire.windows import BoundedWindows, CountWindow, SeqMerger

L, E, P = 2, 3, 4


def counts(value: int, shape: tuple[int, int] = (L, E)) -> np.ndarray:
    return np.full(shape, value, dtype=np.uint32)


def add(
    m: SeqMerger, rank: int, seq: int, value: int = 1, physical: bool = True, version: int = 0
) -> bool:
    phys = counts(value, (L, P)) if physical else None
    return m.add(rank, seq, counts(value), phys, seq * 4, 4, version)


def test_windows_of_one_seq_are_summed_and_released_once_every_rank_sent() -> None:
    m = SeqMerger((0, 1, 2))
    for r in (0, 1, 2):
        assert m.cursor(r) == 0
    add(m, 0, 0, 1)
    add(m, 1, 0, 2)
    assert list(m.ready()) == []  # rank 2 not in yet
    add(m, 2, 0, 4)
    (w,) = list(m.ready())
    assert w.ranks == {0, 1, 2} and w.parts == 3
    assert (w.logical == 7).all() and w.physical is not None and (w.physical == 7).all()
    assert (w.first_step, w.num_steps) == (0, 4)
    assert m.open_windows == 0


def test_a_lagging_rank_does_not_hold_the_others_back_and_its_late_counts_are_kept() -> None:
    m = SeqMerger((0, 1), fold_lag=2)
    for r in (0, 1):
        m.cursor(r)
    released: list[CountWindow] = []
    for seq in range(3):  # rank 1 silent: seq 0 goes once rank 0 is 2 ahead
        add(m, 0, seq)
        released += m.ready()
    assert [w.ranks for w in released] == [{0}]
    add(m, 1, 0, 5)  # rank 1's seq 0 arrives after it was released: counted in the oldest open
    released += m.ready()
    released += m.flush()
    total = sum(int(w.logical.sum()) for w in released)
    assert total == (3 * 1 + 5) * L * E  # nothing lost, nothing twice


def test_resent_window_is_dropped_and_a_gap_refused() -> None:
    m = SeqMerger((0,))
    m.cursor(0)
    assert add(m, 0, 0)
    assert not add(m, 0, 0)  # resent after a reconnect
    with pytest.raises(StateError) as info:
        add(m, 0, 5)
    assert info.value.code == "FAILED_PRECONDITION" and "expected 1" in str(info.value)
    with pytest.raises(StateError):
        add(m, 7, 0)  # not one of the pod's ranks


def test_a_rank_registering_late_starts_at_the_pods_newest_seq() -> None:
    m = SeqMerger((0, 1))
    assert m.cursor(0) == 0
    for seq in range(3):
        add(m, 0, seq)
    assert m.cursor(1) == 3  # aligned with rank 0's next window
    assert m.cursor(1) == 3  # and fixed from then on
    add(m, 0, 3)
    assert m.cursor(1) == 3
    add(m, 1, 3)
    out = [*m.ready(), *m.flush()]
    assert [sorted(w.ranks) for w in out] == [[0], [0], [0], [0, 1]]  # seq 3: both ranks


def test_physical_counts_only_when_every_part_had_them() -> None:
    m = SeqMerger((0, 1))
    add(m, 0, 0, physical=True)
    add(m, 1, 0, physical=False)
    (w,) = list(m.ready())
    assert w.physical is None and (w.logical == 2).all()


def test_buffer_stays_bounded_and_keeps_every_count() -> None:
    buf = BoundedWindows(limit=8)
    n = 1000
    for i in range(n):
        buf.push(
            CountWindow(
                i,
                i * 4,
                4,
                i // 100,
                np.full((L, E), i, np.int64),
                np.ones((L, P), np.int64),
                {0},
                1,
            )
        )
        assert len(buf) <= 8
    assert buf.merged == n - 8
    windows = buf.take()
    assert len(windows) == 8 and len(buf) == 0
    assert sum(int(w.logical.sum()) for w in windows) == L * E * sum(range(n))
    assert sum(w.num_steps for w in windows) == 4 * n
    assert windows[0].first_step == 0  # the oldest window keeps its start
    assert windows[-1].version == (n - 1) // 100
    assert sum(int(w.physical.sum()) for w in windows if w.physical is not None) == n * L * P


def test_buffer_limit_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BoundedWindows(0)


def test_a_group_window_covers_each_of_its_ranks_and_resumes_after_the_highest_cursor() -> None:
    """A sidecar's group session sends one window for all its ranks, already summed."""
    m = SeqMerger(range(4), dtype=np.float64)
    assert m.add({0, 1}, 0, counts(2), None)
    assert m.add({2, 3}, 0, counts(2), None)
    (w,) = list(m.ready())
    assert w.ranks == {0, 1, 2, 3} and w.logical.dtype == np.float64 and (w.logical == 4).all()
    assert m.expected({0, 1}) == 1
    m.restore({0: 5, 1: 4, 2: 1, 3: 1})
    assert not m.add({0, 1}, 4, counts(1), None)  # below rank 0's cursor: counted before
    assert m.add({0, 1}, 5, counts(1), None)
    with pytest.raises(StateError, match="expected 1") as info:
        m.add({2, 3}, 3, counts(1), None)
    assert info.value.code == "FAILED_PRECONDITION"


def test_a_rank_outside_the_group_is_refused_and_changes_nothing() -> None:
    m = SeqMerger((0, 1))
    with pytest.raises(StateError, match="rank 7 is not one of the 2 ranks") as info:
        m.add({0, 7}, 0, counts(1), None)
    assert info.value.code == "INVALID_ARGUMENT"
    assert m.next_seq == {} and m.open_windows == 0


def test_a_merged_window_spanning_a_switch_keeps_the_gpus_load() -> None:
    """Slots keep their GPU across versions, so dispatched counts of v0 and v1 add up."""
    buf = BoundedWindows(limit=1)
    for version in (0, 1):
        buf.push(
            CountWindow(version, version * 4, 4, version, counts(1), counts(1, (L, P)), {0}, 1)
        )
    (w,) = buf.take()
    assert (
        w.version == 1 and w.num_steps == 8 and w.physical is not None and (w.physical == 2).all()
    )


def test_a_rank_far_behind_still_has_every_window_released() -> None:
    """Rank 1 sends its three windows only after rank 0 sent all of its: the late parts
    are counted in the oldest open window without standing in for rank 1's own window
    of that seq, so every window is released and nothing waits for ever (the controller
    has no flush)."""
    m = SeqMerger((0, 1), fold_lag=2)
    released: list[CountWindow] = []
    for seq in range(3):
        add(m, 0, seq)
        released += m.ready()
    for seq in range(3):
        add(m, 1, seq)
        released += m.ready()
    assert m.open_windows == 0
    assert sum(int(w.logical.sum()) for w in released) == 6 * L * E
