"""Which old slot feeds each destination slot when a placement changes.

The coordinator ships weights along these rows; a short path is cheaper, so a source
on the same rank is preferred, then one on the same node, and rows that need the same
expert are spread over its replicas so no single source sends everything.
"""

from __future__ import annotations

import numpy as np

from rebalancer.errors import InputError
from rebalancer.wire.layout import TRANSFER_COLUMNS, check_layout, check_phy2log, log2phy_of


def transfers(
    old_phy2log: np.ndarray, new_phy2log: np.ndarray, num_gpus: int, num_nodes: int = 1
) -> np.ndarray:
    """Transfer list from one placement to the next.

    old_phy2log, new_phy2log: [L, P] with the same experts.
    Returns: [K, 5] int32 rows (columns: `rebalancer.wire.layout`) (layer, dst_rank, dst_slot,
    src_rank, src_slot), slots local to their rank (0 .. P/G - 1), one row per slot whose expert
    changes, sorted by (layer, dst_rank, dst_slot). Sources are slots of the OLD placement, so all
    reads happen before any write is committed.
    """
    old = check_phy2log(old_phy2log, name="old placement")
    new = check_phy2log(new_phy2log, name="new placement")
    if old.shape != new.shape:
        raise InputError(f"placements differ in shape: {old.shape} vs {new.shape}")
    num_layers, num_slots = old.shape
    num_logical = int(max(old.max(), new.max())) + 1
    check_layout(num_logical, num_slots, num_gpus, num_nodes)
    old = check_phy2log(old, num_logical, name="old placement")
    per_gpu = num_slots // num_gpus
    gpus_per_node = num_gpus // num_nodes
    # 1. the destinations: slots whose expert changes
    layer, dst = np.nonzero(old != new)
    if layer.size == 0:
        return np.zeros((0, TRANSFER_COLUMNS), dtype=np.int32)
    expert = new[layer, dst]
    # 2. candidate sources: every old replica of that expert [K, R]
    replicas = log2phy_of(old, num_logical)[layer, expert]
    valid = replicas >= 0
    dst_rank = dst // per_gpu
    src_rank = np.where(valid, replicas, 0) // per_gpu
    tier = np.where(
        src_rank == dst_rank[:, None],
        0,
        np.where(src_rank // gpus_per_node == (dst_rank // gpus_per_node)[:, None], 1, 2),
    )
    # 3. spread: the j-th row asking for (layer, expert) starts its tie-break at replica j
    key = layer * num_logical + expert
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    first = np.searchsorted(sorted_key, sorted_key, side="left")
    ordinal = np.empty_like(order)
    ordinal[order] = np.arange(order.size) - first
    width = replicas.shape[1]
    num_valid = valid.sum(axis=1, keepdims=True)
    rotation = (np.arange(width)[None, :] - ordinal[:, None]) % num_valid
    score = np.where(valid, tier * width + rotation, np.iinfo(np.int64).max)
    src = replicas[np.arange(layer.size), score.argmin(axis=1)]
    out = np.stack([layer, dst_rank, dst % per_gpu, src // per_gpu, src % per_gpu], axis=1)
    return out.astype(np.int32)
