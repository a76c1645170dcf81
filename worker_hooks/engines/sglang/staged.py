"""The staged update's pure parts: layer groups within a staging budget, and the tickets
the ranks agree on (one per swapped group), without SGLang or torch.distributed.

A plan whose incoming experts fit the budget on every rank is one group: staged before
PREPARED, swapped at one agreed pass. A larger one is cut into groups of consecutive
layers; the first is staged before PREPARED (so an abort before the commit changes
nothing live), each later one after the swap of the one before, beside serving, and
swapped at an agreed pass of its own. Between swaps every layer is on either the old or
the new placement, its map matching its weights.
"""

from __future__ import annotations

import numpy as np

from rebalancer.wire.layout import DST_RANK, LAYER

# Tickets order every swap of every plan: ticket(v, g) is "plan v with its first g groups
# swapped", and every rank agrees on the smallest ticket all are ready for (MIN).
GROUPS_PER_TICKET = 1 << 16


def ticket(version: int, groups_done: int) -> int:
    """The agreement value of plan `version` with `groups_done` groups live."""
    if not 0 <= groups_done < GROUPS_PER_TICKET:
        raise ValueError(f"groups_done must be in [0, {GROUPS_PER_TICKET}), got {groups_done}")
    return version * GROUPS_PER_TICKET + groups_done


def ticket_parts(value: int) -> tuple[int, int]:
    """(version, groups_done) of a ticket."""
    return divmod(value, GROUPS_PER_TICKET)


def layer_groups(transfers: np.ndarray, changed_layers: list[int], num_gpus: int,
                 expert_bytes: int, budget_bytes: int) -> list[list[int]]:
    """Consecutive groups of `changed_layers` (those whose map changes and that hold
    weights, ascending) whose incoming experts fit `budget_bytes` on every rank.

    transfers: [K, 5] (layer, dst_rank, dst_slot, src_rank, src_slot), the same list on
    every rank, so every rank cuts the same groups. A layer that alone exceeds the budget
    is a group of its own (the budget is then exceeded by that one layer: the least a
    swap can move). Always at least one group when a layer changes."""
    t = np.asarray(transfers, dtype=np.int64).reshape(-1, 5)
    groups: list[list[int]] = []
    held = np.zeros(num_gpus, dtype=np.int64)
    for layer in changed_layers:
        rows = t[t[:, LAYER] == layer]
        incoming = np.bincount(rows[:, DST_RANK], minlength=num_gpus).astype(np.int64) * expert_bytes
        if groups and (held + incoming).max() <= budget_bytes:
            groups[-1].append(layer)
            held += incoming
        else:
            groups.append([layer])
            held = incoming.copy()
    return groups
