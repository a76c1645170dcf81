"""Moving expert weights between ranks for a plan, off the serving path.

`prepare` receives every expert a rank gains into staging buffers with
torch.distributed point-to-point transfers on a process group of its own
(gloo on CPU, NCCL on GPU, on a side stream there), a few layers at a time:
for each chunk of layers, each pair of ranks exchanges one packed buffer, so
transfers are large and their number small. Serving keeps using the live
weights meanwhile. `commit` copies staging into the live weights in place
(storage unchanged: CUDA graphs stay valid); `abort` drops staging.
"""

from __future__ import annotations

import contextlib
import threading
import time
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
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        weights: dict[str, torch.Tensor],
        group: dist.ProcessGroup | None = None,
        layers_per_chunk: int = 4,
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
        self.num_layers, self.slots_per_rank = int(first.shape[0]), int(first.shape[1])
        self.device = first.device
        self.dtype = first.dtype
        # Elements of one expert across all named tensors, and each tensor's share.
        self._sizes = [int(np.prod(w.shape[2:])) for w in weights.values()]
        self.expert_numel = sum(self._sizes)
        self.expert_bytes = self.expert_numel * first.element_size()
        self._lock = threading.Lock()
        self._staged_version: int | None = None
        self._staging: torch.Tensor | None = None        # [n_in, expert_numel]
        self._staged_index: torch.Tensor | None = None   # [n_in, 2] (layer, local slot)
        self._aborted: set[int] = set()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def staged_version(self) -> int | None:
        return self._staged_version

    # ------------------------------------------------------------ packing

    def _pack(self, layers: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """Experts at (layer, slot) pairs as one [n, expert_numel] buffer."""
        li = torch.as_tensor(layers, device=self.device)
        si = torch.as_tensor(slots, device=self.device)
        parts = [w[li, si].reshape(len(layers), -1) for w in self.weights.values()]
        return torch.cat(parts, dim=1)

    def _unpack_into(self, flat: torch.Tensor, layers: torch.Tensor, slots: torch.Tensor) -> None:
        offset = 0
        for size, w in zip(self._sizes, self.weights.values(), strict=True):
            part = flat[:, offset:offset + size].reshape((flat.shape[0],) + tuple(w.shape[2:]))
            w[layers, slots] = part
            offset += size

    # ------------------------------------------------------------ prepare

    def prepare(self, version: int, transfers: np.ndarray) -> PrepareStats:
        """Receive this rank's incoming experts of plan `version` into staging.

        transfers: [K, 5] int (layer, dst_rank, dst_slot, src_rank, src_slot), the
        same list on every rank. Blocks the calling (background) thread until
        every exchange of this rank finished; raises on a failed peer.
        """
        start = time.perf_counter()
        t = np.asarray(transfers, dtype=np.int64).reshape(-1, 5)
        if t.size and (t[:, [DST_RANK, SRC_RANK]].max() >= self.world_size or t.min() < 0
                       or t[:, [DST_SLOT, SRC_SLOT]].max() >= self.slots_per_rank
                       or t[:, LAYER].max() >= self.num_layers):
            raise ValueError("transfer list refers to ranks, slots or layers out of range")
        # Canonical order, identical on every rank: by layer, then destination.
        t = t[np.lexsort((t[:, DST_SLOT], t[:, DST_RANK], t[:, LAYER]))]
        incoming = t[t[:, DST_RANK] == self.rank]
        staging = torch.empty((len(incoming), self.expert_numel), dtype=self.dtype, device=self.device)
        row_of = {(int(r[LAYER]), int(r[DST_SLOT])): i for i, r in enumerate(incoming)}
        sent = received = 0
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with stream_ctx:
            for lo in range(0, self.num_layers, self.layers_per_chunk):
                if version in self._aborted:
                    raise MigrationAborted(f"plan v{version} aborted while preparing")
                chunk = t[(t[:, LAYER] >= lo) & (t[:, LAYER] < lo + self.layers_per_chunk)]
                ops, recvs = [], []
                for peer in range(self.world_size):
                    out_rows = chunk[(chunk[:, SRC_RANK] == self.rank) & (chunk[:, DST_RANK] == peer)]
                    in_rows = chunk[(chunk[:, DST_RANK] == self.rank) & (chunk[:, SRC_RANK] == peer)]
                    if peer == self.rank:
                        if len(in_rows):  # a local move: no transfer, straight to staging
                            rows = [row_of[(int(r[LAYER]), int(r[DST_SLOT]))] for r in in_rows]
                            staging[rows] = self._pack(in_rows[:, LAYER], in_rows[:, SRC_SLOT])
                        continue
                    if len(out_rows):
                        buf = self._pack(out_rows[:, LAYER], out_rows[:, SRC_SLOT]).contiguous()
                        ops.append(dist.P2POp(dist.isend, buf, peer, self.group))
                        sent += buf.numel() * buf.element_size()
                    if len(in_rows):
                        buf = torch.empty((len(in_rows), self.expert_numel), dtype=self.dtype, device=self.device)
                        ops.append(dist.P2POp(dist.irecv, buf, peer, self.group))
                        recvs.append((in_rows, buf))
                if ops:
                    for work in dist.batch_isend_irecv(ops):
                        work.wait()
                for in_rows, buf in recvs:
                    rows = [row_of[(int(r[LAYER]), int(r[DST_SLOT]))] for r in in_rows]
                    staging[rows] = buf
                    received += buf.numel() * buf.element_size()
        if self._stream is not None:
            self._stream.synchronize()
        index = torch.as_tensor(incoming[:, [LAYER, DST_SLOT]], device=self.device)
        with self._lock:
            if version in self._aborted:
                raise MigrationAborted(f"plan v{version} aborted while preparing")
            self._staging, self._staged_index, self._staged_version = staging, index, version
        return PrepareStats(version, len(incoming), received, sent, time.perf_counter() - start)

    # ------------------------------------------------------------ commit / abort

    def commit(self, version: int) -> int:
        """Copy staged experts into the live weights in place; returns experts written.

        Call between forward steps (between graph replays)."""
        with self._lock:
            if self._staged_version != version or self._staging is None or self._staged_index is None:
                raise RuntimeError(f"commit of v{version} but staged is v{self._staged_version}")
            staging, index = self._staging, self._staged_index
            self._staging = self._staged_index = None
            self._staged_version = None
        if len(index):
            self._unpack_into(staging, index[:, 0], index[:, 1])
        return len(index)

    def abort(self, version: int) -> None:
        """Drop the staging of `version` (also while it is still being prepared)."""
        with self._lock:
            self._aborted.add(version)
            if self._staged_version == version:
                self._staging = self._staged_index = None
                self._staged_version = None

