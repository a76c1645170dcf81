"""The shape of a placement as both sides of the link see it.

The controller ships placements (`phy2log [L, P]`) and transfer lists; every rank turns
them into replica tables and storage rows. Both must read them the same way and refuse
the same malformed ones, so the layout rules, the map conversions and the transfer-list
columns live here, below the placement engine and the worker hooks alike (numpy only).
"""

from __future__ import annotations

import hashlib

import numpy as np

from rebalancer.errors import InputError

# Columns of a transfer list `[K, 5]` (see proto Prepare.transfers): per changed slot,
# the destination (layer, rank, rank-local slot) and the old slot that feeds it.
LAYER, DST_RANK, DST_SLOT, SRC_RANK, SRC_SLOT = range(5)
TRANSFER_COLUMNS = 5


# The largest layout the placement engine takes (docs/placement.md, "Limits"): its time
# and memory per layer grow with the square of the slots (P = 2048: up to ~0.6 s and
# ~170 MB per layer), so a larger shape is refused before anything is allocated. Real
# models need far less: DeepSeek-V3 288 slots (9 per GPU at EP32), Kimi K2 / Qwen3-Next
# with 384-512 experts at EP8 48-80 per GPU.
MAX_SLOTS = 2048
MAX_SLOTS_PER_GPU = 1024
# The rest of a deployment's shape, as the controller takes it at Register (checked with
# the above before anything is allocated). Layers multiply every [L, P] array; L x P is
# bounded so that a Prepare moving every slot (int32 placement [L, P] plus transfers
# [K <= L*P, 5]: 24 bytes a slot) fits in one 16 MiB message (wire/channel.py). Real
# models: DeepSeek-V3 58 MoE layers x 288 = 16,704; Qwen3-235B 94 layers. Expert bytes bound
# the bytes a plan moves (slots x bytes) below 2**63, what the store's integers hold.
MAX_LAYERS = 1024
MAX_LAYER_SLOTS = 2**19  # L x P
MAX_EXPERT_BYTES = 2**40


def check_layout(num_logical: int, num_slots: int, num_gpus: int, num_nodes: int = 1) -> None:
    """Raise InputError unless E <= P <= MAX_SLOTS, P % G == 0, P / G <= MAX_SLOTS_PER_GPU
    and G % N == 0 (all positive integers)."""
    for name, value in (
        ("num_logical", num_logical),
        ("num_slots", num_slots),
        ("num_gpus", num_gpus),
        ("num_nodes", num_nodes),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if num_slots < num_logical:
        raise InputError(
            f"slots ({num_slots}) must be at least the number of logical experts ({num_logical})"
        )
    if num_slots > MAX_SLOTS:
        raise InputError(f"slots ({num_slots}) must be at most {MAX_SLOTS}")
    if num_slots % num_gpus:
        raise InputError(f"slots ({num_slots}) must be a multiple of GPUs ({num_gpus})")
    if num_slots // num_gpus > MAX_SLOTS_PER_GPU:
        raise InputError(
            f"slots per GPU ({num_slots} / {num_gpus} = {num_slots // num_gpus}) must be at "
            f"most {MAX_SLOTS_PER_GPU}"
        )
    if num_gpus % num_nodes:
        raise InputError(f"GPUs ({num_gpus}) must be a multiple of nodes ({num_nodes})")


def trivial_placement(
    num_layers: int, num_logical: int, num_slots: int, num_gpus: int
) -> np.ndarray:
    """Contiguous placement: slot p holds expert p % E.

    Returns: phy2log [L, P] int64.
    """
    check_layout(num_logical, num_slots, num_gpus)
    if num_layers <= 0:
        raise InputError(f"num_layers must be positive, got {num_layers}")
    row = np.arange(num_slots, dtype=np.int64) % num_logical
    return np.tile(row, (num_layers, 1))


def check_phy2log(
    phy2log: object, num_logical: int | None = None, name: str = "phy2log"
) -> np.ndarray:
    """Return phy2log as int64 [L, P], or raise InputError.

    phy2log: [L, P] integers in [0, E); with num_logical given every expert must appear
    in every layer.
    """
    arr = np.asarray(phy2log)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"{name} must be a non-empty 2-D [layers, slots] array, got {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.isfinite(arr).all() and (arr == np.round(arr)).all():
            arr = arr.astype(np.int64)
        else:
            raise InputError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if (arr < 0).any():
        raise InputError(f"{name} has a negative expert index")
    if num_logical is not None:
        if arr.max() >= num_logical:
            raise InputError(
                f"{name} refers to expert {int(arr.max())} but there are {num_logical} experts"
            )
        num_layers = arr.shape[0]
        offsets = np.arange(num_layers, dtype=np.int64)[:, None] * num_logical
        seen = np.bincount((arr + offsets).ravel(), minlength=num_layers * num_logical)
        missing = np.argwhere(seen.reshape(num_layers, num_logical) == 0)
        if len(missing):
            layer, expert = missing[0]
            raise InputError(f"{name} layer {layer} has no replica of expert {expert}")
    return arr


def gather(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """values[r, index[r, ...]] for every row r: `take_along_axis` on axis 1 through
    one flat `take`, several times faster on the small rows used here.

    values: [X, n], index: [X, ...] integers in [0, n). Returns: [X, ...].
    """
    num_rows, width = values.shape
    offsets = np.arange(0, num_rows * width, width).reshape((num_rows,) + (1,) * (index.ndim - 1))
    return np.take(values.reshape(-1), index + offsets)


def logcnt_of(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """Replicas per logical expert.

    phy2log: [L, P]. Returns: logcnt [L, E] int64.
    """
    phy2log = np.asarray(phy2log, dtype=np.int64)
    num_layers = phy2log.shape[0]
    offsets = np.arange(num_layers, dtype=np.int64)[:, None] * num_logical
    counts = np.bincount((phy2log + offsets).ravel(), minlength=num_layers * num_logical)
    return counts.reshape(num_layers, num_logical).astype(np.int64)


def log2phy_of(
    phy2log: np.ndarray,
    num_logical: int,
    max_replicas: int | None = None,
    logcnt: np.ndarray | None = None,
) -> np.ndarray:
    """Replica slots of every expert, in ascending slot order, -1 padded.

    phy2log: [L, P]; logcnt: [L, E] if already known. Returns: log2phy [L, E, R] int64
    with R = max_replicas or the largest replica count.
    """
    phy2log = np.asarray(phy2log, dtype=np.int64)
    num_layers, num_slots = phy2log.shape
    if logcnt is None:
        logcnt = logcnt_of(phy2log, num_logical)
    needed = int(logcnt.max())
    width = needed if max_replicas is None else int(max_replicas)
    if width < needed:
        raise InputError(f"max_replicas {width} is below the largest replica count {needed}")
    # 1. group the slots of each expert together, in slot order inside a group (a stable
    #    sort; on 16-bit keys numpy uses a radix sort, several times faster)
    keys = phy2log.astype(np.int16) if num_logical <= np.iinfo(np.int16).max else phy2log
    order = np.argsort(keys, axis=1, kind="stable")
    experts = gather(phy2log, order)
    # 2. the replica rank of a slot is its position minus the start of its group
    starts = np.cumsum(logcnt, axis=1) - logcnt
    rank = np.arange(num_slots)[None, :] - gather(starts, experts)
    out = np.full((num_layers, num_logical, width), -1, dtype=np.int64)
    layers = np.broadcast_to(np.arange(num_layers)[:, None], experts.shape)
    out[layers, experts, rank] = order
    return out


def logical_counts(physical: np.ndarray, phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """Slot counts `[L, P]` summed per logical expert through `phy2log [L, P]`: `[L, E]` int64.
    An empty slot (-1: an engine's padding, elastic EP's new slots) holds no expert: its
    count is left out."""
    num_layers = physical.shape[0]
    index = phy2log + np.arange(num_layers)[:, None] * num_logical
    held = np.asarray(phy2log) >= 0
    summed = np.bincount(
        index[held],
        weights=np.asarray(physical)[held].astype(np.float64),
        minlength=num_layers * num_logical,
    )
    return summed.reshape(num_layers, num_logical).round().astype(np.int64)


def placement_digest(phy2log: np.ndarray) -> int:
    """A placement's 64-bit digest (never 0, which on the wire means "not stated"): what a
    rank states it serves beside the version (Window.serving_hash), so the controller
    adopts a version only when the ranks' map is the one it stored for that version.
    Computed off the serving thread (a rank's agent, the controller) on `[L, P]`."""
    data = np.ascontiguousarray(phy2log, dtype="<i4").tobytes()
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return digest or 1
