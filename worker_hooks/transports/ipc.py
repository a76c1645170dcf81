"""The "ipc" transport, and what it shares with "outbox": reading the peers' memory on
this host.

Ranks of one host map each other's live weights once (CUDA IPC on GPU; on CPU the weights
must live in shared-memory files, worker_hooks/transports/shared_memory.py) and each
receiver reads the rows it gains straight from its peers with `copy_`: on GPU the copy
engines do the work, no kernel of the migration takes SMs from serving, and nothing is
packed or buffered. Safe because live weights change only at commit, and no rank commits
a plan before every rank prepared it; one all-gather at the start makes sure every peer
committed the plan's base version on its device (and carries an abort to all). Needs
every rank of the group on one host and a gloo group."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.wire.layout import DST_RANK, LAYER, SRC_RANK, SRC_SLOT
from worker_hooks.config import MigrationConfig
from worker_hooks.transports.base import PlanMoves, Received, WeightTransport
from worker_hooks.transports.shared_memory import map_peer_weights
from worker_hooks.weights import MigrationAborted, RankWeights


class PeerMemoryTransport(WeightTransport):
    """What the transports that read their peers' memory on this host share: read
    streams, and one collective that checks the ranks agree before reading."""

    one_host = True

    def __init__(self, ctx: RankWeights, config: MigrationConfig) -> None:
        super().__init__(ctx, config)
        # Streams that peer reads run on, by (device index, lane); made once.
        self._read_streams: dict[tuple[int | None, int], torch.cuda.Stream] = {}

    def close(self) -> None:
        self._read_streams.clear()

    def _settle(self) -> None:
        super()._settle()
        self._sync_reads()

    def _reading_from(self, src: torch.device, lane: int) -> contextlib.ExitStack:
        """Run `copy_` from a peer's memory on `src` on read streams of its own at both
        ends (torch copies between devices on the source's current stream, then makes
        the destination's current stream wait): reads stay off serving's stream and off
        the side stream, whose packing they then overlap. No-op on CPU."""
        ctx = contextlib.ExitStack()
        if self.ctx.device.type == "cuda":
            for dev in (self.ctx.device, src):
                key = (dev.index, lane)
                if key not in self._read_streams:
                    self._read_streams[key] = torch.cuda.Stream(dev)
                ctx.enter_context(torch.cuda.stream(self._read_streams[key]))
        return ctx

    def _sync_reads(self) -> None:
        for stream in self._read_streams.values():
            stream.synchronize()

    def _agree(self, version: int) -> None:
        """Collective on the group: every rank got here in plan `version`, with the same
        rows for every rank (a peer's expert is read where this rank's row map says it
        is). An abort seen by any rank stops all of them here together, none is left
        waiting; a disagreement fails the plan on every rank."""
        ctx = self.ctx
        state = torch.tensor(
            [int(version in ctx.aborted), version, ctx.row_map.digest()], dtype=torch.int64
        )
        states = [torch.zeros_like(state) for _ in range(ctx.world_size)]
        dist.all_gather(states, state, group=ctx.group)
        if any(int(s[0]) for s in states):
            raise MigrationAborted(f"plan v{version} aborted while preparing")
        if len({int(s[1]) for s in states}) > 1:
            raise RuntimeError(f"ranks prepare different plans: {[int(s[1]) for s in states]}")
        digests = [int(s[2]) for s in states]
        if len(set(digests)) > 1:
            odd = [r for r, d in enumerate(digests) if digests.count(d) == 1]
            raise RuntimeError(
                f"ranks disagree on where the weights of the EP group are (row maps differ; "
                f"rank(s) {odd or list(range(ctx.world_size))} differ): a rank restarted "
                "alone? Restart the whole EP group"
            )


class IpcTransport(PeerMemoryTransport):
    """Receivers read their rows from the peers' mapped live weights (one host)."""

    name = "ipc"
    maps_live_weights = True

    def __init__(self, ctx: RankWeights, config: MigrationConfig) -> None:
        super().__init__(ctx, config)
        self._peer_weights: dict[int, dict[str, torch.Tensor]] | None = None

    def connect(self) -> None:
        if self._peer_weights is None:
            ctx = self.ctx
            self._peer_weights = map_peer_weights(ctx.rank, ctx.world_size, ctx.stacked, ctx.group)

    def close(self) -> None:
        self._peer_weights = None
        super().close()

    def receive(self, plan: PlanMoves) -> Received:
        """Read each gained row from the peer's live weights, straight into its free row
        where `plan.new_rows` gives it one, else into staging (returned with its incoming
        rows). Rows are ordered by (source rank, layer, source slot), so rows adjacent in
        a peer's weights and at the destination are one `copy_` per weight."""
        ctx, t, version = self.ctx, plan.transfers, plan.version
        # 1. Every rank's last commit is done on its device, nobody aborted, and all
        #    prepare the same plan (each rank's hook checked the plan's base version).
        if ctx.commit_event is not None:
            ctx.commit_event.synchronize()
        self._agree(version)
        self.connect()
        assert self._peer_weights is not None
        # 2. Incoming rows, sorted so that runs of adjacent source rows are contiguous
        #    (free rows are handed out in the same order, rows.RowMap.plan); each goes to
        #    its free row (live weights) or to the next staging row.
        incoming = t[t[:, DST_RANK] == ctx.rank]
        src_row = (
            incoming[:, LAYER] * ctx.rows_per_layer
            + ctx.row_map.rows[incoming[:, SRC_RANK], incoming[:, LAYER], incoming[:, SRC_SLOT]]
        )
        order = np.lexsort((src_row, incoming[:, SRC_RANK]))
        incoming, src_row = incoming[order], src_row[order]
        live, live_row = ctx.free_rows_of(plan.new_rows, incoming)
        staged = incoming[~live]
        staging = ctx.new_staging(len(staged))
        dst_row = np.where(live, live_row, np.cumsum(~live) - 1)
        breaks = (
            np.flatnonzero(
                (np.diff(src_row) != 1)
                | (np.diff(incoming[:, SRC_RANK]) != 0)
                | (np.diff(dst_row) != 1)
                | (np.diff(live.astype(np.int8)) != 0)
            )
            + 1
        )
        runs = np.split(np.arange(len(incoming)), breaks) if len(incoming) else []
        own = {name: ctx.flat(w) for name, w in ctx.stacked.items()}
        received = 0
        for i, run in enumerate(runs):
            ctx.check_aborted(version)
            lo, n = int(run[0]), len(run)
            peer = int(incoming[lo, SRC_RANK])
            first, to = int(src_row[lo]), int(dst_row[lo])
            target = own if live[lo] else staging
            if peer == ctx.rank:  # a local move: free rows and mapped rows never overlap
                for name in ctx.weights:
                    target[name][to : to + n].copy_(own[name][first : first + n])
                continue
            peer_weights = self._peer_weights[peer]
            src = next(iter(peer_weights.values())).device
            with self._reading_from(src, lane=i % self.config.copy_streams):
                for name, w in peer_weights.items():
                    target[name][to : to + n].copy_(
                        ctx.flat(w)[first : first + n], non_blocking=True
                    )
            received += n * ctx.expert_bytes
            self._pace(plan.start, received)
        self._sync_reads()
        # Senders do no work: their rows are read by the receivers.
        sent = int(((t[:, SRC_RANK] == ctx.rank) & (t[:, DST_RANK] != ctx.rank)).sum())
        return Received(staging, staged, sent * ctx.expert_bytes, received)
