"""Durable controller state in embedded SQLite (WAL).

What must survive a controller restart (invariant 7): each deployment's shape,
policy and committed placement, every placement version a plan proposed, the
plan and decision history, the mixed placement a plan applied in part left the ranks
on (until the group restarts), and the ingest cursor (per-rank next window
sequence number plus the load estimate) so a reconnecting rank's resent
windows are counted once.

The store keeps no clock: every time it writes (created, finished, a decision's time)
is given by the caller, read off the controller's one clock.

One controller per store: the controller holds `StoreLock` (an exclusive `flock` on
`<file>.lock` beside the store file, links resolved, with its pid written in it) for as
long as it runs, so a second controller on the same file, by whatever path, is refused,
naming the holder. The kernel drops the lock when the process ends however it ends, so
a controller killed with SIGKILL leaves nothing to clean up and a restart on the same
store opens it at once. Readers that only inspect
the file (tests, `sqlite3 .backup`) need no lock: SQLite's WAL lets them read beside it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rebalancer.controller.coordinate import Mixed
from rebalancer.controller.row_writer import Row, RowWriter, Table, delete, upsert
from rebalancer.errors import InputError, StateError

# The largest placement or plan version: SQLite's INTEGER is a signed 64-bit integer (a
# larger Python int raises OverflowError), while the wire's versions are uint64. Versions
# from the wire are checked against it before anything is stored (service.check_version).
MAX_VERSION = 2**63 - 1


class InUseError(InputError):
    """A resource another process holds: the store's lock or a port (another controller?).
    The CLI exits with `exit_code` (7) and the message."""

    exit_code = 7


def check_store_path(path: str | Path) -> None:
    """InputError, naming the reason, unless `path` can be an SQLite file (':memory:' can)."""
    if str(path) == ":memory:":
        return
    if not str(path):
        raise InputError("the store path is empty")
    p = Path(path)
    folder = p.parent
    if not folder.exists():
        raise InputError(f"store {path}: folder {folder} does not exist")
    if not folder.is_dir():
        raise InputError(f"store {path}: {folder} is not a folder")
    if p.is_dir():
        raise InputError(f"store {path}: is a folder, not an SQLite file")
    if p.exists() and not p.is_file():
        raise InputError(f"store {path}: not a regular file")


class StoreLock:
    """An exclusive lock on `<file>.lock`, held until `release` or the process ends.

    Keyed on the store file itself, not on the path given: `<file>` is the path with
    every symbolic link resolved, so a link to a store in use meets that store's lock; a
    store with a second hard link is refused (its names could not share one lock).

    `flock` locks belong to the open file, not to the path. The holder deletes the lock
    file when it lets go (a start refused after the lock was taken leaves nothing), so a
    lock is only held once the path still names the file locked: a process that opened
    the file just before it was deleted finds that out and opens the path again. It is
    opened close-on-exec (a child such as the decision worker must not keep it locked
    after the controller died) and holds the holder's pid, for the refusal message. A
    holder killed outright leaves the file behind; the next controller takes it over.
    """

    def __init__(self, db_path: str | Path) -> None:
        real = os.path.realpath(db_path)
        _check_single_link(db_path, real)
        self.path = f"{real}.lock"
        while True:
            fd = self._open(db_path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_pid(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    who = f"pid {holder}" if holder else "another process"
                    raise InUseError(
                        f"store {db_path} is in use by another controller ({who}; "
                        f"lock {self.path}): one controller per store"
                    ) from None
                raise InputError(
                    f"store {db_path}: cannot lock {self.path}: {exc.strerror or exc}"
                ) from None
            if _names(self.path, fd):
                break
            os.close(fd)  # deleted by the holder that just let go: lock the path's file
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the pid is only for the message; the lock is what counts
        self._fd: int | None = fd

    def _open(self, db_path: str | Path) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise InputError(
                f"store {db_path}: cannot open its lock file {self.path}: {exc.strerror or exc}"
            ) from None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.unlink(self.path)  # while still locked: see the class docstring
            except OSError:
                pass  # a read-only folder: the next holder takes the file over
            os.close(fd)  # closing the only descriptor drops the lock

    def __enter__(self) -> StoreLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _names(path: str, fd: int) -> bool:
    """Whether `path` still names the open file `fd`."""
    try:
        here, there = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _check_single_link(db_path: str | Path, real: str) -> None:
    """InputError for a store file with more than one name (hard links): the lock is
    keyed on one name of the file."""
    try:
        links = os.stat(real).st_nlink
    except OSError:
        return  # not there yet: the store creates it
    if links > 1:
        raise InputError(
            f"store {db_path}: the file has {links} hard links; a controller locks "
            "its store by name, so give it a file with one name (copy it)"
        )


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


_SCHEMA = """
CREATE TABLE IF NOT EXISTS deployments (
    name TEXT PRIMARY KEY,
    shape TEXT NOT NULL,
    policy TEXT NOT NULL,
    committed_version INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS placements (
    deployment TEXT NOT NULL,
    version INTEGER NOT NULL,
    num_layers INTEGER NOT NULL,
    num_slots INTEGER NOT NULL,
    phy2log BLOB NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (deployment, version)
);
CREATE TABLE IF NOT EXISTS plans (
    deployment TEXT NOT NULL,
    version INTEGER NOT NULL,
    base_version INTEGER NOT NULL,
    state TEXT NOT NULL,
    trigger TEXT NOT NULL,
    created REAL NOT NULL,
    finished REAL NOT NULL DEFAULT 0,
    slots_moved INTEGER NOT NULL DEFAULT 0,
    bytes_moved INTEGER NOT NULL DEFAULT 0,
    reason TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (deployment, version)
);
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    deployment TEXT NOT NULL,
    time REAL NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS mixed_placements (
    deployment TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    base_version INTEGER NOT NULL,
    num_layers INTEGER NOT NULL,
    num_slots INTEGER NOT NULL,
    phy2log BLOB,
    reason TEXT NOT NULL,
    since REAL NOT NULL,
    workers TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pool_members (
    deployment TEXT PRIMARY KEY,
    pool TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pools (
    name TEXT PRIMARY KEY,
    shape TEXT NOT NULL,
    version INTEGER NOT NULL,
    num_layers INTEGER NOT NULL DEFAULT 0,
    num_slots INTEGER NOT NULL DEFAULT 0,
    phy2log BLOB
);
CREATE TABLE IF NOT EXISTS contingency (
    deployment TEXT PRIMARY KEY,
    record TEXT NOT NULL,
    arrays BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS contingency_arrays (
    digest TEXT PRIMARY KEY,
    record TEXT NOT NULL,
    arrays BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS contingency_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    deployment TEXT NOT NULL,
    time REAL NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS regimes (
    deployment TEXT PRIMARY KEY,
    record TEXT NOT NULL,
    arrays BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS regime_rows (
    deployment TEXT NOT NULL,
    id INTEGER NOT NULL,
    record TEXT NOT NULL,
    arrays BLOB NOT NULL,
    PRIMARY KEY (deployment, id)
);
CREATE TABLE IF NOT EXISTS ingest_state (
    deployment TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    arrays BLOB NOT NULL
);
"""


@dataclass(frozen=True)
class DeploymentRow:
    name: str
    shape: dict[str, int]
    policy: dict[str, Any]
    committed_version: int
    phy2log: np.ndarray  # [L, P] int64, the committed placement


@dataclass(frozen=True)
class PlanRow:
    version: int
    base_version: int
    state: str
    trigger: str
    created: float
    finished: float
    slots_moved: int
    bytes_moved: int
    reason: str


class _Connection(sqlite3.Connection):
    """A connection that counts the statements SQLite refused (disk full, I/O error,
    locked, corrupt): the controller's store-errors metric. Nothing here expects one."""

    errors = 0

    def execute(self, *args: Any, **kwargs: Any) -> sqlite3.Cursor:
        try:
            return super().execute(*args, **kwargs)
        except sqlite3.Error:
            self.errors += 1
            raise


class Store:
    """One SQLite file (or ':memory:'); every method is one short transaction."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        """InputError, naming the reason, for a path that cannot be a store: a missing
        folder, a folder, a file that is not SQLite, one that cannot be written."""
        self.path = str(path)
        check_store_path(self.path)
        try:
            self._db = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, factory=_Connection
            )
        except sqlite3.Error as exc:
            raise InputError(f"store {self.path}: cannot open ({exc})") from None
        try:
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            self._db.close()
            reason = str(exc)
            if isinstance(exc, sqlite3.DatabaseError) and "not a database" in reason:
                reason = "not an SQLite database (file is not a database)"
            raise InputError(f"store {self.path}: {reason}") from None
        # Started by the first background save (row_writer.py); a ':memory:' store
        # has no second connection, so it always saves in line.
        self._writer: RowWriter | None = None
        # Digests of the shared contingency arrays stored or handed to the writer.
        self._shared: set[str] | None = None

    def close(self) -> None:
        """Write the ingest cursors still pending, then close."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._db.close()

    @property
    def errors(self) -> int:
        """Statements SQLite refused since the store opened."""
        return self._db.errors + (self._writer.errors if self._writer is not None else 0)

    # ------------------------------------------------------------ deployments

    def create_deployment(
        self,
        name: str,
        shape: dict[str, int],
        policy: dict[str, Any],
        version: int,
        phy2log: np.ndarray,
        *,
        now: float,
    ) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO deployments VALUES (?, ?, ?, ?, ?)",
                (name, json.dumps(shape), json.dumps(policy), version, now),
            )
            self._put_placement(name, version, phy2log, now)

    def set_policy(self, name: str, policy: dict[str, Any]) -> None:
        self._db.execute(
            "UPDATE deployments SET policy = ? WHERE name = ?", (json.dumps(policy), name)
        )

    def set_shape(self, name: str, shape: dict[str, Any]) -> None:
        """Rewrite a deployment's shape: a field an older store lacked, now known
        (registry.py adopts a rank's dispatch mode and top_k)."""
        self._db.execute(
            "UPDATE deployments SET shape = ? WHERE name = ?", (json.dumps(shape), name)
        )

    def load_deployments(self) -> list[DeploymentRow]:
        rows = self._db.execute(
            "SELECT name, shape, policy, committed_version FROM deployments ORDER BY name"
        ).fetchall()
        out = []
        for name, shape, policy, version in rows:
            phy2log = self.placement(name, version)
            assert phy2log is not None, f"committed placement {name} v{version} missing"
            out.append(DeploymentRow(name, json.loads(shape), json.loads(policy), version, phy2log))
        return out

    # ------------------------------------------------------------ placements

    def _put_placement(self, name: str, version: int, phy2log: np.ndarray, now: float) -> None:
        arr = np.ascontiguousarray(phy2log, dtype="<i4")
        self._db.execute(
            "INSERT OR REPLACE INTO placements VALUES (?, ?, ?, ?, ?, ?)",
            (name, version, arr.shape[0], arr.shape[1], arr.tobytes(), now),
        )

    @contextlib.contextmanager
    def _new_placement(
        self, name: str, version: int, phy2log: np.ndarray, now: float
    ) -> Iterator[None]:
        """One transaction that stores placement `version` and what the caller adds to it
        (its plan row); StateError, nothing written, past MAX_VERSION."""
        if version > MAX_VERSION:
            raise StateError("FAILED_PRECONDITION", f"no plan version is left for {name!r}")
        with self._db:
            self._db.execute("BEGIN")
            self._put_placement(name, version, phy2log, now)
            yield

    def placement(self, name: str, version: int) -> np.ndarray | None:
        row = self._db.execute(
            "SELECT num_layers, num_slots, phy2log FROM placements WHERE deployment = ? AND "
            "version = ?",
            (name, version),
        ).fetchone()
        if row is None:
            return None
        layers, slots, blob = row
        return np.frombuffer(blob, dtype="<i4").reshape(layers, slots).astype(np.int64)

    # ------------------------------------------------------------ plans

    def begin_plan(
        self,
        name: str,
        version: int,
        base_version: int,
        trigger: str,
        phy2log: np.ndarray,
        slots_moved: int,
        bytes_moved: int,
        *,
        now: float,
    ) -> None:
        """Record a plan and its placement before any rank hears of it. StateError, nothing
        written, when `version` is beyond MAX_VERSION (a deployment registered at the
        largest version has no plan version left)."""
        if version > MAX_VERSION:
            raise StateError(
                "FAILED_PRECONDITION",
                f"no plan version is left for {name!r} after "
                f"v{base_version} (versions end at 2**63 - 1)",
            )
        with self._db:
            self._db.execute("BEGIN")
            self._put_placement(name, version, phy2log, now)
            self._db.execute(
                "INSERT INTO plans (deployment, version, base_version, state, trigger, created,"
                " slots_moved, bytes_moved) VALUES (?, ?, ?, 'preparing', ?, ?, ?, ?)",
                (name, version, base_version, trigger, now, slots_moved, bytes_moved),
            )

    def set_plan_state(
        self, name: str, version: int, state: str, reason: str = "", *, now: float
    ) -> None:
        self._db.execute(
            "UPDATE plans SET state = ?, finished = ?, reason = ? WHERE deployment = ? "
            "AND version = ?",
            (state, now, reason, name, version),
        )

    def mark_committing(self, name: str, version: int) -> None:
        """Record that Commit of plan `version` goes out, before it does: a controller
        restarted after that must not abort the plan (registry.load)."""
        with self._db:
            self._db.execute(
                "UPDATE plans SET state = 'committing' WHERE deployment = ? AND version = ?",
                (name, version),
            )

    def commit_plan(self, name: str, version: int, *, now: float) -> None:
        """Mark plan `version` committed and make it the deployment's placement, atomically."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "UPDATE plans SET state = 'committed', finished = ? WHERE deployment = ? AND "
                "version = ?",
                (now, name, version),
            )
            self._db.execute(
                "UPDATE deployments SET committed_version = ? WHERE name = ?", (version, name)
            )

    def resize(
        self,
        name: str,
        shape: dict[str, Any],
        version: int,
        base_version: int,
        phy2log: np.ndarray,
        reason: str,
        *,
        now: float,
    ) -> None:
        """An elastic engine resized the deployment's EP group (rebalancer/controller/resize.py):
        the new shape and the placement the new world serves, committed as plan `version`
        (trigger "resize"), and no mixed placement left, atomically."""
        with self._new_placement(name, version, phy2log, now):
            self._db.execute(
                "INSERT INTO plans (deployment, version, base_version, state, trigger, created, "
                "finished, reason) VALUES (?, ?, ?, 'committed', 'resize', ?, ?, ?)",
                (name, version, base_version, now, now, reason),
            )
            self._db.execute(
                "UPDATE deployments SET shape = ?, committed_version = ? WHERE name = ?",
                (json.dumps(shape), version, name),
            )
            self._db.execute("DELETE FROM mixed_placements WHERE deployment = ?", (name,))

    def set_mixed(self, name: str, mixed: Mixed, plan_state_reason: str, *, now: float) -> None:
        """Plan `mixed.version` applied in part: mark it partial and record what the ranks
        serve, atomically (a controller restarted on this store holds the same)."""
        arr = None if mixed.phy2log is None else np.ascontiguousarray(mixed.phy2log, dtype="<i4")
        shape = (0, 0) if arr is None else arr.shape
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "UPDATE plans SET state = 'partial', finished = ?, reason = ? WHERE deployment = ? "
                "AND version = ?",
                (now, plan_state_reason, name, mixed.version),
            )
            self._db.execute(
                "INSERT OR REPLACE INTO mixed_placements VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    name,
                    mixed.version,
                    mixed.base_version,
                    shape[0],
                    shape[1],
                    None if arr is None else arr.tobytes(),
                    mixed.reason,
                    mixed.since,
                    json.dumps(sorted(mixed.workers)),
                ),
            )

    def mixed(self, name: str) -> Mixed | None:
        row = self._db.execute(
            "SELECT version, base_version, num_layers, num_slots, phy2log, reason, since, workers"
            " FROM mixed_placements WHERE deployment = ?",
            (name,),
        ).fetchone()
        if row is None:
            return None
        version, base, layers, slots, blob, reason, since, workers = row
        phy2log = (
            None
            if blob is None
            else np.frombuffer(blob, dtype="<i4").reshape(layers, slots).astype(np.int64)
        )
        return Mixed(
            int(version), int(base), phy2log, reason, float(since), frozenset(json.loads(workers))
        )

    def clear_mixed(self, name: str) -> None:
        self._db.execute("DELETE FROM mixed_placements WHERE deployment = ?", (name,))

    def max_version(self, name: str) -> int:
        row = self._db.execute(
            "SELECT MAX(version) FROM placements WHERE deployment = ?", (name,)
        ).fetchone()
        return int(row[0] or 0)

    def plans(self, name: str, limit: int = 50) -> list[PlanRow]:
        rows = self._db.execute(
            "SELECT version, base_version, state, trigger, created, finished, slots_moved,"
            " bytes_moved, reason FROM plans WHERE deployment = ? ORDER BY version DESC LIMIT ?",
            (name, limit),
        ).fetchall()
        return [PlanRow(*row) for row in rows]

    def unfinished_plans(self, name: str) -> list[PlanRow]:
        """Plans a controller left in flight: preparing, or committing (Commit went out)."""
        return [
            p for p in self.plans(name, limit=1_000_000) if p.state in ("preparing", "committing")
        ]

    def offer_plan(self, name: str, version: int, phy2log: np.ndarray, *, now: float) -> None:
        """Record a warm start offered to a fresh deployment: its placement as plan
        `version` (state "offered", based on v0), adopted when the ranks confirm it."""
        with self._new_placement(name, version, phy2log, now):
            self._db.execute(
                "INSERT OR REPLACE INTO plans (deployment, version, base_version, state, trigger, "
                "created, reason) VALUES (?, ?, 0, 'offered', 'warm_start', ?, 'the pool "
                "placement, offered at Register')",
                (name, version, now),
            )

    # ------------------------------------------------------------ pools

    def set_pool_member(self, deployment: str, pool: str) -> None:
        """`deployment` is in `pool` ("" : in none)."""
        if pool:
            self._db.execute(
                "INSERT OR REPLACE INTO pool_members VALUES (?, ?)", (deployment, pool)
            )
        else:
            self._db.execute("DELETE FROM pool_members WHERE deployment = ?", (deployment,))

    def pool_members(self) -> dict[str, str]:
        """deployment -> its pool."""
        return dict(self._db.execute("SELECT deployment, pool FROM pool_members").fetchall())

    def save_pool(
        self, name: str, shape: dict[str, Any], version: int, phy2log: np.ndarray | None
    ) -> None:
        arr = None if phy2log is None else np.ascontiguousarray(phy2log, dtype="<i4")
        layers, slots = (0, 0) if arr is None else arr.shape
        self._db.execute(
            "INSERT OR REPLACE INTO pools VALUES (?, ?, ?, ?, ?, ?)",
            (
                name,
                json.dumps(shape),
                version,
                layers,
                slots,
                None if arr is None else arr.tobytes(),
            ),
        )

    def load_pools(self) -> list[tuple[str, dict[str, Any], int, np.ndarray | None]]:
        """(name, shape, pool placement version, pool placement or None) of every pool."""
        out = []
        for name, shape, version, layers, slots, blob in self._db.execute(
            "SELECT name, shape, version, num_layers, num_slots, phy2log FROM pools ORDER BY name"
        ):
            phy2log = (
                None
                if blob is None
                else np.frombuffer(blob, dtype="<i4").reshape(layers, slots).astype(np.int64)
            )
            out.append((name, json.loads(shape), int(version), phy2log))
        return out

    # ------------------------------------------------------------ decisions

    def record_decision(self, name: str, record: dict[str, Any]) -> None:
        """`record` carries its own "time" (the controller clock's)."""
        self._db.execute(
            "INSERT INTO decisions (deployment, time, record) VALUES (?, ?, ?)",
            (name, float(record["time"]), json.dumps(record)),
        )

    def decisions(self, name: str, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT record FROM decisions WHERE deployment = ? ORDER BY id DESC LIMIT ?",
            (name, limit),
        ).fetchall()
        return [json.loads(r[0]) for r in rows]

    # ------------------------------------------------------------ ingest cursor

    def save_contingency(
        self, name: str, record: dict[str, Any], arrays: dict[str, np.ndarray] | PackedArrays
    ) -> None:
        """A deployment's newest contingency set (controller/contingency.py): its record
        and the survivors' placements, replacing the one before. Packed here, written by
        the row writer's thread where one runs (written in line, a set of 2.3 MB held the
        event loop 6-42 ms; packed, 3 ms); `contingency` reads it back either way.

        `PackedArrays` (one set for the members of a replica pool, `pack_arrays`) are
        stored once, in `contingency_arrays` under their digest, which the member's row
        names: 2,048 members in pools of 8 store 256 sets, not 2,048. Those no row names
        any more go with `drop_contingency_arrays`."""
        if isinstance(arrays, PackedArrays):
            if arrays.digest not in self._shared_digests():
                self._put("contingency_arrays", arrays.digest, ("{}", arrays.blob))
                self._shared_digests().add(arrays.digest)
            row: Row = (json.dumps({**record, _SHARED: arrays.digest}), b"")
        else:
            row = (json.dumps(record), _pack_arrays(arrays))
        self._put("contingency", name, row)

    def drop_contingency_arrays(self, digest: str) -> None:
        """Remove shared contingency arrays once no deployment's row names them (after the
        rows handed over before, which stopped naming them)."""
        self._shared_digests().discard(digest)
        writer = self._row_writer()
        if writer is not None:
            writer.put("contingency_arrays", digest, None)
        else:
            self._db.execute(delete("contingency_arrays"), (digest,))

    def shared_contingency(self) -> dict[str, str]:
        """deployment -> digest of the shared arrays its stored contingency set names. Shared
        arrays no row names (a controller stopped between a row and the removal) are
        removed here: call it at start, before any save."""
        rows = self._db.execute(  # records may hold NaN, which SQLite's JSON refuses
            "SELECT deployment, record FROM contingency WHERE instr(record, ?) > 0",
            (f'"{_SHARED}"',),
        ).fetchall()
        named = {
            name: digest
            for name, record in rows
            if isinstance(digest := json.loads(record).get(_SHARED), str)
        }
        kept = set(named.values())
        for (digest,) in self._db.execute("SELECT digest FROM contingency_arrays").fetchall():
            if digest not in kept:
                self.drop_contingency_arrays(digest)
        return named

    def _shared_digests(self) -> set[str]:
        if self._shared is None:
            rows = self._db.execute("SELECT digest FROM contingency_arrays").fetchall()
            self._shared = {d for (d,) in rows}
        return self._shared

    def _put(self, table: Table, key: str, row: Row) -> None:
        """A row of `table` by the row writer where one runs, else in line."""
        writer = self._row_writer()
        if writer is not None:
            writer.put(table, key, row)
        else:
            self._db.execute(upsert(table), (key, *row))

    def record_contingency(self, name: str, time: float, summary: dict[str, Any]) -> None:
        """One contingency set in the deployment's history (its summary)."""
        self._db.execute(
            "INSERT INTO contingency_history (deployment, time, record) VALUES (?, ?, ?)",
            (name, time, json.dumps(summary)),
        )

    def contingency_history(self, name: str, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT time, record FROM contingency_history WHERE deployment = ? "
            "ORDER BY id DESC LIMIT ?",
            (name, limit),
        ).fetchall()
        return [{"time": t, **json.loads(r)} for t, r in rows]

    def contingency(self, name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """A deployment's stored contingency set: (record, arrays); None when it has none,
        or when the shared arrays its row names are missing (a write the disk refused)."""
        row = (
            self._pending_row("contingency", name)
            or self._db.execute(
                "SELECT record, arrays FROM contingency WHERE deployment = ?", (name,)
            ).fetchone()
        )
        if row is None:
            return None
        record = json.loads(row[0])
        digest = record.pop(_SHARED, None)
        if digest is None:
            return record, _unpack_arrays(row[1])
        shared = (
            self._pending_row("contingency_arrays", digest)
            or self._db.execute(
                "SELECT record, arrays FROM contingency_arrays WHERE digest = ?", (digest,)
            ).fetchone()
        )
        return None if shared is None else (record, _unpack_arrays(shared[1]))

    def save_regimes(
        self,
        name: str,
        header: tuple[dict[str, Any], dict[str, np.ndarray]],
        rows: dict[int, tuple[dict[str, Any], dict[str, np.ndarray]]],
        removed: list[int],
    ) -> None:
        """A deployment's regime library (controller/regimes.py, `RegimeLibrary.changes`):
        its header, the regimes that changed (a row each) and those evicted, in one
        transaction, so a restart reads one library."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO regimes VALUES (?, ?, ?)",
                (name, json.dumps(header[0]), _pack_arrays(header[1])),
            )
            for regime_id, (record, arrays) in rows.items():
                self._db.execute(
                    "INSERT OR REPLACE INTO regime_rows VALUES (?, ?, ?, ?)",
                    (name, regime_id, json.dumps(record), _pack_arrays(arrays)),
                )
            for regime_id in removed:
                self._db.execute(
                    "DELETE FROM regime_rows WHERE deployment = ? AND id = ?", (name, regime_id)
                )

    def regimes(
        self, name: str
    ) -> (
        tuple[
            dict[str, Any],
            dict[str, np.ndarray],
            dict[int, tuple[dict[str, Any], dict[str, np.ndarray]]],
        ]
        | None
    ):
        """(header, its arrays, regime rows by id) as `save_regimes` left them, or None."""
        head = self._db.execute(
            "SELECT record, arrays FROM regimes WHERE deployment = ?", (name,)
        ).fetchone()
        if head is None:
            return None
        rows = self._db.execute(
            "SELECT id, record, arrays FROM regime_rows WHERE deployment = ?", (name,)
        )
        return (
            json.loads(head[0]),
            _unpack_arrays(head[1]),
            {int(i): (json.loads(r), _unpack_arrays(a)) for i, r, a in rows.fetchall()},
        )

    def save_ingest_state(self, name: str, state: dict[str, Any], background: bool = False) -> int:
        """Numeric lists and arrays travel as one blob of raw little-endian bytes (JSON of
        [L, E] floats is ~100x slower, npz ~10x); pass arrays, not lists, where you can.

        The row is packed here: each array copied once into the blob, which is the
        snapshot (later folds cannot change what is saved); packing in the writer thread
        held the GIL all the same and took one copy more. `background`: a thread writes it
        (row_writer.py), so the caller does not wait for SQLite; once any save went
        that way, every save does, so a newer cursor is never overwritten by an older one,
        and a save in line waits for it. Returns the row's size in bytes (what the save
        costs the store: the folder paces saves by it)."""
        row = _ingest_row(state)
        if background:
            self._row_writer()
        if self._writer is not None:
            self._writer.put("ingest_state", name, row)
            if not background:
                self._writer.flush()
        else:
            self._db.execute(upsert("ingest_state"), (name, *row))
        return len(row[0]) + len(row[1])

    def _row_writer(self) -> RowWriter | None:
        """The row writer, started at first use; None for a ':memory:' store (it has no
        second connection, so it writes in line)."""
        if self._writer is None and self.path != ":memory:":
            self._writer = RowWriter(self.path, self._connect_writer)
        return self._writer

    def _pending_row(self, table: Table, name: str) -> Row | None:
        """A row handed to the writer and not written yet, if any (what reads return)."""
        return self._writer.pending(table, name) if self._writer is not None else None

    def flush_ingest_states(self) -> None:
        """Wait until every background save handed over so far is written."""
        if self._writer is not None:
            self._writer.flush()

    def _connect_writer(self, path: str, timeout: float) -> sqlite3.Connection:
        db = sqlite3.connect(
            path,
            timeout=timeout,
            isolation_level=None,
            check_same_thread=False,
            factory=_Connection,
        )
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def ingest_state(self, name: str) -> dict[str, Any] | None:
        pending = self._pending_row("ingest_state", name)
        if pending is not None:
            return _join_arrays(json.loads(pending[0]), _unpack_arrays(pending[1]))
        row = self._db.execute(
            "SELECT state, arrays FROM ingest_state WHERE deployment = ?", (name,)
        ).fetchone()
        if row is None:
            return None
        return _join_arrays(json.loads(row[0]), _unpack_arrays(row[1]))


# The ingest cursor's arrays: MAGIC, a 4-byte little-endian header length, a JSON header
# [[key, dtype, shape], ...] and each array's bytes (C order, little-endian) in turn.
# A blob written before this format (an npz file, starting "PK") is still read.
_RAW_MAGIC = b"RBA1"


def _ingest_row(state: dict[str, Any]) -> tuple[str, bytearray]:
    """An ingest cursor as its row: (JSON document, packed arrays)."""
    arrays: dict[str, np.ndarray] = {}
    doc = _split_arrays(state, arrays, "")
    return json.dumps(doc), _pack_arrays(arrays)


# The key of a contingency row's record naming the shared arrays it holds (by digest).
_SHARED = "shared_arrays"


@dataclass(frozen=True)
class PackedArrays:
    """Arrays packed once for the rows of several deployments (the members of a replica
    pool share one contingency set: controller/contingency.py), stored once under
    `digest` (of the blob)."""

    blob: bytes | bytearray
    digest: str


def pack_arrays(arrays: dict[str, np.ndarray]) -> PackedArrays:
    """`arrays` packed as a row stores them, once for many rows."""
    blob = _pack_arrays(arrays)
    return PackedArrays(blob, hashlib.sha256(blob).hexdigest())


def _pack_arrays(arrays: dict[str, np.ndarray]) -> bytearray:
    """The arrays as one blob: magic, header length, JSON header (key, dtype, shape per
    array), then each array's little-endian bytes. Each array is copied once, straight into
    the blob (a bytearray: SQLite stores it as a BLOB): at 240 kB a cursor, `tobytes` then
    `join` made two fresh copies and cost ten times as long (issue 32)."""
    header: list[list[Any]] = []
    placed: list[tuple[np.ndarray, np.dtype]] = []
    size = 0
    for key, arr in arrays.items():
        dtype = arr.dtype.newbyteorder("<")
        header.append([key, dtype.str, list(arr.shape)])
        placed.append((arr, dtype))
        size += arr.size * dtype.itemsize
    head = json.dumps(header).encode()
    offset = len(_RAW_MAGIC) + 4 + len(head)
    blob = bytearray(offset + size)
    blob[:offset] = _RAW_MAGIC + len(head).to_bytes(4, "little") + head
    for arr, dtype in placed:
        if arr.size:
            np.frombuffer(blob, dtype, arr.size, offset).reshape(arr.shape)[...] = arr
        offset += arr.size * dtype.itemsize
    return blob


def _unpack_arrays(blob: bytes | bytearray) -> dict[str, np.ndarray]:
    if not blob.startswith(_RAW_MAGIC):
        with np.load(io.BytesIO(blob)) as npz:
            return dict(npz)
    start = len(_RAW_MAGIC) + 4
    end = start + int.from_bytes(blob[len(_RAW_MAGIC) : start], "little")
    arrays: dict[str, np.ndarray] = {}
    for key, dtype, shape in json.loads(blob[start:end]):
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        arrays[key] = np.frombuffer(blob, dt, count, end).reshape(shape).copy()
        end += count * dt.itemsize
    return arrays


_ARRAY_TAG = "__array__"


def _split_arrays(value: Any, arrays: dict[str, np.ndarray], path: str) -> Any:
    """Replace numeric lists (and arrays) in a JSON-like value by references into `arrays`."""
    if isinstance(value, dict):
        return {k: _split_arrays(v, arrays, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, np.ndarray)) and len(value) > 0:
        arr = np.asarray(value)
        if arr.dtype.kind in "iuf":
            key = f"a{len(arrays)}"
            arrays[key] = arr
            return {_ARRAY_TAG: key}
        return [_split_arrays(v, arrays, f"{path}[]") for v in value]
    return value


def _join_arrays(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_ARRAY_TAG}:
            return arrays[value[_ARRAY_TAG]]
        return {k: _join_arrays(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_join_arrays(v, arrays) for v in value]
    return value
