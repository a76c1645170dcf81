"""The "p2p" transport: torch.distributed point-to-point transfers on a process group of
its own (gloo on CPU, NCCL on GPU, on a side stream there), a few layers per round: in
each round each pair of ranks exchanges one packed buffer per weight tensor, received in
place into staging, so transfers are large and few. Works across hosts; on GPU its
kernels take SMs from serving."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch.distributed as dist

from rebalancer.wire.layout import DST_RANK, DST_SLOT, LAYER, SRC_RANK, SRC_SLOT
from worker_hooks.transports.base import PlanMoves, Received, WeightTransport


def plan_tag(version: int) -> int:
    """The point-to-point tag of plan `version`'s messages: positive, fits a C int, and
    differs between consecutive plans."""
    return 1 + version % (2**31 - 2)


class P2PTransport(WeightTransport):
    """torch.distributed send/recv on the group, a few layers per round (any hosts)."""

    name = "p2p"

    def connect(self) -> None:
        """Nothing to set up: the process group is all it needs."""

    def close(self) -> None:
        """Nothing to release."""

    def receive(self, plan: PlanMoves) -> Received:
        """Staging holds one contiguous tensor per weight, its rows ordered by (round,
        source rank, layer, slot): the experts one peer sends in one round are one
        contiguous block, received in place with no copy afterwards. Each round
        sends one `index_select`-packed buffer per weight and peer."""
        ctx, per_round = self.ctx, self.config.layers_per_chunk
        t = plan.transfers
        # 1. One order on every rank: round, then source rank, then layer and slot.
        rounds = t[:, LAYER] // per_round
        t = t[np.lexsort((t[:, DST_SLOT], t[:, LAYER], t[:, DST_RANK], t[:, SRC_RANK], rounds))]
        rounds = t[:, LAYER] // per_round
        incoming = t[t[:, DST_RANK] == ctx.rank]
        in_rounds = incoming[:, LAYER] // per_round
        # 2. Staging, allocated on the side stream that fills it.
        staging = ctx.new_staging(len(incoming))
        sent = received = 0
        # 3. Rounds are pipelined: round r+1 is packed while round r is on the wire,
        #    with at most `rounds_in_flight` rounds (and their send buffers) alive.
        in_flight: deque[list[dist.Work]] = deque()
        # Each plan's messages carry a tag of their own: a plan aborted on one rank
        # mid-exchange leaves its peers' buffers on the wire, and on a shared tag the next
        # plan's receives would take them (a size mismatch aborts the process in gloo).
        tag = plan_tag(plan.version)
        # An abort does not stop the exchange half-way: the peers would wait for this
        # rank's buffers until their group times out (and gloo closes its pairs for good).
        # Every rank runs every round; the executor drops the staging after (invariant 5).
        for r in np.unique(rounds):
            while len(in_flight) >= self.config.rounds_in_flight:
                for work in in_flight.popleft():
                    work.wait()
            chunk = t[rounds == r]
            ops = []
            for peer in range(ctx.world_size):
                in_mask = (in_rounds == r) & (incoming[:, SRC_RANK] == peer)
                lo = int(np.argmax(in_mask)) if in_mask.any() else 0
                hi = lo + int(in_mask.sum())
                if peer == ctx.rank:  # local moves: straight into staging
                    ctx.copy_local(incoming[lo:hi], staging, lo)
                    continue
                out_rows = chunk[(chunk[:, SRC_RANK] == ctx.rank) & (chunk[:, DST_RANK] == peer)]
                if len(out_rows):
                    for name in ctx.weights:
                        buf = ctx.gather(name, out_rows[:, LAYER], out_rows[:, SRC_SLOT])
                        ops.append(dist.P2POp(dist.isend, buf, peer, ctx.group, tag))
                        sent += buf.numel() * buf.element_size()
                if hi > lo:
                    for name in ctx.weights:
                        view = staging[name][lo:hi]  # contiguous rows: received in place
                        ops.append(dist.P2POp(dist.irecv, view, peer, ctx.group, tag))
                        received += view.numel() * view.element_size()
            if ops:
                in_flight.append(dist.batch_isend_irecv(ops))
            self._pace(plan.start, received)
        while in_flight:
            for work in in_flight.popleft():
                work.wait()
        return Received(staging, incoming, sent, received)
