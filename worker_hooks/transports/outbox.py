"""The "outbox" transport: as "ipc" (worker_hooks/transports/ipc.py), but senders pack
their rows into two shared outboxes of bounded size and receivers read from there, one
all-gather per step; for weights that cannot be mapped whole. Needs every rank of the
group on one host and a gloo group."""

from __future__ import annotations

import numpy as np
import torch

from rebalancer.wire.layout import DST_RANK, LAYER, SRC_RANK, SRC_SLOT
from worker_hooks.config import MigrationConfig
from worker_hooks.transports.base import PlanMoves, Received
from worker_hooks.transports.ipc import PeerMemoryTransport
from worker_hooks.transports.shared_memory import SharedOutboxes, outbox_schedule
from worker_hooks.weights import RankWeights


class OutboxTransport(PeerMemoryTransport):
    """Senders pack into two bounded shared outboxes, receivers read them (one host)."""

    name = "outbox"

    def __init__(self, ctx: RankWeights, config: MigrationConfig) -> None:
        super().__init__(ctx, config)
        self.outbox_rows = max(1, config.outbox_bytes // max(1, ctx.expert_bytes))
        self._outboxes: SharedOutboxes | None = None

    def connect(self) -> None:
        if self._outboxes is None:
            ctx = self.ctx
            shapes = {name: tuple(w.shape[2:]) for name, w in ctx.stacked.items()}
            self._outboxes = SharedOutboxes(
                ctx.rank, ctx.world_size, shapes, ctx.dtype, ctx.device, self.outbox_rows, ctx.group
            )

    def close(self) -> None:
        super().close()
        if self._outboxes is not None:
            self._outboxes.close()
            self._outboxes = None

    def receive(self, plan: PlanMoves) -> Received:
        """Step k: pack this rank's rows of step k into outbox k % 2, wait until every
        rank packed step k and finished reading step k - 1 (`_agree`, which also
        carries an abort seen by any rank so that all stop together), then pull step
        k's rows from each peer's outbox into staging. Reading step k overlaps packing
        step k + 1 into the other outbox.

        Staging rows: the remote experts in schedule order (source rank, layer, slot),
        then the local ones."""
        ctx, t, version = self.ctx, plan.transfers, plan.version
        self.connect()
        boxes = self._outboxes
        assert boxes is not None
        schedule = outbox_schedule(t, self.outbox_rows)
        step = schedule.step_of()
        row = schedule.position % schedule.rows
        mine_out = schedule.remote[:, SRC_RANK] == ctx.rank
        mine_in = schedule.remote[:, DST_RANK] == ctx.rank
        local = t[(t[:, DST_RANK] == ctx.rank) & (t[:, SRC_RANK] == ctx.rank)]
        incoming = np.concatenate([schedule.remote[mine_in], local])
        in_step, in_row = step[mine_in], row[mine_in]
        in_src = schedule.remote[mine_in, SRC_RANK]
        staging = ctx.new_staging(len(incoming))
        ctx.copy_local(local, staging, int(mine_in.sum()))
        sent = received = 0
        for k in range(schedule.steps):
            # 1. Pack step k (outbox k % 2 was last read in step k - 2: free).
            out_rows = schedule.remote[mine_out & (step == k)]
            box = boxes.own[k % 2]
            if len(out_rows):
                idx = ctx.flat_index(out_rows[:, LAYER], out_rows[:, SRC_SLOT])
                for name, w in ctx.stacked.items():
                    torch.index_select(ctx.flat(w), 0, idx, out=box[name][: len(out_rows)])
                sent += len(out_rows) * ctx.expert_bytes
            self._settle()  # packed, and step k - 1's reads are done
            # 2. Everyone packed k and read k - 1; any abort stops every rank here.
            self._agree(version)
            # 3. Read step k from each peer: one contiguous block per peer and weight.
            for peer in np.unique(in_src[in_step == k]):
                sel = np.flatnonzero((in_step == k) & (in_src == peer))
                lo, n = int(sel[0]), len(sel)
                first = int(in_row[sel[0]])
                src_box = boxes.peer[int(peer)][k % 2]
                with self._reading_from(next(iter(src_box.values())).device, lane=0):
                    for name in ctx.weights:
                        staging[name][lo : lo + n].copy_(
                            src_box[name][first : first + n], non_blocking=True
                        )
                received += n * ctx.expert_bytes
            self._pace(plan.start, received)
        self._sync_reads()
        # 4. No rank reuses its outboxes before every peer finished reading them.
        if schedule.steps:
            self._agree(version)
        return Received(staging, incoming, sent, received)
