"""Dispatch by this step's load: the water-fill of rebalancer.wire.dispatch, in torch.

`split` (worker_hooks/dispatch.py) divides an expert's tokens evenly among its replicas
whatever the batch looks like; here each step's tokens of an expert are divided so that
the GPUs' loads of this very batch even out (`load`), and with `load+shared` the shared
expert is one more expert with a replica on every GPU, so a busy GPU sheds the shared
work of its own tokens onto idle ones.

All of it runs inside captured CUDA graphs: static tensors, a fixed number of passes,
no host sync, no data-dependent shapes. Per layer and step:
1. each rank counts its picks per expert (`[X]`, X = E, plus the shared expert's
   column when the model has one) and all-gathers them: `[G, X]` int64 per layer
   (G x X x 8 bytes received, 66 KB for DeepSeek-V3 at EP32: one small all-gather,
   latency-bound, ~10-20 us on NVLink; DeepEP's layout step only gives a rank its own
   counts, so it does not replace it);
2. every rank computes the same allocation `[X, G]` of each expert's global tokens to
   the GPUs holding it (`allocate`): integer arithmetic in fixed-point units
   (rebalancer.wire.dispatch.WATERFILL_UNITS), so it is exact: every rank, on any device,
   and the numpy twin get the same bits, whatever order a reduction adds in;
3. each rank keeps its own tokens of an expert on its own GPU up to that GPU's share,
   and its overflow takes, in rank order (an exclusive prefix over ranks), the places
   other GPUs have left: all ranks agree without exchanging anything more.
The numpy twin (rebalancer/placement/metrics.py: `split_units`, `waterfill`,
`round_allocation`, `dispatch_allocation`) is what the simulator and the controller
evaluate; a test holds the two to the same allocations.

Cost: the work is a few [X, G] tensors (8 K elements at DeepSeek-V3's EP32), so the time
is the number of kernels, ~2 us each even replayed from a graph. Everything that depends
only on the placement (`tables`, rebalancer.wire.dispatch.waterfill_tables) is computed
once per placement, not per step; a pass is 14 kernels (the loads, the sort, the
cumulative sum, the level, the damped move). `RebalanceHook.route` under load+shared is
136 kernel-launching ops per layer with 4 passes (split: 38); `torch.compile` fuses them
into a few kernels (HookConfig.dispatch.compile). The largest single cost left is the
stable sort of a step's picks by expert in `assign`, a radix sort: its key is int16, 2
passes over the picks instead of 8 (BENCHMARKS.md, "Dispatch modes in the CUDA graph").
"""

from __future__ import annotations

from fractions import Fraction

import torch

from rebalancer.wire.dispatch import WATERFILL_DAMPING, WATERFILL_PASSES, WATERFILL_UNITS

__all__ = ["allocate", "assign", "route_by_load", "split_units", "waterfill"]


def split_units(counts: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """metrics.split_units for one layer: counts [G, X] int64, tables [5, X, G] -> [X, G]."""
    per_rank = counts.t()
    kept = per_rank * tables[0]
    remote = (per_rank - kept).sum(dim=1, keepdim=True)
    spread = torch.div(remote * tables[2], tables[3], rounding_mode="floor")
    return torch.add(spread, kept, alpha=WATERFILL_UNITS)


def waterfill(
    demand: torch.Tensor,
    start: torch.Tensor,
    far: torch.Tensor,
    base: torch.Tensor | None,
    passes: int = WATERFILL_PASSES,
    damping: Fraction = WATERFILL_DAMPING,
) -> torch.Tensor:
    """metrics.waterfill for one layer: [X] demand, [X, G] start/far, [G] base (None:
    zero) -> [X, G] int64 units."""
    num_gpus = far.shape[1]
    k = torch.arange(1, num_gpus + 1, dtype=torch.int64, device=far.device)
    column = demand.unsqueeze(1)
    share = start
    for _ in range(passes):
        load = share.sum(dim=0) if base is None else torch.add(base, share.sum(dim=0))
        masked = (load - share).add_(far)
        ordered = torch.sort(masked, dim=1).values
        levels = torch.div(torch.cumsum(ordered, dim=1).add_(column), k, rounding_mode="floor")
        level = torch.maximum(levels, ordered).amin(dim=1, keepdim=True)
        target = (level - masked).clamp_min_(0)
        # share + floor((target - share) * n / d), as one floor division (same integers)
        kept = share * (damping.denominator - damping.numerator)
        share = torch.div(
            kept.add_(target, alpha=damping.numerator), damping.denominator, rounding_mode="floor"
        )
    peak = share.sum(dim=0).amax() if base is None else torch.add(base, share.sum(dim=0)).amax()
    start_peak = (
        start.sum(dim=0).amax() if base is None else torch.add(base, start.sum(dim=0)).amax()
    )
    return torch.where(peak < start_peak, share, start)


def round_allocation(share: torch.Tensor, demand: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """metrics.round_allocation for one layer: [X, G] units, [X] tokens, [X, G] -> [X, G]."""
    cum = torch.div(
        torch.cumsum(share, dim=1).add_(WATERFILL_UNITS // 2),
        WATERFILL_UNITS,
        rounding_mode="floor",
    )
    column = demand.unsqueeze(1)
    cum = torch.where(tail > 0, column, torch.minimum(cum, column))
    cum = torch.cummax(cum, dim=1).values
    return torch.diff(cum, dim=1, prepend=torch.zeros_like(cum[:, :1]))


def allocate(
    counts: torch.Tensor,
    tables: torch.Tensor,
    shared_movable: bool,
    shared_column: bool,
    passes: int = WATERFILL_PASSES,
) -> torch.Tensor:
    """Whole tokens each GPU computes of each expert this step (every rank the same).

    counts: [G, X] int64 every rank's picks per expert (X = E + 1 when `shared_column`:
    the shared expert last); tables: [5, X, G] int64 (`waterfill_tables` of the layer's
    replicas, the shared row held once by every GPU). shared_movable: the shared expert
    is water-filled too (`load+shared`), else its tokens stay local as fixed load
    (`load`). Returns: [X, G] int64.
    """
    demand = counts.sum(dim=0)
    if shared_column and not shared_movable:
        routed = counts[:, :-1]
        share = waterfill(
            demand[:-1] * WATERFILL_UNITS,
            split_units(routed, tables[:, :-1]),
            tables[1, :-1],
            counts[:, -1] * WATERFILL_UNITS,
            passes,
        )
        out = round_allocation(share, demand[:-1], tables[4, :-1])
        return torch.cat([out, counts[:, -1].unsqueeze(0)], dim=0)
    # The shared row is held by every GPU: its split start is each rank's own tokens.
    share = waterfill(
        demand * WATERFILL_UNITS, split_units(counts, tables), tables[1], None, passes
    )
    return round_allocation(share, demand, tables[4])


def assign(
    ids: torch.Tensor, counts: torch.Tensor, alloc: torch.Tensor, rank: int, slot_on: torch.Tensor
) -> torch.Tensor:
    """The slot each of this rank's picks goes to, given every rank's same allocation.

    1. A pick's index among this rank's picks of its expert (stable sort by expert).
    2. The first min(own count, own GPU's share) stay on this GPU.
    3. The rest take the expert's places left on other GPUs in rank order: this rank's
       overflow starts after the overflow of lower ranks (exclusive prefix over ranks)
       and lands on the GPU whose run of places (in GPU order) holds that position.

    ids: [N] int64 expert per pick, -1 or >= X for none; counts: [G, X] int64;
    alloc: [X, G] int64; slot_on: [X, G] the slot (or row) each GPU serves an expert
    on. Returns: [N] int64 slot per pick (-1 for none).
    """
    num_gpus, num_experts = counts.shape
    valid = (ids >= 0) & (ids < num_experts)
    # The narrowest key the experts fit: a radix sort makes one pass per byte of key, so
    # int16 (X < 2^15, always in practice) sorts in 2 passes where int64 takes 8.
    key_type = torch.int16 if num_experts < (1 << 15) else torch.int32
    sorted_key, order = torch.sort(torch.where(valid, ids, num_experts).to(key_type), stable=True)
    sorted_key = sorted_key.to(torch.int64)
    own = counts[rank]  # [X]
    first = torch.cumsum(own, dim=0) - own  # [X] exclusive
    position = torch.empty_like(ids)  # every element written by the scatter below
    n = torch.arange(ids.shape[0], device=ids.device, dtype=torch.int64)
    # an invalid pick (key X) reads expert X - 1's row: its result is masked at the end
    position[order] = n - first[sorted_key.clamp_max(num_experts - 1)]
    keep = torch.minimum(counts, alloc.t())  # [G, X] tokens each rank keeps local
    over = counts - keep
    mine = keep[rank]  # [X]
    offset = (torch.cumsum(over, dim=0) - over)[rank] - mine  # [X] overflow of lower ranks - kept
    ends = torch.cumsum(alloc - keep.t(), dim=1)  # [X, G] inclusive run ends of places left
    expert = ids.clamp(0, num_experts - 1)
    slot_pos = position + offset[expert]
    overflow = torch.searchsorted(ends[expert], slot_pos.unsqueeze(1), right=True).squeeze(1)
    gpu = torch.where(position < mine[expert], rank, overflow.clamp_max(num_gpus - 1))
    slot = slot_on.reshape(-1)[expert * num_gpus + gpu]
    return torch.where(valid, slot, -1)


def route_by_load(
    ids: torch.Tensor,
    counts: torch.Tensor,
    tables: torch.Tensor,
    slot_on: torch.Tensor,
    rank: int,
    shared_movable: bool,
    shared_column: bool,
    passes: int,
) -> torch.Tensor:
    """`allocate` then `assign`: one layer's picks [N] -> slots [N] (one function, so that
    `torch.compile` can fuse the whole of it: ReplicaDispatch's `compiled`)."""
    alloc = allocate(counts, tables, shared_movable, shared_column, passes)
    return assign(ids, counts, alloc, rank, slot_on)
