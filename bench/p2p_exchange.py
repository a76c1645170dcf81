"""Expert moves as a few large NCCL messages received straight into staging.

The reference the migration figures are held against: for each chunk of the plan and
each peer, the outgoing experts of every weight tensor are gathered into one
contiguous send buffer (one `index_select`), sent as one message, and received
directly into a contiguous slice of the staging tensor (no copy after the receive
whenever a peer's rows are contiguous in the canonical order: always with 2 ranks).
Two send buffers alternate so that gathering chunk i+1 overlaps sending chunk i.
Committing is one `index_copy_` per weight tensor of `Staged.tensors` at
`Staged.dst_rows` of the flat `[L * S, ...]` view (as `MigrationExecutor.commit`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.wire.layout import DST_RANK, DST_SLOT, LAYER, SRC_RANK, SRC_SLOT


@dataclass
class Staged:
    """Experts received for one plan: per tensor `[n_in, ...]`, and where they go."""

    tensors: dict[str, torch.Tensor]
    dst_rows: torch.Tensor  # [n_in] flat row (layer * S + slot) of the live weights
    bytes_sent: int
    bytes_received: int
    seconds: float


def _flat(w: torch.Tensor) -> torch.Tensor:
    return w.view(w.shape[0] * w.shape[1], *w.shape[2:])


def packed_exchange(
    rank: int,
    world: int,
    weights: dict[str, torch.Tensor],
    plan: np.ndarray,
    group: dist.ProcessGroup,
    chunk_experts: int = 32,
    stream: torch.cuda.Stream | None = None,
) -> Staged:
    """Stage this rank's incoming experts of `plan` ([K, 5] rows as in
    worker_hooks/migration.py)."""
    start = time.perf_counter()
    first = next(iter(weights.values()))
    slots = first.shape[1]
    dev = first.device
    flat = {k: _flat(w) for k, w in weights.items()}
    t = np.asarray(plan, dtype=np.int64).reshape(-1, 5)
    t = t[np.lexsort((t[:, DST_SLOT], t[:, DST_RANK], t[:, LAYER]))]
    incoming = t[t[:, DST_RANK] == rank]
    n_in = len(incoming)
    staged = {
        k: torch.empty((n_in, *w.shape[1:]), dtype=w.dtype, device=dev) for k, w in flat.items()
    }
    dst_rows = torch.as_tensor(incoming[:, LAYER] * slots + incoming[:, DST_SLOT], device=dev)
    on_gpu = dev.type == "cuda"
    if on_gpu:
        stream = stream or torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
    sent = received = 0
    buffers = [
        {
            k: torch.empty((chunk_experts, *w.shape[1:]), dtype=w.dtype, device=dev)
            for k, w in flat.items()
        }
        for _ in range(2)
    ]
    pending: list[list[dist.Work] | None] = [None, None]
    with torch.cuda.stream(stream) if on_gpu else contextlib.nullcontext():
        # Moves inside this rank: straight from live weights to staging.
        local = np.nonzero(incoming[:, SRC_RANK] == rank)[0]
        if len(local):
            src = torch.as_tensor(
                incoming[local, LAYER] * slots + incoming[local, SRC_SLOT], device=dev
            )
            pos = torch.as_tensor(local, device=dev)
            for k in flat:
                staged[k].index_copy_(0, pos, flat[k].index_select(0, src))
        # Rows of `incoming` per source peer keep the canonical order the sender uses.
        turn = 0
        for peer in range(world):
            if peer == rank:
                continue
            out_rows = t[(t[:, SRC_RANK] == rank) & (t[:, DST_RANK] == peer)]
            in_pos = np.nonzero(incoming[:, SRC_RANK] == peer)[0]
            out_src = torch.as_tensor(
                out_rows[:, LAYER] * slots + out_rows[:, SRC_SLOT], device=dev
            )
            # With two ranks (or any plan whose rows from this peer are contiguous in
            # the canonical order) the receive lands in staging itself.
            contiguous = len(in_pos) > 0 and in_pos[-1] - in_pos[0] + 1 == len(in_pos)
            if contiguous:
                a, b = int(in_pos[0]), int(in_pos[-1]) + 1
                recv_block = {k: staged[k][a:b] for k in flat}
            else:
                recv_block = {
                    k: torch.empty((len(in_pos), *w.shape[1:]), dtype=w.dtype, device=dev)
                    for k, w in flat.items()
                }
            n_chunks = max(-(-len(out_rows) // chunk_experts), -(-len(in_pos) // chunk_experts))
            for c in range(n_chunks):
                lo, hi = c * chunk_experts, (c + 1) * chunk_experts
                buf = buffers[turn % 2]
                if pending[turn % 2] is not None:
                    for work in pending[turn % 2]:  # type: ignore[union-attr]
                        work.wait()  # the stream waits for the send that used this buffer
                ops = []
                n_out = max(0, min(hi, len(out_rows)) - lo)
                if n_out:
                    for k in flat:
                        torch.index_select(flat[k], 0, out_src[lo : lo + n_out], out=buf[k][:n_out])
                        ops.append(dist.P2POp(dist.isend, buf[k][:n_out], peer, group))
                        sent += buf[k][:n_out].numel() * buf[k].element_size()
                n_recv = max(0, min(hi, len(in_pos)) - lo)
                if n_recv:
                    for k in flat:
                        part = recv_block[k][lo : lo + n_recv]
                        ops.append(dist.P2POp(dist.irecv, part, peer, group))
                        received += part.numel() * part.element_size()
                pending[turn % 2] = dist.batch_isend_irecv(ops) if ops else None
                turn += 1
            for works in pending:
                for work in works or []:
                    work.wait()
            pending = [None, None]
            if len(in_pos) and not contiguous:
                pos = torch.as_tensor(in_pos, device=dev)
                for k in flat:
                    staged[k].index_copy_(0, pos, recv_block[k])
    if on_gpu:
        assert stream is not None
        stream.synchronize()
    return Staged(staged, dst_rows, sent, received, time.perf_counter() - start)
