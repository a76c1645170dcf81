"""Placement that minds what it costs to get there from the current one.

A from-scratch refit changes almost every slot. This module keeps experts where they
are: it relabels a fresh placement's GPUs to the old GPUs they overlap most and keeps
every expert that stays on its GPU in its old slot.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment


def gpu_overlap(old: np.ndarray, new: np.ndarray, num_gpus: int, num_logical: int) -> np.ndarray:
    """Experts shared by each (old GPU, new GPU) pair.

    old, new: [L, P]. Returns: [L, G, G] int64, [l, old_gpu, new_gpu].
    """
    num_layers, num_slots = old.shape
    per_gpu = num_slots // num_gpus
    gpu = np.arange(num_slots) // per_gpu
    layers = np.arange(num_layers)[:, None]
    old_has = np.zeros((num_layers, num_gpus, num_logical), dtype=np.int64)
    new_has = np.zeros_like(old_has)
    np.add.at(old_has, (layers, gpu[None, :], old), 1)
    np.add.at(new_has, (layers, gpu[None, :], new), 1)
    return np.einsum("lge,lhe->lgh", np.minimum(old_has, 1), np.minimum(new_has, 1))


def relabel_gpus(old: np.ndarray, new: np.ndarray, num_gpus: int, num_logical: int) -> np.ndarray:
    """Rename the new placement's GPUs so each lands on the old GPU it overlaps most.

    old, new: [L, P]. Returns: new placement with whole GPUs permuted [L, P].
    """
    num_layers, num_slots = old.shape
    per_gpu = num_slots // num_gpus
    overlap = gpu_overlap(old, new, num_gpus, num_logical)
    target = np.empty((num_layers, num_gpus), dtype=np.int64)
    for layer in range(num_layers):
        old_gpu, new_gpu = linear_sum_assignment(overlap[layer], maximize=True)
        target[layer, old_gpu] = new_gpu
    blocks = new.reshape(num_layers, num_gpus, per_gpu)
    return np.take_along_axis(blocks, target[:, :, None], axis=1).reshape(num_layers, num_slots)


def align_slots(old: np.ndarray, new: np.ndarray, num_gpus: int) -> np.ndarray:
    """Reorder slots inside each GPU so experts that stay keep their old slot.

    old, new: [L, P], new already on its final GPUs. Returns: [L, P].
    """
    num_layers, num_slots = old.shape
    per_gpu = num_slots // num_gpus
    big = int(max(old.max(), new.max())) + 1
    gpu = np.arange(num_slots) // per_gpu
    # 1. key = (gpu, expert, occurrence) for the old slots and the new items
    def keys(phy2log: np.ndarray) -> np.ndarray:
        base = gpu[None, :] * big + phy2log
        order = np.argsort(base, axis=1, kind="stable")
        sorted_base = np.take_along_axis(base, order, axis=1)
        first = np.maximum.accumulate(
            np.where(np.diff(sorted_base, axis=1, prepend=-1) != 0, np.arange(num_slots), 0),
            axis=1,
        )
        occurrence = np.empty_like(order)
        np.put_along_axis(occurrence, order, np.arange(num_slots) - first, axis=1)
        return base * num_slots + occurrence

    old_key, new_key = keys(old), keys(new)
    out = np.empty_like(new)
    for layer in range(num_layers):
        # 2. matched items keep their old slot; the rest fill the freed slots of their GPU
        kept = np.isin(old_key[layer], new_key[layer])
        placed = np.isin(new_key[layer], old_key[layer])
        row = np.where(kept, old[layer], -1)
        free_slots = np.flatnonzero(~kept)
        movers = np.flatnonzero(~placed)
        # both lists are in slot order, so they pair up GPU by GPU
        row[free_slots] = new[layer, movers]
        out[layer] = row
    return out


def keep_in_place(
    old: np.ndarray, new: np.ndarray, num_gpus: int, num_logical: int
) -> np.ndarray:
    """The new placement's GPU contents, relabelled and aligned to the old slots.

    old, new: [L, P]. Returns: [L, P] with the same per-GPU expert sets as `new` up to a
    GPU permutation, and as few changed slots as that relabelling allows.
    """
    return align_slots(old, relabel_gpus(old, new, num_gpus, num_logical), num_gpus)
