"""Moving expert weights between ranks for a plan, off the serving path: the executor.

`MigrationExecutor` runs a plan's life on one rank: `prepare` receives every expert the
rank gains, `commit` makes them live, `abort` drops them. How the experts travel is one
`WeightTransport` (worker_hooks/transports/: "p2p", "ipc" or "outbox"), picked from
`MigrationConfig.transport` (worker_hooks/config.py); the executor sees only its
`connect` / `receive` / `close`. The rank's weights and the row writer are in
worker_hooks/weights.py.
Before any transport moves a weight, every rank of the group takes the plan (or none
does) through the group's store (worker_hooks/fence.py): a transfer never waits for a
rank that will not run it.
Serving keeps using the live weights meanwhile; `max_gbps` paces any transport so an
operator can bound its interference. With spare rows (worker_hooks/rows.py) each
incoming expert goes into a free row of the live weights during prepare (the ipc
transport reads it straight there; the executor writes the others' received experts
there), and commit only moves the row map (the caller swaps the dispatch maps): no
weight is copied in the pause. Without them, or beyond them, `commit` copies staging
into the live weights in place (storage unchanged: CUDA graphs stay valid); `abort`
drops staging.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.wire.layout import DST_RANK, DST_SLOT, LAYER, SRC_RANK, SRC_SLOT
from worker_hooks.config import MigrationConfig
from worker_hooks.fence import ABORTED, TransferFence, TransfersDeclined, group_store
from worker_hooks.rows import RowMap
from worker_hooks.transports import make_transport, transport_class
from worker_hooks.transports.base import PlanMoves
from worker_hooks.weights import LayerWeights, MigrationAborted, RankWeights, RowWriter


@dataclass(frozen=True)
class PrepareStats:
    version: int
    experts_received: int
    bytes_received: int
    bytes_sent: int
    seconds: float


class MigrationExecutor:
    """Stages, commits or drops the expert weights of one plan at a time.

    Args:
        rank, world_size: this rank within `group`.
        weights: name -> live tensor `[L, S + R, ...]` (S slots on this rank, R spare
            rows); all tensors share one dtype and device.
        group: the process group for transfers (keep it apart from serving's).
        config: the transport and its settings (MigrationConfig; default p2p).
        row_map: the rows of every rank (worker_hooks/rows.py); from here on this
            executor moves it (at commit), the caller only reads it (for dispatch);
            default: no spare rows.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        weights: dict[str, torch.Tensor] | LayerWeights,
        group: dist.ProcessGroup | None = None,
        config: MigrationConfig | None = None,
        row_map: RowMap | None = None,
    ) -> None:
        self.config = config if config is not None else MigrationConfig()
        self.ctx = RankWeights(rank, world_size, weights, group, row_map)
        if self.ctx.by_layer is not None and transport_class(self.config.transport).one_host:
            raise ValueError(
                f"transport {self.config.transport!r} maps one tensor per weight: "
                "per-layer weights move with 'p2p'"
            )
        self.transport = make_transport(self.config, self.ctx)
        self.weights = weights
        self.row_map = self.ctx.row_map
        self._lock = threading.Lock()
        self._staged_version: int | None = None
        self._staging: dict[str, torch.Tensor] | None = None  # name -> [n_in, ...]
        self._staged_writer: RowWriter | None = None  # staging row i -> its live row
        self._staged_rows: np.ndarray | None = None  # [G, L, S] after commit
        # No rank moves a plan's weights before every rank of the group said it will
        # (a rank left waiting for a peer that never comes breaks the group for good).
        shared = group_store(group) if world_size > 1 else None
        self.fence = (
            TransferFence(shared[0], rank, world_size, self.config.join_seconds, prefix=shared[1])
            if shared is not None
            else None
        )

    @property
    def staged_rows(self) -> np.ndarray | None:
        """The rows of every rank `[G, L, S]` once the staged plan commits."""
        return self._staged_rows

    def connect(self) -> None:
        """The transport's collective setup (mapping the peers' weights or outboxes), done
        by the first prepare unless called earlier (at startup, say)."""
        self.transport.connect()

    def close(self) -> None:
        """Release what the transport holds (the peers' mapped weights, the outboxes)."""
        self.transport.close()

    # ------------------------------------------------------------ prepare

    def decline(self, version: int, reason: str) -> None:
        """This rank will not take plan `version`: no rank runs its transfers, and its
        peers fail the plan at once (raises TransfersDeclined, with `reason`)."""
        if self.fence is not None:
            self.fence.decline(version, reason)
        raise TransfersDeclined(reason)

    def _join(self, version: int) -> None:
        """Wait until every rank of the group takes plan `version` (fence.py). Raises
        MigrationAborted if this rank's Abort came first, TransfersDeclined if a peer
        declined or did not join in time."""
        if self.fence is None:
            return
        aborted = self.ctx.aborted
        try:
            self.fence.join(version, lambda: ABORTED if version in aborted else "")
        except TransfersDeclined as exc:
            self.ctx.check_aborted(version)
            if exc.aborted:  # a peer heard the Abort first: this rank will hear it too
                raise MigrationAborted(
                    f"plan v{version} aborted before its transfers ({exc})"
                ) from exc
            raise

    def prepare(self, version: int, transfers: np.ndarray) -> PrepareStats:
        """Receive this rank's incoming experts of plan `version` into staging.

        transfers: [K, 5] int (layer, dst_rank, dst_slot, src_rank, src_slot), the
        same list on every rank. First every rank of the group takes the plan (or none
        does: TransfersDeclined, within `join_seconds`); then blocks the calling
        (background) thread until every exchange of this rank finished, raises on a
        failed peer, and raises MigrationAborted when the plan is aborted meanwhile.
        """
        start = time.perf_counter()
        ctx = self.ctx
        t = np.asarray(transfers, dtype=np.int64).reshape(-1, 5)
        if t.size and (
            t[:, [DST_RANK, SRC_RANK]].max() >= ctx.world_size
            or t.min() < 0
            or t[:, [DST_SLOT, SRC_SLOT]].max() >= ctx.slots_per_rank
            or t[:, LAYER].max() >= ctx.num_layers
        ):
            raise ValueError("transfer list refers to ranks, slots or layers out of range")
        if t.size and not set(np.unique(t[:, LAYER]).tolist()) <= ctx.layers_with_weights:
            raise ValueError("transfer list moves experts of layers that hold no expert weights")
        # The current CUDA device is per thread: prepare runs on a background thread
        # whose device would otherwise be cuda:0 (NCCL and events need this rank's).
        stream_ctx = contextlib.ExitStack()
        if ctx.stream is not None:
            stream_ctx.enter_context(torch.cuda.device(ctx.device))
            stream_ctx.enter_context(torch.cuda.stream(ctx.stream))
        self._join(version)
        new_rows = self.row_map.plan(t)
        experts_in = int((t[:, DST_RANK] == ctx.rank).sum())
        with stream_ctx:
            got = self.transport.receive(PlanMoves(version, t, new_rows, start))
            staging, incoming = self._fill_free_rows(new_rows, got.staging, got.incoming)
            # Built here, on the side stream: made on the thread's default stream, its
            # host-to-device copy would wait for every replay serving has queued there.
            writer = ctx.writer(incoming[:, LAYER], incoming[:, DST_SLOT])
        if ctx.stream is not None:
            ctx.stream.synchronize()
        with self._lock:
            ctx.check_aborted(version)
            self._staging, self._staged_writer, self._staged_version = staging, writer, version
            self._staged_rows = new_rows
        return PrepareStats(
            version, experts_in, got.bytes_received, got.bytes_sent, time.perf_counter() - start
        )

    def _fill_free_rows(
        self, new_rows: np.ndarray, staging: dict[str, torch.Tensor], incoming: np.ndarray
    ) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """Write the received experts that get a free row under `new_rows` into it now;
        returns the staging and incoming rows left for commit to copy in place."""
        ctx = self.ctx
        take, rows = ctx.free_rows_of(new_rows, incoming)
        if not take.any():
            return staging, incoming
        # Rows freed by the last commit may still be read by replays queued before it.
        if ctx.commit_event is not None and ctx.stream is not None:
            ctx.stream.wait_event(ctx.commit_event)
        dst = torch.as_tensor(rows[take], dtype=torch.int64, device=ctx.device)
        if take.all():
            for name, w in ctx.stacked.items():
                ctx.flat(w).index_copy_(0, dst, staging[name])
            return ctx.new_staging(0), incoming[:0]
        src = torch.as_tensor(np.flatnonzero(take), dtype=torch.int64, device=ctx.device)
        for name, w in ctx.stacked.items():
            ctx.flat(w).index_copy_(0, dst, staging[name].index_select(0, src))
        keep = torch.as_tensor(np.flatnonzero(~take), dtype=torch.int64, device=ctx.device)
        rest = {name: buf.index_select(0, keep) for name, buf in staging.items()}
        return rest, incoming[~take]

    # ------------------------------------------------------------ commit / abort

    def commit(self, version: int) -> int:
        """Make the staged plan live: copy the staged experts (those without a free row)
        into their rows in place, then move the row map; returns experts written.

        One `index_copy_` per weight on its flat [L * (S + R), ...] view (per weight and
        layer for LayerWeights). Call between
        forward steps (between graph replays): storage never changes."""
        ctx = self.ctx
        with self._lock:
            if (
                self._staged_version != version
                or self._staging is None
                or self._staged_writer is None
                or self._staged_rows is None
            ):
                raise RuntimeError(f"commit of v{version} but staged is v{self._staged_version}")
            staging, writer, rows = self._staging, self._staged_writer, self._staged_rows
            self._staging = self._staged_writer = self._staged_rows = None
            self._staged_version = None
        writer.write(staging)
        self.row_map.switch(rows)  # this executor owns the rows (worker_hooks/rows.py)
        if ctx.device.type == "cuda":  # peers read these rows once the copy is done
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(ctx.device))
            ctx.commit_event = event
        return len(writer)

    def abort(self, version: int) -> None:
        """Drop the staging of `version` (also while it is still being prepared)."""
        with self._lock:
            self.ctx.aborted.add(version)
            if self._staged_version == version:
                self._staging = self._staged_writer = self._staged_rows = None
                self._staged_version = None
