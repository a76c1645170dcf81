"""Issue 32's lean loop: a contingency set's messages are encoded once for all the sessions
told (not once per session), and an ingest cursor is packed with each array copied once,
straight into the blob, in the format stores already hold."""

from __future__ import annotations

import json
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


def test_a_cursor_is_packed_in_one_copy_in_the_format_stores_hold(tmp_path: Path) -> None:
    arrays = {
        "a0": np.random.default_rng(0).random((58, 256)),
        "a1": np.arange(7, dtype=np.int64),
        "a2": np.zeros((0, 3), np.float32),
        "a3": np.arange(6, dtype=">i4").reshape(2, 3),
    }
    # The format as stores written before hold it: each array's little-endian bytes joined.
    header = json.dumps(
        [[k, a.dtype.newbyteorder("<").str, list(a.shape)] for k, a in arrays.items()]
    ).encode()
    older = b"".join(
        [
            store_module._RAW_MAGIC,
            len(header).to_bytes(4, "little"),
            header,
            *(
                np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes()
                for a in arrays.values()
            ),
        ]
    )
    assert bytes(store_module._pack_arrays(arrays)) == older
    back = store_module._unpack_arrays(store_module._pack_arrays(arrays))
    for k, a in arrays.items():
        np.testing.assert_array_equal(back[k], a)

    store = Store(tmp_path / "s.sqlite")
    live = np.ones((3, 4))
    store.save_ingest_state(
        "d",
        {"next_seq": {"0": 7}, "estimator": {"weighted_sum": live, "recent": [live]}},
        background=True,
    )
    live += 1  # the next fold changes the live arrays in place: the save keeps the snapshot
    pending = store.ingest_state("d")  # read back whether written yet or not
    store.flush_ingest_states()
    saved = store.ingest_state("d")
    for got in (pending, saved):
        assert got is not None and got["next_seq"] == {"0": 7}
        np.testing.assert_array_equal(got["estimator"]["weighted_sum"], np.ones((3, 4)))
        np.testing.assert_array_equal(got["estimator"]["recent"][0], np.ones((3, 4)))
    store.close()
