"""Where each physical slot's weights are stored: the row indirection behind a zero-copy commit.

Without spare storage a plan's incoming experts wait in staging and are copied into
their slots at commit, between two graph replays: a pause of milliseconds for a large
plan. With R spare rows per layer and rank (weights `[L, S + R, ...]`), an incoming
expert is written during prepare into a row no map points to, and commit only swaps
the maps: slot s of rank r is served from row `rows[r, layer, s]`, and dispatch hands
out row ids (`rank * (S + R) + row`) instead of slot ids.

Every rank keeps the rows of every rank: they follow from the plans' transfer lists,
which every rank receives whole, by one deterministic rule (`RowMap.plan`), so ranks
agree on where a peer's expert lives without exchanging row tables. A (layer, rank)
that gains more experts than it has free rows writes the rest in place at commit, as
without spare rows; with R = 0 every move is such a copy and the rows never change.

One owner moves the rows: the rank's `MigrationExecutor` (worker_hooks/migration.py), which
plans them at prepare and switches them at commit, as it writes the weights they point
to (`RowMap.switch`). Everyone else (the hook's dispatch maps, count files, examples)
reads them; the array is read-only, so a stray write fails instead of desynchronising
the ranks.
"""

from __future__ import annotations

import hashlib

import numpy as np

from rebalancer.wire.layout import DST_RANK, DST_SLOT, LAYER, SRC_RANK, SRC_SLOT, log2phy_of


def _frozen(rows: np.ndarray) -> np.ndarray:
    """A read-only int64 copy of `rows`."""
    out = np.array(rows, dtype=np.int64)
    out.setflags(write=False)
    return out


def replica_rows(
    phy2log: np.ndarray, row_ids: np.ndarray, num_logical: int, max_replicas: int
) -> np.ndarray:
    """Dispatch's map: the replicas of each expert as row ids, `[L, E, max_replicas]`, -1
    padded. phy2log: `[L, P]`; row_ids: `[L, P]` (`RowMap.row_ids`)."""
    slots = log2phy_of(phy2log, num_logical, max_replicas)
    flat = np.take_along_axis(row_ids, np.maximum(slots, 0).reshape(slots.shape[0], -1), axis=1)
    return np.where(slots >= 0, flat.reshape(slots.shape), -1)


class RowMap:
    """Storage row of every (rank, layer, slot); `rows: [G, L, S]` in `[0, S + R)`, read-only.

    Changed only by `switch`, called by the rank's MigrationExecutor at commit."""

    def __init__(
        self, num_gpus: int, num_layers: int, slots_per_rank: int, spare_rows: int = 0
    ) -> None:
        if min(num_gpus, num_layers, slots_per_rank) <= 0 or spare_rows < 0:
            raise ValueError(
                f"need positive ranks, layers and slots and spare_rows >= 0, got "
                f"{num_gpus}, {num_layers}, {slots_per_rank}, {spare_rows}"
            )
        self.num_gpus, self.num_layers = num_gpus, num_layers
        self.slots_per_rank, self.spare_rows = slots_per_rank, spare_rows
        identity = np.arange(slots_per_rank, dtype=np.int64)
        self._rows = _frozen(np.broadcast_to(identity, (num_gpus, num_layers, slots_per_rank)))

    @property
    def rows(self) -> np.ndarray:
        """`[G, L, S]` the row of every (rank, layer, slot) now (read-only)."""
        return self._rows

    def switch(self, rows: np.ndarray) -> None:
        """Make `rows` (a plan's, from `plan`) the rows served: the commit of a plan whose
        weights are in place. Only the MigrationExecutor that wrote them calls it."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.shape != self._rows.shape:
            raise ValueError(
                f"rows of shape {list(rows.shape)} for a row map of {list(self._rows.shape)}"
            )
        self._rows = _frozen(rows)

    @property
    def rows_per_rank(self) -> int:
        return self.slots_per_rank + self.spare_rows

    def digest(self) -> int:
        """A 63-bit fingerprint of the rows, to check that ranks agree on them."""
        raw = hashlib.blake2b(
            np.ascontiguousarray(self.rows, dtype=np.int64).tobytes(), digest_size=8
        )
        return int.from_bytes(raw.digest(), "little") >> 1

    def row_ids(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Global row id of every physical slot: `[L, P]`, slot `r * S + s` ->
        `r * (S + R) + row`."""
        rows = self.rows if rows is None else rows
        base = (np.arange(self.num_gpus, dtype=np.int64) * self.rows_per_rank)[:, None, None]
        return np.ascontiguousarray((rows + base).transpose(1, 0, 2).reshape(self.num_layers, -1))

    def plan(self, transfers: np.ndarray) -> np.ndarray:
        """The rows `[G, L, S]` once a plan commits; an incoming expert whose row differs
        from today's goes to that free row during prepare.

        transfers: [K, 5] (layer, dst_rank, dst_slot, src_rank, src_slot), the same list
        on every rank. For each (rank, layer), the destinations in the order of their
        sources' (rank, row) take the free rows (no slot maps to them) in row order, so
        experts adjacent at the source land adjacent (one copy for a run); those beyond
        the free rows keep their row and are written over at commit.
        """
        t = np.asarray(transfers, dtype=np.int64).reshape(-1, 5)
        rows = self.rows.copy()
        if not len(t) or not self.spare_rows:
            return rows
        src_row = self.rows[t[:, SRC_RANK], t[:, LAYER], t[:, SRC_SLOT]]
        order = np.lexsort((src_row, t[:, SRC_RANK], t[:, LAYER], t[:, DST_RANK]))
        key = t[order, DST_RANK] * self.num_layers + t[order, LAYER]
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        ends = np.r_[starts[1:], len(order)]
        for lo, hi in zip(starts, ends, strict=True):
            rank, layer = int(t[order[lo], DST_RANK]), int(t[order[lo], LAYER])
            used = np.zeros(self.rows_per_rank, dtype=bool)
            used[self.rows[rank, layer]] = True
            free = np.flatnonzero(~used)
            n = min(hi - lo, len(free))
            take = order[lo : lo + n]
            rows[rank, layer, t[take, DST_SLOT]] = free[:n]
        return rows
