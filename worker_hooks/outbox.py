"""Memory that peers on the same host read directly: the copy-engine path.

NCCL moves weights with kernels that take SMs from serving. Between ranks of one host
a receiver can instead read what it gains itself: on GPU the peer's memory is mapped
through CUDA IPC and read with `copy_`, which runs on the copy engines (no SMs, the
NVLink bandwidth of a plain peer copy); on CPU the memory is a file in shared memory.
`map_peer_weights` maps the peers' live weights themselves (the "ipc" transport).
For weights that cannot be mapped whole, `SharedOutboxes` gives each rank two outboxes
per weight tensor that it packs its outgoing rows into, so that packing step k + 1
overlaps the peers' reads of step k (the "outbox" transport). Mappings are made once
and reused across plans: opening an IPC handle costs milliseconds, and serving memory
should not churn.

`outbox_schedule` is the pure part of the outbox exchange: which rows go through which
outbox at which step."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import uuid
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

# Columns of a transfer list (see proto Prepare.transfers).
LAYER, DST_RANK, DST_SLOT, SRC_RANK, SRC_SLOT = range(5)


@dataclass(frozen=True)
class OutboxSchedule:
    """The exchange of one plan through outboxes of `rows` experts each.

    remote: [K, 5] the cross-rank transfers in exchange order (source rank, then
        destination rank, layer, destination slot).
    position: [K] row of each transfer in its sender's list; it travels in step
        position // rows, at outbox row position % rows.
    steps: number of exchange steps (the same on every rank).
    """

    remote: np.ndarray
    position: np.ndarray
    steps: int
    rows: int

    def step_of(self) -> np.ndarray:
        return self.position // self.rows


def outbox_schedule(transfers: np.ndarray, outbox_rows: int) -> OutboxSchedule:
    """Order the cross-rank transfers of a plan for the outbox exchange.

    transfers: [K, 5] (layer, dst_rank, dst_slot, src_rank, src_slot), the same on every
    rank; rows with dst_rank == src_rank stay local and are left out.
    """
    if outbox_rows < 1:
        raise ValueError(f"an outbox must hold at least one expert, got {outbox_rows}")
    t = np.asarray(transfers, dtype=np.int64).reshape(-1, 5)
    remote = t[t[:, DST_RANK] != t[:, SRC_RANK]]
    # 1. Sender-major order: a sender's rows for one receiver are contiguous, so each
    #    (sender, receiver, step) is one read of contiguous outbox rows.
    remote = remote[np.lexsort((remote[:, DST_SLOT], remote[:, LAYER], remote[:, DST_RANK], remote[:, SRC_RANK]))]
    # 2. Position of each row within its sender's list.
    position = np.zeros(len(remote), dtype=np.int64)
    if len(remote):
        first = np.r_[0, np.flatnonzero(np.diff(remote[:, SRC_RANK])) + 1]
        starts = np.repeat(first, np.diff(np.r_[first, len(remote)]))
        position = np.arange(len(remote)) - starts
    steps = int(position.max()) // outbox_rows + 1 if len(remote) else 0
    return OutboxSchedule(remote, position, steps, outbox_rows)


class SharedOutboxes:
    """Two outboxes per weight tensor on this rank, readable by every peer of the group.

    Args:
        rank, world_size: this rank within `group`.
        shapes: name -> per-expert shape of each weight tensor.
        dtype, device: of the weights (CUDA: IPC; CPU: files in shared memory).
        rows: experts per outbox.
        group: a CPU (gloo) group of all ranks, all on this host; used for the handle
            exchange only.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        rows: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.rank, self.world_size, self.rows = rank, world_size, rows
        self.device = device
        self._files: list[str] = []
        # 1. Own boxes: [box][name] -> [rows, ...].
        self.own: list[dict[str, torch.Tensor]] = []
        exported: list[dict[str, object]] = []
        for box in range(2):
            tensors: dict[str, torch.Tensor] = {}
            handles: dict[str, object] = {}
            for name, shape in shapes.items():
                numel = rows * int(np.prod(shape))
                if device.type == "cuda":
                    t = torch.empty((rows, *shape), dtype=dtype, device=device)
                    handles[name] = _cuda_handle(t)
                else:
                    path = _shm_path(f"{box}-{name}")
                    self._files.append(path)
                    t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(rows, *shape)
                    handles[name] = path
                tensors[name] = t
            self.own.append(tensors)
            exported.append(handles)
        # 2. Every rank's handles to every rank, then open the peers' boxes.
        gathered: list[object] = [None] * world_size
        dist.all_gather_object(gathered, (exported, socket_host(), _gpu_id(device)), group=group)
        self.peer: dict[int, list[dict[str, torch.Tensor]]] = {}
        hosts = {item[1] for item in gathered if isinstance(item, tuple)}
        error = ""
        if len(hosts) > 1:
            error = f"outbox transport needs every rank on one host, found {sorted(hosts)}"
        else:
            try:
                for peer, item in enumerate(gathered):
                    if peer != rank:
                        assert isinstance(item, tuple)
                        handles_of_peer, _host, (index, uuid) = item
                        if device.type == "cuda" and _gpu_id(torch.device("cuda", index))[1] != uuid:
                            raise ValueError(
                                f"rank {peer}'s cuda:{index} is another GPU here: give every rank "
                                "of the host the same CUDA_VISIBLE_DEVICES"
                            )
                        self.peer[peer] = [self._open(h, shapes, dtype) for h in handles_of_peer]
            except Exception as exc:  # reported on every rank below, none left waiting
                error = f"rank {rank} could not map a peer's outbox: {exc!r}"
        # 3. One verdict for all: a rank that raised alone would leave the others hanging.
        try:
            raise_on_any_error(error, world_size, group)
        except RuntimeError:
            self.close()
            raise
        # 4. Everyone has mapped everything: the shared-memory names can go.
        self._unlink()

    def _open(
        self, handles: dict[str, object], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """Map one peer outbox (CUDA IPC handle bytes, or a shared-memory file name)."""
        opened = {}
        for name, shape in shapes.items():
            handle = handles[name]
            if isinstance(handle, bytes):
                opened[name] = pickle.loads(handle)
            else:
                numel = self.rows * int(np.prod(shape))
                opened[name] = torch.from_file(str(handle), shared=True, size=numel, dtype=dtype).view(self.rows, *shape)
        return opened

    def _unlink(self) -> None:
        for path in self._files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._files.clear()

    def close(self) -> None:
        self._unlink()
        self.peer.clear()
        self.own.clear()


def map_peer_weights(
    rank: int, world_size: int, weights: dict[str, torch.Tensor], group: dist.ProcessGroup | None
) -> dict[int, dict[str, torch.Tensor]]:
    """Map every peer's live weight tensors into this process (collective on `group`).

    CUDA tensors travel as IPC handles; CPU tensors must live in shared-memory files
    (`torch.from_file(..., shared=True)`) and travel by file name. Every rank raises the
    same error when any rank cannot map or export. Returns: peer -> name -> tensor.
    """
    error = ""
    exported: dict[str, object] = {}
    try:
        for name, w in weights.items():
            if w.device.type == "cuda":
                exported[name] = _cuda_handle(w)
            else:
                path = w.untyped_storage().filename
                if path is None:
                    raise ValueError(f"weight {name!r} is not in a shared-memory file")
                exported[name] = (path, w.untyped_storage().nbytes(), w.storage_offset(), tuple(w.shape))
    except Exception as exc:
        error = f"rank {rank} cannot share its weights: {exc}"
    first = next(iter(weights.values()))
    gathered: list[object] = [None] * world_size
    dist.all_gather_object(gathered, (exported, socket_host(), _gpu_id(first.device), error), group=group)
    peers: dict[int, dict[str, torch.Tensor]] = {}
    items = [item for item in gathered if isinstance(item, tuple)]
    hosts = {item[1] for item in items}
    error = next((item[3] for item in items if item[3]), "")
    if not error and len(hosts) > 1:
        error = f"the ipc transport needs every rank on one host, found {sorted(hosts)}"
    if not error:
        try:
            for peer, item in enumerate(items):
                if peer == rank:
                    continue
                handles, _host, (index, uuid), _ = item
                if first.device.type == "cuda" and _gpu_id(torch.device("cuda", index))[1] != uuid:
                    raise ValueError(
                        f"rank {peer}'s cuda:{index} is another GPU here: give every rank "
                        "of the host the same CUDA_VISIBLE_DEVICES"
                    )
                peers[peer] = {}
                for name, handle in handles.items():
                    if isinstance(handle, bytes):
                        peers[peer][name] = pickle.loads(handle)
                    else:
                        path, nbytes, offset, shape = handle
                        whole = torch.from_file(path, shared=True, size=nbytes // first.element_size(), dtype=first.dtype)
                        peers[peer][name] = whole[offset:offset + int(np.prod(shape))].view(shape)
        except Exception as exc:
            error = f"rank {rank} could not map a peer's weights: {exc!r}"
    raise_on_any_error(error, world_size, group)
    return peers


def socket_host() -> str:
    return socket.gethostname()


def raise_on_any_error(error: str, world_size: int, group: dist.ProcessGroup | None) -> None:
    """One verdict for all ranks (collective): a rank that raised alone would leave its
    peers waiting in the next collective. Raises the first rank's error everywhere."""
    errors: list[object] = [None] * world_size
    dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e), "")
    if first:
        raise RuntimeError(str(first))


def _gpu_id(device: torch.device) -> tuple[int, str]:
    """(index, UUID) of a CUDA device as this process numbers it; (-1, "") on CPU."""
    if device.type != "cuda":
        return -1, ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


def _shm_path(tag: str) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"rebalancer-outbox-{os.getpid()}-{uuid.uuid4().hex[:12]}-{tag}")


def _cuda_handle(t: torch.Tensor) -> bytes:
    """A CUDA IPC handle of `t` as bytes; `pickle.loads` in a peer process on the same
    host maps the same memory (torch's multiprocessing reductions)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions)

    return bytes(ForkingPickler.dumps(t))
