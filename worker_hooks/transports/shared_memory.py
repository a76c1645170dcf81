"""Memory that peers on the same host read directly: the copy-engine path.

NCCL moves weights with kernels that take SMs from serving. Between ranks of one host
a receiver can instead read what it gains itself: on GPU the peer's memory is mapped
through CUDA IPC and read with `copy_`, which runs on the copy engines (no SMs, the
NVLink bandwidth of a plain peer copy); on CPU the memory is a file in shared memory.
`share_tensors` is the one mechanism: every rank exports handles of some tensors and
maps its peers'. `map_peer_weights` shares the live weights (the "ipc" transport).
For weights that cannot be mapped whole, `SharedOutboxes` gives each rank two outboxes
per weight tensor that it packs its outgoing rows into, so that packing step k + 1
overlaps the peers' reads of step k (the "outbox" transport). Mappings are made once
and reused across plans: opening an IPC handle costs milliseconds, and serving memory
should not churn.

`outbox_schedule` is the pure part of the outbox exchange: which rows go through which
outbox at which step."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import tempfile
import uuid
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.wire.layout import DST_RANK, DST_SLOT, LAYER, SRC_RANK

Key = TypeVar("Key", bound=Hashable)


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
    remote = remote[
        np.lexsort(
            (remote[:, DST_SLOT], remote[:, LAYER], remote[:, DST_RANK], remote[:, SRC_RANK])
        )
    ]
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
        self.rows = rows
        # 1. Own boxes, keyed (box, name): [rows, ...] each.
        own: dict[tuple[int, str], torch.Tensor] = {}
        files: list[str] = []
        for box in range(2):
            for name, shape in shapes.items():
                if device.type == "cuda":
                    own[(box, name)] = torch.empty((rows, *shape), dtype=dtype, device=device)
                else:
                    own[(box, name)], path = shared_memory_tensor(
                        (rows, *shape), dtype, f"outbox{box}-{name}"
                    )
                    files.append(path)
        # 2. Map the peers' boxes; once every rank has (or failed), the names can go.
        try:
            peers = share_tensors(rank, world_size, own, group, "outboxes")
        finally:
            for path in files:
                unlink_quietly(path)
        self.own = [{name: own[(box, name)] for name in shapes} for box in range(2)]
        self.peer = {
            peer: [{name: mapped[(box, name)] for name in shapes} for box in range(2)]
            for peer, mapped in peers.items()
        }

    def close(self) -> None:
        self.peer.clear()
        self.own.clear()


def map_peer_weights(
    rank: int, world_size: int, weights: dict[str, torch.Tensor], group: dist.ProcessGroup | None
) -> dict[int, dict[str, torch.Tensor]]:
    """Map every peer's live weight tensors into this process (collective on `group`).
    CPU weights must live in shared-memory files (`in_shared_memory`).
    Returns: peer -> name -> tensor."""
    return share_tensors(rank, world_size, weights, group, "weights")


def share_tensors(
    rank: int,
    world_size: int,
    tensors: dict[Key, torch.Tensor],
    group: dist.ProcessGroup | None,
    what: str,
) -> dict[int, dict[Key, torch.Tensor]]:
    """Every rank exports `tensors` (the same keys everywhere) and maps its peers'
    (collective on `group`). CUDA tensors travel as IPC handles, CPU ones by the name
    of the shared-memory file they live in. All ranks must be on one host and number
    its GPUs alike; any rank's failure is raised on every rank, so none is left
    waiting. Returns: peer -> key -> tensor."""
    # 1. Export; a failure travels with the handles.
    error = ""
    exported: dict[Key, object] = {}
    try:
        exported = {key: _export(t) for key, t in tensors.items()}
    except Exception as exc:
        error = f"rank {rank} cannot share its {what}: {exc}"
    device = next(iter(tensors.values())).device
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (exported, socket_host(), _gpu_id(device), error), group=group)
    # 2. Check the group, then map the peers' tensors.
    error = next((e for *_, e in gathered if e), "")
    hosts = sorted({host for _, host, _, _ in gathered})
    if not error and len(hosts) > 1:
        error = f"sharing {what} needs every rank on one host, found {hosts}"
    peers: dict[int, dict[Key, torch.Tensor]] = {}
    if not error:
        try:
            for peer, (handles, _host, (index, gpu_uuid), _error) in enumerate(gathered):
                if peer == rank:
                    continue
                if device.type == "cuda" and _gpu_id(torch.device("cuda", index))[1] != gpu_uuid:
                    raise ValueError(
                        f"rank {peer}'s cuda:{index} is another GPU here: give every rank "
                        "of the host the same CUDA_VISIBLE_DEVICES"
                    )
                peers[peer] = {key: _open(handle) for key, handle in handles.items()}
        except Exception as exc:
            error = f"rank {rank} could not map a peer's {what}: {exc!r}"
    # 3. One verdict for all.
    raise_on_any_error(error, world_size, group)
    return peers


def raise_on_any_error(error: str, world_size: int, group: dist.ProcessGroup | None) -> None:
    """One verdict for all ranks (collective): a rank that raised alone would leave its
    peers waiting in the next collective. Raises the first rank's error everywhere."""
    errors: list[object] = [None] * world_size
    dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e), "")
    if first:
        raise RuntimeError(str(first))


def shared_memory_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, tag: str, folder: str | None = None
) -> tuple[torch.Tensor, str]:
    """An empty tensor in a shared-memory file (in `folder`, default /dev/shm), and
    the file's path: peers map it by name; unlink it once they have."""
    base = folder or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    path = os.path.join(base, f"rebalancer-{os.getpid()}-{uuid.uuid4().hex[:12]}-{tag}")
    numel = int(np.prod(shape))
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape), path


def in_shared_memory(
    tensors: dict[str, torch.Tensor], tag: str, folder: str | None = None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Copies of `tensors` in shared-memory files (what "ipc" needs on CPU), and the
    files' paths."""
    out, paths = {}, []
    for name, t in tensors.items():
        out[name], path = shared_memory_tensor(tuple(t.shape), t.dtype, f"{tag}-{name}", folder)
        out[name].copy_(t)
        paths.append(path)
    return out, paths


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def socket_host() -> str:
    return socket.gethostname()


def _export(t: torch.Tensor) -> object:
    """What a peer on this host needs to map `t`: IPC handle bytes (CUDA), or the
    shared-memory file, its size, `t`'s offset, shape and dtype (CPU)."""
    if t.device.type == "cuda":
        return _cuda_handle(t)
    storage = t.untyped_storage()
    if storage.filename is None:
        raise ValueError("a CPU tensor is not in a shared-memory file")
    return storage.filename, storage.nbytes(), t.storage_offset(), tuple(t.shape), t.dtype


def _open(handle: Any) -> torch.Tensor:
    """Map what `_export` gave, in this process."""
    if isinstance(handle, bytes):
        return pickle.loads(handle)
    path, nbytes, offset, shape, dtype = handle
    whole = torch.from_file(path, shared=True, size=nbytes // dtype.itemsize, dtype=dtype)
    return whole[offset : offset + int(np.prod(shape))].view(shape)


def _gpu_id(device: torch.device) -> tuple[int, str]:
    """(index, UUID) of a CUDA device as this process numbers it; (-1, "") on CPU."""
    if device.type != "cuda":
        return -1, ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


def _cuda_handle(t: torch.Tensor) -> bytes:
    """A CUDA IPC handle of `t` as bytes; `pickle.loads` in a peer process on the same
    host maps the same memory (torch's multiprocessing reductions)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions)

    return bytes(ForkingPickler.dumps(t))
