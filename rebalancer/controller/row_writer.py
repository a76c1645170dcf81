"""Store rows of which only the newest version matters, written off the event loop by a
thread with a connection of its own: ingest cursors and contingency sets (and the
survivors' placements a replica pool's members share, which a row of `contingency`
names by digest: written before the rows that name them, dropped after the last such row
names another).

Every deployment saves its ingest cursor (per-rank next window and the estimate built
from them, about 120 kB at DeepSeek-V3 shapes) every `persist_seconds`. At 512
deployments that is about 100 SQLite writes a second, and done on the event loop they
were a quarter of its time, so windows queued behind them. A contingency set (a survivor
placement per failure domain, 2.3 MB at DeepSeek-V3 shapes on 32 GPUs) held the loop
6-42 ms at each save. Here the loop only packs the
row (a snapshot: each array copied once into the blob, so later folds cannot change what
is saved) and hands it over; the thread writes it, oldest first, in transactions of about
BATCH_BYTES. SQLite's WAL lets the two connections of one process take turns (each waits
for the other's short write lock, never fails on it): the loop's own writes (plan rows)
wait for one batch at most.

Rules that keep a cursor from going backwards (a window counted twice after a restart):
- one row per table and deployment is pending at a time; a newer save replaces the
  pending one and goes last in line;
- rows are written in one thread, in order, so a newer row is never overwritten by an
  older one;
- `pending(table, name)` serves reads of a row not yet written; `flush()` waits until every
  row handed over is written (the drain path before the store closes).

The thread runs while there is something to write: it ends after IDLE_SECONDS without a
row (closing its connection), and the next save starts another. A store dropped without
`close()` (a test's, a tool's) so leaves no thread behind.

A failed write (disk full, read-only file) is logged and counted in `errors`; the next
save of that deployment tries again. Counting is lost for at most the time the store
refuses writes, as with any crash between saves.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from typing import Any, Literal

log = logging.getLogger("rebalancer.store")

# sqlite3's busy timeout of the writer's connection: how long a write waits for the
# loop's connection to release the WAL write lock before it counts as an error.
BUSY_TIMEOUT_SECONDS = 30.0
# The writer thread ends after this long without a row; the next put starts a new one.
IDLE_SECONDS = 1.0
# At most one "cannot save" line per this many seconds (a full disk fails every save).
ERROR_LOG_SECONDS = 10.0
# Rows written in one transaction, by their bytes: the write lock is released between
# transactions, so the event loop's own writes (plan rows) wait for one batch at most
# (here 64 cursors of 120 kB in one transaction held it 45 ms, 256 of them 150 ms; 8: 2 ms).
BATCH_BYTES = 1 << 20

Row = tuple[str, bytes | bytearray]  # (JSON document, packed arrays)
# The tables written here: each is (key TEXT PRIMARY KEY, document TEXT, arrays BLOB), the
# key a deployment's name, or for contingency_arrays the digest of the arrays. Written in
# this order within a transaction: shared arrays before the rows that name them.
Table = Literal["contingency_arrays", "ingest_state", "contingency"]
TABLES: tuple[Table, ...] = ("contingency_arrays", "ingest_state", "contingency")
_KEY_COLUMN: dict[Table, str] = {
    "contingency_arrays": "digest",
    "ingest_state": "deployment",
    "contingency": "deployment",
}
Key = tuple[Table, str]  # (table, deployment or digest)


def upsert(table: Table) -> str:
    """The statement that writes one row of `table`, replacing the deployment's last."""
    return f"INSERT OR REPLACE INTO {table} VALUES (?, ?, ?)"


def delete(table: Table) -> str:
    """The statement that removes the row of one key of `table`."""
    return f"DELETE FROM {table} WHERE {_KEY_COLUMN[table]} = ?"


class RowWriter:
    def __init__(self, path: str, connect: Any) -> None:
        """`connect(path, timeout)` opens the writer's own connection (the store's
        connection class, so refused statements are counted the same way)."""
        self.path = path
        self._connect = connect
        self._pending: dict[Key, Row | None] = {}  # None: a removal
        self._writing: dict[Key, Row | None] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.errors = 0
        self.written = 0
        self._last_error_log = -float("inf")
        self._thread: threading.Thread | None = None  # the running writer, if any

    def put(self, table: Table, name: str, row: Row | None) -> None:
        """Hand over deployment `name`'s newest row of `table` (one of TABLES); None:
        remove the row (after every row handed over before)."""
        if table not in TABLES:
            raise ValueError(f"the row writer writes {', '.join(TABLES)}, not {table!r}")
        with self._cond:
            if self._closed:
                raise RuntimeError("row writer is closed")
            # Last in line: a row is written after every row handed over before it (a
            # removal after the rows that stopped naming what it removes).
            self._pending.pop((table, name), None)
            self._pending[(table, name)] = row
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="row-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self, table: Table, name: str) -> Row | None:
        """The newest row of `name` in `table` handed over and not yet written, if any
        (None too for a removal not yet written)."""
        with self._cond:
            key = (table, name)
            return self._pending.get(key) or self._writing.get(key)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every row handed over so far is written (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._writing, timeout)

    def close(self) -> None:
        """Write what is pending, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        db = None
        try:
            db = self._connect(self.path, BUSY_TIMEOUT_SECONDS)
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pending or self._closed, IDLE_SECONDS)
                    if (
                        not self._pending
                    ):  # closed or idle, nothing left: a later put starts another
                        self._thread = None
                        return
                    self._writing = self._batch()
                self._write(db, self._writing)
                with self._cond:
                    self._writing = {}
                    self._cond.notify_all()
        finally:
            if db is not None:
                db.close()
            with self._cond:
                if (
                    self._thread is threading.current_thread()
                ):  # ended by an error, not idle or closed:
                    self._thread = None  # nothing more will be written now: release any flush()
                    self._pending, self._writing = {}, {}
                    self._cond.notify_all()

    def _batch(self) -> dict[Key, Row | None]:
        """The oldest pending rows, up to BATCH_BYTES (one row at least), taken out of
        `_pending`; under the condition's lock. A removal ends the batch: it must follow
        the rows handed over before it (a batch writes table by table)."""
        batch: dict[Key, Row | None] = {}
        size = 0
        while self._pending and (not batch or size < BATCH_BYTES):
            key = next(iter(self._pending))  # the oldest: dicts keep the order of insertion
            row = batch[key] = self._pending.pop(key)
            if row is None:
                break
            size += len(row[0]) + len(row[1])
        return batch

    def _write(self, db: sqlite3.Connection, rows: dict[Key, Row | None]) -> None:
        try:
            db.execute("BEGIN")
            for table in TABLES:
                db.executemany(
                    upsert(table),
                    [(n, *row) for (t, n), row in rows.items() if t == table and row is not None],
                )
            for table in TABLES:
                db.executemany(
                    delete(table),
                    [(n,) for (t, n), row in rows.items() if t == table and row is None],
                )
            db.execute("COMMIT")
            self.written += len(rows)
        except sqlite3.Error as exc:
            self.errors += 1
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # no transaction left to roll back
            now = time.monotonic()
            if now - self._last_error_log >= ERROR_LOG_SECONDS:
                self._last_error_log = now
                log.error(
                    "store %s: cannot save %s: %s",
                    self.path,
                    ", ".join(
                        f"{n} {t.replace('_', ' ')} row(s)"
                        for t in TABLES
                        if (n := sum(1 for k in rows if k[0] == t))
                    ),
                    exc,
                )
