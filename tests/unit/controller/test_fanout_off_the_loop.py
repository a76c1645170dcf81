"""Issue 32's lean loop: a contingency set's messages are encoded once for all the sessions
told (not once per session), and an ingest cursor saved in the background is packed by the
writer thread, the loop only taking a snapshot."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from rebalancer.controller import service
from rebalancer.controller import store as store_module
from rebalancer.controller.contingency import Loss, Told
from rebalancer.controller.store import Store


def _loss(rank: int) -> Loss:
    return Loss("rank", (rank,), 0.9, 3, 0, 0, np.arange(12, dtype=np.int64).reshape(2, 6) % 4)


def test_a_planned_loss_is_encoded_once_for_every_session(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    real = service.planned_loss_msg

    def counted(*args, **kw):  # type: ignore[no-untyped-def]
        made.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(service, "planned_loss_msg", counted)
    told = [Told(3, _loss(r), 2) for r in range(2)]
    per_session = [[service.controller_message("planned_loss", t) for t in told] for _ in range(4)]
    assert len(made) == 2  # one per loss, not per session
    for msgs in per_session:
        assert [m.planned_loss.lost_ranks for m in msgs] == [[0], [1]]
        assert all(m.planned_loss.base_version == 3 and m.planned_loss.set_size == 2 for m in msgs)
    # An equal payload of another set is a new message (the cache holds payload objects).
    again = service.controller_message("planned_loss", Told(4, told[0].loss, 2))
    assert again.planned_loss.base_version == 4 and len(made) == 3


def test_a_background_cursor_save_is_packed_by_the_writer_thread(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    packed_on = []
    real = store_module._ingest_row

    def recorded(state):  # type: ignore[no-untyped-def]
        packed_on.append(threading.current_thread().name)
        return real(state)

    monkeypatch.setattr(store_module, "_ingest_row", recorded)
    store = Store(tmp_path / "s.sqlite")
    live = np.ones((3, 4))
    store.save_ingest_state("d", {"next_seq": {"0": 7}, "estimator": {"weighted_sum": live,
                                                                      "recent": [live]}}, background=True)
    live += 1  # the next fold changes the live arrays in place: the save keeps the snapshot
    store.flush_ingest_states()
    assert packed_on == ["cursor-writer"]
    saved = store.ingest_state("d")
    assert saved is not None and saved["next_seq"] == {"0": 7}
    np.testing.assert_array_equal(saved["estimator"]["weighted_sum"], np.ones((3, 4)))
    np.testing.assert_array_equal(saved["estimator"]["recent"][0], np.ones((3, 4)))
    store.close()
