"""The ingest cursor and the contingency set written by the store's writer thread
(row_writer.py): a newer save is never overwritten by an older one, a save not yet
written reads back, one deployment's rows of the two tables stay apart, closing writes
what is pending, and a store that refuses writes is counted, not raised."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rebalancer.controller.store import Store


def _state(seq: int) -> dict:
    return {"next_seq": {"0": seq}, "estimator": {"weighted_sum": np.full((3, 4), float(seq))}}


def held_writer(store: Store, seen: list[dict] | None = None) -> threading.Event:
    """Hold the store's writer thread before each transaction until the returned event is
    set (appending each transaction's rows to `seen`, if given)."""
    writer = store._writer
    assert writer is not None
    gate = threading.Event()
    original = writer._write

    def held(db, rows):  # type: ignore[no-untyped-def]
        gate.wait(10)
        if seen is not None:
            seen.append(dict(rows))
        original(db, rows)

    writer._write = held  # type: ignore[method-assign]
    return gate


def test_background_saves_land_in_order_and_close_writes_the_rest(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    for seq in range(200):
        store.save_ingest_state(f"d{seq % 7}", _state(seq), background=True)
    store.close()
    again = Store(tmp_path / "s.sqlite")
    for k in range(7):
        last = max(s for s in range(200) if s % 7 == k)
        saved = again.ingest_state(f"d{k}")
        assert saved is not None and saved["next_seq"] == {"0": last}
        np.testing.assert_array_equal(
            saved["estimator"]["weighted_sum"], np.full((3, 4), float(last))
        )
    again.close()


def test_the_saved_arrays_are_a_snapshot(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    live = np.zeros((2, 2))
    store.save_ingest_state("d", {"estimator": {"weighted_sum": live}}, background=True)
    live += 5  # the next fold changes the live estimate in place
    store.flush_ingest_states()
    saved = store.ingest_state("d")
    assert saved is not None and float(saved["estimator"]["weighted_sum"].sum()) == 0.0
    store.close()


def test_a_pending_save_reads_back_before_it_is_written(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.save_ingest_state("d", _state(1), background=True)
    store.flush_ingest_states()
    gate = held_writer(store)
    store.save_ingest_state("d", _state(2), background=True)
    saved = store.ingest_state("d")
    assert saved is not None and saved["next_seq"] == {"0": 2}
    gate.set()
    store.close()
    again = Store(tmp_path / "s.sqlite")
    assert again.ingest_state("d")["next_seq"] == {"0": 2}  # type: ignore[index]
    again.close()


def test_an_in_line_save_after_background_ones_is_not_overwritten(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    for seq in range(50):
        store.save_ingest_state("d", _state(seq), background=True)
    store.save_ingest_state("d", _state(99))  # the drain path: in line, after the rest
    raw = Store(tmp_path / "s.sqlite")  # another reader sees it written already
    assert raw.ingest_state("d")["next_seq"] == {"0": 99}  # type: ignore[index]
    raw.close()
    store.close()


def test_refused_writes_are_counted_and_the_next_save_retries(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.save_ingest_state("d", _state(1), background=True)
    store.flush_ingest_states()
    errors_before = store.errors
    # Another connection holds the write lock longer than the writer waits for it.
    blocker = sqlite3.connect(tmp_path / "s.sqlite", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    writer = store._writer
    assert writer is not None
    db = writer._connect(str(tmp_path / "s.sqlite"), 0.05)  # a short wait, then refused
    writer._write(db, {("ingest_state", "d"): ("{}", b"")})
    db.close()
    blocker.execute("ROLLBACK")
    blocker.close()
    assert store.errors == errors_before + 1
    store.save_ingest_state("d", _state(3), background=True)
    store.flush_ingest_states()
    assert store.ingest_state("d")["next_seq"] == {"0": 3}  # type: ignore[index]
    store.close()


def test_the_writer_thread_ends_when_idle_and_a_later_save_starts_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store dropped without close() leaves no thread: the writer ends after its idle
    time, and the next save is still written (by a new thread)."""
    from rebalancer.controller import row_writer

    monkeypatch.setattr(row_writer, "IDLE_SECONDS", 0.05)
    store = Store(tmp_path / "s.sqlite")
    store.save_ingest_state("d", _state(1), background=True)
    writer = store._writer
    assert writer is not None
    first = writer._thread
    assert first is not None
    first.join(10)
    assert not first.is_alive() and writer._thread is None
    store.save_ingest_state("d", _state(2), background=True)
    assert writer._thread is not None and writer._thread is not first
    assert writer.flush(10)
    again = Store(tmp_path / "s.sqlite")
    saved = again.ingest_state("d")
    assert saved is not None and saved["next_seq"] == {"0": 2}
    again.close()
    store.close()
    assert writer._thread is None


def test_a_contingency_set_is_written_off_the_caller_and_beside_its_cursor(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.save_ingest_state("d", _state(1), background=True)
    store.flush_ingest_states()
    # Another connection holds the write lock for 2 s: a save made in line would wait it out.
    blocker = sqlite3.connect(tmp_path / "s.sqlite", isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")
    release = threading.Timer(2.0, blocker.execute, ("ROLLBACK",))
    release.start()
    try:
        survivors = {"loss0": np.arange(12, dtype=np.int32).reshape(3, 4)}
        t0 = time.monotonic()
        store.save_contingency("d", {"base_version": 7}, survivors)
        store.save_ingest_state("d", _state(2), background=True)  # the same deployment's
        assert time.monotonic() - t0 < 1.0  # the caller (the event loop) did not wait
        pending = store.contingency("d")
        assert pending is not None and pending[0] == {"base_version": 7}
        np.testing.assert_array_equal(pending[1]["loss0"], survivors["loss0"])
        assert store.ingest_state("d")["next_seq"] == {"0": 2}  # type: ignore[index]
    finally:
        release.join()
        blocker.close()
    store.close()
    again = Store(tmp_path / "s.sqlite")
    written = again.contingency("d")
    assert written is not None and written[0] == {"base_version": 7}
    np.testing.assert_array_equal(written[1]["loss0"], survivors["loss0"])
    assert again.ingest_state("d")["next_seq"] == {"0": 2}  # type: ignore[index]
    again.close()


def test_the_writer_refuses_a_table_it_does_not_write(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.save_ingest_state("d", _state(1), background=True)
    writer = store._writer
    assert writer is not None
    with pytest.raises(ValueError, match="not 'plans'"):
        writer.put("plans", "d", ("{}", b""))  # type: ignore[arg-type]
    store.close()


def test_rows_are_written_in_batches_that_release_the_write_lock(tmp_path: Path) -> None:
    """Many pending rows go in transactions of about BATCH_BYTES each, oldest first, so a
    write of the event loop's waits for one batch, not for every pending row."""
    from rebalancer.controller import row_writer

    store = Store(tmp_path / "s.sqlite")
    store.save_ingest_state("d0", _state(0), background=True)
    store.flush_ingest_states()
    seen: list[dict] = []  # per transaction: its rows
    gate = held_writer(store, seen)
    big = {"next_seq": {"0": 1}, "estimator": {"weighted_sum": np.zeros((256, 256))}}  # 512 kB
    for k in range(10):
        store.save_ingest_state(f"d{k}", big, background=True)
    store.save_ingest_state("d3", _state(7), background=True)  # a newer row replaces a pending one
    gate.set()
    store.flush_ingest_states()
    # per transaction: (deployment, row bytes)
    batches = [[(name, len(doc) + len(blob)) for (_, name), (doc, blob) in r.items()] for r in seen]
    assert len(batches) >= 4  # 5 MB of rows: not one transaction
    for batch in batches:  # each stops at the row that reaches BATCH_BYTES
        assert sum(size for _, size in batch[:-1]) < row_writer.BATCH_BYTES
    written = [name for batch in batches for name, _ in batch]
    assert sorted(written[-10:]) == sorted(f"d{k}" for k in range(10))
    assert store.ingest_state("d3")["next_seq"] == {"0": 7}  # type: ignore[index]
    store.close()


def shared_rows(path: Path) -> list[str]:
    db = sqlite3.connect(path)
    try:
        return sorted(d for (d,) in db.execute("SELECT digest FROM contingency_arrays"))
    finally:
        db.close()


def test_members_rows_name_one_stored_copy_of_shared_arrays(tmp_path: Path) -> None:
    """A replica pool's members store their shared contingency set once: each row names the
    arrays by digest, a restart reads every member's set back, the arrays go once no row
    names them, and arrays no row names at start (a stop between a row and the removal)
    are removed then."""
    from rebalancer.controller.store import pack_arrays

    path = tmp_path / "s.sqlite"
    store = Store(path)
    store.save_ingest_state("a", _state(1), background=True)  # the writer thread runs
    first = pack_arrays({"loss0": np.arange(12, dtype=np.int32).reshape(3, 4)})
    second = pack_arrays({"loss0": np.arange(12, 24, dtype=np.int32).reshape(3, 4)})
    assert first.digest != second.digest
    for name in ("a", "b", "c"):
        store.save_contingency(name, {"base_version": 1}, first)
    store.flush_ingest_states()
    assert shared_rows(path) == [first.digest]
    for name in ("a", "b"):  # two members move on; c's row still names the first arrays
        store.save_contingency(name, {"base_version": 2}, second)
    own = {"loss0": np.full((3, 4), 5, dtype=np.int32)}
    store.save_contingency("c", {"base_version": 2}, own)  # c diverged: a set of its own
    store.drop_contingency_arrays(first.digest)  # after c's row, which no longer names it
    for name in ("a", "b"):  # read while pending: the arrays they name resolve too
        got = store.contingency(name)
        assert got is not None and got[0] == {"base_version": 2}
        assert int(got[1]["loss0"].flat[0]) == 12
    store.flush_ingest_states()
    assert shared_rows(path) == [second.digest]
    store.close()

    again = Store(path)
    assert again.shared_contingency() == {"a": second.digest, "b": second.digest}
    for name, want in (("a", 12), ("b", 12), ("c", 5)):
        got = again.contingency(name)
        assert got is not None and got[0] == {"base_version": 2}
        assert int(got[1]["loss0"].flat[0]) == want
    # Arrays no row names (their removal never written) go at the next start.
    again.save_contingency("a", {"base_version": 3}, first)
    again.save_contingency("a", {"base_version": 4}, own)
    again.close()
    assert shared_rows(path) == sorted([first.digest, second.digest])
    last = Store(path)
    assert last.shared_contingency() == {"b": second.digest}
    last.close()
    assert shared_rows(path) == [second.digest]


def test_a_removal_is_written_after_every_row_handed_over_before_it(tmp_path: Path) -> None:
    """A row handed over again goes last in line, and a removal ends its transaction: the
    arrays a row stopped naming are never removed before that row is written."""
    from rebalancer.controller.store import pack_arrays

    store = Store(tmp_path / "s.sqlite")
    store.save_ingest_state("a", _state(1), background=True)
    store.flush_ingest_states()
    seen: list[dict] = []
    gate = held_writer(store, seen)
    old = pack_arrays({"loss0": np.zeros((2, 2), dtype=np.int32)})
    store.save_contingency("m", {"base_version": 1}, old)  # handed over: arrays, then the row
    store.save_ingest_state("a", _state(2), background=True)
    store.save_contingency("m", {"base_version": 2}, {"loss0": np.ones((2, 2), np.int32)})
    store.drop_contingency_arrays(old.digest)
    gate.set()
    store.flush_ingest_states()
    flat = [(k, row is None) for rows in seen for k, row in rows.items()]
    removal = flat.index((("contingency_arrays", old.digest), True))
    last_m = max(i for i, (k, _) in enumerate(flat) if k == ("contingency", "m"))
    assert last_m < removal
    assert list(seen[-1])[-1] == ("contingency_arrays", old.digest)  # it ends its batch
    got = store.contingency("m")
    assert got is not None and got[0] == {"base_version": 2}
    store.close()
