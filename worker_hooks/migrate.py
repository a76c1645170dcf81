"""Moving expert weights between ranks for a plan, off the serving path.

`prepare` receives every expert a rank gains into staging buffers with
torch.distributed point-to-point transfers on a process group of its own
(gloo on CPU, NCCL on GPU, on a side stream there), a few layers per round:
in each round each pair of ranks exchanges one packed buffer per weight tensor,
received in place into staging, so transfers are large and few. Serving keeps using the live
weights meanwhile. `commit` copies staging into the live weights in place
(storage unchanged: CUDA graphs stay valid); `abort` drops staging.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

# Columns of a transfer list (see proto Prepare.transfers).
LAYER, DST_RANK, DST_SLOT, SRC_RANK, SRC_SLOT = range(5)


@dataclass(frozen=True)
class PrepareStats:
    version: int
    experts_received: int
    bytes_received: int
    bytes_sent: int
    seconds: float


class MigrationAborted(RuntimeError):
    pass


class MigrationExecutor:
    """Stages, commits or drops the expert weights of one plan at a time.

    Args:
        rank, world_size: this rank within `group`.
        weights: name -> live tensor `[L, S, ...]` (S = slots on this rank); all
            tensors share one dtype and device.
        group: the process group for transfers (keep it apart from serving's).
        layers_per_chunk: layers exchanged per round of transfers.
        rounds_in_flight: rounds posted before the oldest is waited for; above 1 the
            packing of a round overlaps the transfers of the previous ones (correct on
            gloo, tests/unit/worker_hooks/test_migrate.py; not yet measured on GPU, so
            the default keeps the measured one-round-at-a-time behaviour).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        weights: dict[str, torch.Tensor],
        group: dist.ProcessGroup | None = None,
        layers_per_chunk: int = 4,
        rounds_in_flight: int = 1,
    ) -> None:
        if not weights:
            raise ValueError("weights must name at least one tensor")
        first = next(iter(weights.values()))
        for name, w in weights.items():
            if w.shape[:2] != first.shape[:2] or w.dtype != first.dtype or w.device != first.device:
                raise ValueError(f"weight {name!r} must share [L, S], dtype and device with the others")
        self.rank, self.world_size = rank, world_size
        self.weights = weights
        self.group = group
        self.layers_per_chunk = max(1, layers_per_chunk)
        self.rounds_in_flight = max(1, rounds_in_flight)
        self.num_layers, self.slots_per_rank = int(first.shape[0]), int(first.shape[1])
        self.device = first.device
        self.dtype = first.dtype
        for name, w in weights.items():
            if not w.is_contiguous():
                raise ValueError(f"weight {name!r} must be contiguous (its flat view is updated in place)")
        self.expert_bytes = sum(int(np.prod(w.shape[2:])) for w in weights.values()) * first.element_size()
        self._lock = threading.Lock()
        self._staged_version: int | None = None
        self._staging: dict[str, torch.Tensor] | None = None  # name -> [n_in, ...]
        self._staged_index: torch.Tensor | None = None         # [n_in] flat row of each
        self._aborted: set[int] = set()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def staged_version(self) -> int | None:
        return self._staged_version

    # ------------------------------------------------------------ helpers

    def _flat_index(self, layers: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """(layer, slot) pairs as row indices of the flat [L * S, ...] weight views."""
        return torch.as_tensor(layers * self.slots_per_rank + slots, dtype=torch.int64, device=self.device)

    def _flat(self, w: torch.Tensor) -> torch.Tensor:
        return w.view((self.num_layers * self.slots_per_rank,) + tuple(w.shape[2:]))

    # ------------------------------------------------------------ prepare

    def prepare(self, version: int, transfers: np.ndarray) -> PrepareStats:
        """Receive this rank's incoming experts of plan `version` into staging.

        transfers: [K, 5] int (layer, dst_rank, dst_slot, src_rank, src_slot), the
        same list on every rank. Blocks the calling (background) thread until
        every exchange of this rank finished; raises on a failed peer.

        Staging holds one contiguous tensor per weight, its rows ordered by (round,
        source rank, layer, slot): the experts one peer sends in one round are one
        contiguous block, received in place with no copy afterwards. Each round
        sends one `index_select`-packed buffer per weight and peer.
        """
        start = time.perf_counter()
        t = np.asarray(transfers, dtype=np.int64).reshape(-1, 5)
        if t.size and (t[:, [DST_RANK, SRC_RANK]].max() >= self.world_size or t.min() < 0
                       or t[:, [DST_SLOT, SRC_SLOT]].max() >= self.slots_per_rank
                       or t[:, LAYER].max() >= self.num_layers):
            raise ValueError("transfer list refers to ranks, slots or layers out of range")
        # 1. One order on every rank: round, then source rank, then layer and slot.
        rounds = t[:, LAYER] // self.layers_per_chunk
        t = t[np.lexsort((t[:, DST_SLOT], t[:, LAYER], t[:, DST_RANK], t[:, SRC_RANK], rounds))]
        rounds = t[:, LAYER] // self.layers_per_chunk
        incoming = t[t[:, DST_RANK] == self.rank]
        in_rounds = incoming[:, LAYER] // self.layers_per_chunk
        # 2. Staging, allocated on the side stream that fills it.
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        sent = received = 0
        with stream_ctx:
            staging = {
                name: torch.empty((len(incoming),) + tuple(w.shape[2:]), dtype=self.dtype, device=self.device)
                for name, w in self.weights.items()
            }
            # Rounds are pipelined: round r+1 is packed while round r is on the wire,
            # with at most `rounds_in_flight` rounds (and their send buffers) alive.
            in_flight: deque[list[dist.Work]] = deque()
            for r in np.unique(rounds):
                if version in self._aborted:
                    raise MigrationAborted(f"plan v{version} aborted while preparing")
                while len(in_flight) >= self.rounds_in_flight:
                    for work in in_flight.popleft():
                        work.wait()
                chunk = t[rounds == r]
                ops = []
                for peer in range(self.world_size):
                    in_mask = (in_rounds == r) & (incoming[:, SRC_RANK] == peer)
                    lo = int(np.argmax(in_mask)) if in_mask.any() else 0
                    hi = lo + int(in_mask.sum())
                    if peer == self.rank:  # local moves: straight into staging
                        if hi > lo:
                            idx = self._flat_index(incoming[lo:hi, LAYER], incoming[lo:hi, SRC_SLOT])
                            for name, w in self.weights.items():
                                torch.index_select(self._flat(w), 0, idx, out=staging[name][lo:hi])
                        continue
                    out_rows = chunk[(chunk[:, SRC_RANK] == self.rank) & (chunk[:, DST_RANK] == peer)]
                    if len(out_rows):
                        idx = self._flat_index(out_rows[:, LAYER], out_rows[:, SRC_SLOT])
                        for w in self.weights.values():
                            buf = self._flat(w).index_select(0, idx)
                            ops.append(dist.P2POp(dist.isend, buf, peer, self.group))
                            sent += buf.numel() * buf.element_size()
                    if hi > lo:
                        for name in self.weights:
                            view = staging[name][lo:hi]  # contiguous rows: received in place
                            ops.append(dist.P2POp(dist.irecv, view, peer, self.group))
                            received += view.numel() * view.element_size()
                if ops:
                    in_flight.append(dist.batch_isend_irecv(ops))
            while in_flight:
                for work in in_flight.popleft():
                    work.wait()
        if self._stream is not None:
            self._stream.synchronize()
        index = self._flat_index(incoming[:, LAYER], incoming[:, DST_SLOT])
        with self._lock:
            if version in self._aborted:
                raise MigrationAborted(f"plan v{version} aborted while preparing")
            self._staging, self._staged_index, self._staged_version = staging, index, version
        return PrepareStats(version, len(incoming), received, sent, time.perf_counter() - start)

    # ------------------------------------------------------------ commit / abort

    def commit(self, version: int) -> int:
        """Copy staged experts into the live weights in place; returns experts written.

        One `index_copy_` per weight on its flat [L * S, ...] view. Call between
        forward steps (between graph replays): storage never changes."""
        with self._lock:
            if self._staged_version != version or self._staging is None or self._staged_index is None:
                raise RuntimeError(f"commit of v{version} but staged is v{self._staged_version}")
            staging, index = self._staging, self._staged_index
            self._staging = self._staged_index = None
            self._staged_version = None
        if len(index):
            for name, w in self.weights.items():
                self._flat(w).index_copy_(0, index, staging[name])
        return len(index)

    def abort(self, version: int) -> None:
        """Drop the staging of `version` (also while it is still being prepared)."""
        with self._lock:
            self._aborted.add(version)
            if self._staged_version == version:
                self._staging = self._staged_index = None
                self._staged_version = None

