"""Logical -> physical expert ids through static map tensors.

After the router picks logical experts, each token must be sent to one physical slot
holding a replica of that expert. The choice runs inside captured CUDA graphs, so it
reads only static tensors whose addresses never change; a new placement is copied
into them in place between replays (`update_`, or `stage` ahead of time then a
device-to-device `commit` as the only work in the pause).

Replica choice, per (token, expert):
- if this rank holds replicas of the expert, pick among those (no network hop);
- otherwise pick among all replicas;
- the pick is `(token * A + expert * B + rank * C) mod n` with A prime, so
  consecutive tokens of one expert cycle through its n candidates: deterministic per
  token and even. When every rank sends an expert the same traffic, local preference
  plus even spreading gives each replica exactly 1/n of the expert's load.
"""

from __future__ import annotations

import numpy as np
import torch

from rebalancer.wire.dispatch import (
    WATERFILL_PASSES,
    WATERFILL_TABLES,
    check_waterfill_passes,
    waterfill_tables,
)
from worker_hooks import waterfill
from worker_hooks.devices import resolve_device
from worker_hooks.record import is_layer_index

__all__ = ["ReplicaDispatch", "candidate_table", "gpu_tables"]

# Multipliers of the per-token replica pick (see module doc); the first is prime so
# consecutive tokens visit every residue mod n.
_TOKEN_MUL = 2654435761
_EXPERT_MUL = 40503
_RANK_MUL = 97


def _as_numpy_map(log2phy: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(log2phy, torch.Tensor):
        arr = log2phy.detach().to("cpu").numpy()
    else:
        arr = np.asarray(log2phy)
    if arr.ndim != 3:
        raise ValueError(f"log2phy must be [L, E, R], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"log2phy must hold integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def candidate_table(
    log2phy: np.ndarray, num_physical: int, num_gpus: int, rank: int, max_replicas: int
) -> np.ndarray:
    """The static table of one rank: `[L, E, 1 + R]`, column 0 = number of candidates.

    Candidates are the expert's local replicas when it has any on `rank`, else all of
    its replicas; unused columns are -1. An expert without replicas gets one candidate,
    -1, so its tokens come out as -1 (dropped) instead of reading out of bounds.
    """
    num_layers, num_logical, r_in = log2phy.shape
    if r_in > max_replicas:
        extra = log2phy[:, :, max_replicas:]
        if (extra >= 0).any():
            raise ValueError(f"log2phy has more than max_replicas={max_replicas} replicas")
        log2phy = log2phy[:, :, :max_replicas]
        r_in = max_replicas
    if log2phy.min(initial=-1) < -1 or log2phy.max(initial=-1) >= num_physical:
        raise ValueError(f"log2phy slot ids must be -1 or in [0, {num_physical})")
    valid = log2phy >= 0
    slots_per_gpu = num_physical // num_gpus
    local = valid & (log2phy // slots_per_gpu == rank)
    has_local = local.any(axis=2, keepdims=True)
    use = np.where(has_local, local, valid)
    # Stable compaction of the chosen replicas to the front, keeping map order.
    order = np.argsort(~use, axis=2, kind="stable")
    compact = np.take_along_axis(np.where(use, log2phy, -1), order, axis=2)
    count = use.sum(axis=2)
    table = np.full((num_layers, num_logical, 1 + max_replicas), -1, dtype=np.int64)
    table[:, :, 0] = np.maximum(count, 1)
    table[:, :, 1 : 1 + r_in] = compact
    return table


def gpu_tables(
    log2phy: np.ndarray, num_physical: int, num_gpus: int, shared_expert: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The tables of dispatch by load: replicas per GPU and the slot each GPU serves.

    log2phy: [L, E, R] slot ids, -1 padded. Returns `replicas` [L, X, G] int64 (replicas
    of each expert on each GPU) and `slot_on` [L, X, G] int64 (the first of the expert's
    replicas on that GPU, in map order; -1 where it has none). With `shared_expert`,
    X = E + 1 and the last row is the shared expert: one replica on every GPU, at id
    `num_physical + g`.
    """
    num_layers, num_logical, width = log2phy.shape
    per_gpu = num_physical // num_gpus
    valid = log2phy >= 0
    gpu = np.where(valid, log2phy // per_gpu, num_gpus)  # [L, E, R], num_gpus = none
    replicas = np.zeros((num_layers, num_logical, num_gpus + 1), dtype=np.int64)
    layer = np.arange(num_layers)[:, None, None]
    expert = np.arange(num_logical)[None, :, None]
    np.add.at(
        replicas, (np.broadcast_to(layer, gpu.shape), np.broadcast_to(expert, gpu.shape), gpu), 1
    )
    slot_on = np.full((num_layers, num_logical, num_gpus + 1), -1, dtype=np.int64)
    # Last writer wins: write replicas in reverse map order so the first one stays.
    for r in range(width - 1, -1, -1):
        g = gpu[:, :, r]
        ok = valid[:, :, r]
        li, ei = np.nonzero(ok)
        slot_on[li, ei, g[li, ei]] = log2phy[li, ei, r]
    replicas, slot_on = replicas[:, :, :num_gpus], slot_on[:, :, :num_gpus]
    if shared_expert:
        ones = np.ones((num_layers, 1, num_gpus), dtype=np.int64)
        ids = np.broadcast_to(num_physical + np.arange(num_gpus), (num_layers, 1, num_gpus))
        replicas = np.concatenate([replicas, ones], axis=1)
        slot_on = np.concatenate([slot_on, ids], axis=1)
    return replicas, slot_on


class ReplicaDispatch:
    """Logical -> physical expert ids through static map tensors.

    Args:
        log2phy: `[L, E, R]` replica slots of each logical expert, -1 padded.
        num_gpus: EP ranks; slot s lives on rank `s // (num_physical // num_gpus)`.
        rank: this rank (local replicas are preferred).
        max_replicas: R of the static tensors (later maps are padded or must fit).
        device: where the tables live.
        num_physical: P; defaults to the smallest multiple of num_gpus above the map's
            largest slot id. Pass it when the last slots may be empty.
        by_load: also keep the tables of dispatch by load (`dispatch_by_load`).
        shared_expert: the model has a shared expert, routed as expert E with a replica
            on every GPU at ids `num_physical + g` (dispatch by load only).
        waterfill_passes: passes of the water-fill per layer and step (dispatch by load).
    """

    def __init__(
        self,
        log2phy: torch.Tensor | np.ndarray,
        num_gpus: int,
        rank: int,
        max_replicas: int | None = None,
        device: torch.device | str = "cpu",
        num_physical: int | None = None,
        by_load: bool = False,
        shared_expert: bool = False,
        waterfill_passes: int = WATERFILL_PASSES,
        compiled: bool = False,
    ) -> None:
        arr = _as_numpy_map(log2phy)
        if num_gpus <= 0 or not 0 <= rank < num_gpus:
            raise ValueError(f"need 0 <= rank < num_gpus, got rank={rank}, num_gpus={num_gpus}")
        if num_physical is None:
            top = int(arr.max(initial=-1)) + 1
            num_physical = -(-max(top, 1) // num_gpus) * num_gpus
        if num_physical % num_gpus:
            raise ValueError(
                f"num_physical={num_physical} is not a multiple of num_gpus={num_gpus}"
            )
        self.num_layers, self.num_logical, r_in = arr.shape
        self.max_replicas = max_replicas if max_replicas is not None else r_in
        self.num_physical = num_physical
        self.num_gpus = num_gpus
        self.rank = rank
        self.device = resolve_device(device)
        width = 1 + self.max_replicas
        shape = (self.num_layers, self.num_logical, width)
        # The static table read by dispatch, plus a same-shaped staging copy on the
        # device so that commit is a device-to-device copy.
        self.table = torch.empty(shape, dtype=torch.int64, device=self.device)
        self._staged = torch.empty(shape, dtype=torch.int64, device=self.device)
        # The raw map, kept in sync for whoever reads it (also static).
        self.log2phy = torch.full(
            (self.num_layers, self.num_logical, self.max_replicas),
            -1,
            dtype=torch.int64,
            device=self.device,
        )
        self._staged_map = torch.empty_like(self.log2phy)
        self._host_table: torch.Tensor | None = None
        self._host_map: torch.Tensor | None = None
        self._h2d_done: torch.cuda.Event | None = None
        self._has_staged = False
        self.by_load = by_load
        self.shared_expert = shared_expert
        # Dispatch by load: [L, X, G] replicas per GPU and slot served by each GPU, and
        # the water-fill's per-placement tables [L, 5, X, G] (waterfill_tables).
        self.num_routed = self.num_logical + (1 if shared_expert else 0)
        self.waterfill_passes = check_waterfill_passes(waterfill_passes)
        # `compiled`: the water-fill and assignment of a layer fused by torch.compile (a
        # few kernels instead of ~140 launches; CUDA only, compiled at the first call,
        # which must come before any graph capture: warm up eagerly first).
        self._route_by_load = waterfill.route_by_load
        if compiled:
            if self.device.type != "cuda":
                raise ValueError("compiled dispatch by load needs a CUDA device")
            self._route_by_load = torch.compile(
                waterfill.route_by_load, dynamic=False, fullgraph=True
            )
        gshape = (self.num_layers, self.num_routed, num_gpus) if by_load else (0, 0, 0)
        self.replicas = torch.zeros(gshape, dtype=torch.int64, device=self.device)
        self.slot_on = torch.zeros(gshape, dtype=torch.int64, device=self.device)
        self.fill_tables = torch.zeros(
            (gshape[0], WATERFILL_TABLES, *gshape[1:]), dtype=torch.int64, device=self.device
        )
        self._staged_replicas = torch.empty_like(self.replicas)
        self._staged_slot_on = torch.empty_like(self.slot_on)
        self._staged_fill_tables = torch.empty_like(self.fill_tables)
        self.update_(arr)

    # -- hot path -------------------------------------------------------------------

    def dispatch(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """`[..., K]` logical ids -> physical slot ids of the same shape and dtype."""
        if not is_layer_index(layer, self.num_layers):
            raise ValueError(
                f"dispatch needs a layer index in [0, {self.num_layers}), got {layer!r}"
            )
        if topk_ids.device != self.device:
            raise ValueError(f"ids on {topk_ids.device}, dispatch tables on {self.device}")
        ids = topk_ids.to(torch.int64)
        valid = (ids >= 0) & (ids < self.num_logical)
        expert = torch.where(valid, ids, 0)
        rows = self.table[layer]  # [E, 1 + R], a view: no copy
        count = rows[:, 0][expert]
        # Token index along the first dimension; every top-k column of a token uses it.
        num_tokens = ids.shape[0] if ids.dim() > 0 else 1
        token = torch.arange(num_tokens, device=ids.device, dtype=torch.int64)
        token = token.view((num_tokens,) + (1,) * max(ids.dim() - 1, 0)) if ids.dim() > 0 else token
        mix = token * _TOKEN_MUL + expert * _EXPERT_MUL + self.rank * _RANK_MUL
        pick = torch.remainder(mix, count)
        slot = rows.reshape(-1)[expert * rows.shape[1] + 1 + pick]
        return torch.where(valid, slot, -1).to(topk_ids.dtype)

    def count_picks(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's picks per expert of one layer: ids [...] -> [X] int64 (X = E, +1
        with the shared expert); padding and out-of-range ids are not counted."""
        # bucket 0: padding (< 0), 1..X: the experts, X + 1: out of range
        index = ids.reshape(-1).to(torch.int64).clamp(-1, self.num_routed) + 1
        out = torch.zeros(self.num_routed + 2, dtype=torch.int64, device=index.device)
        out.index_add_(0, index, torch.ones_like(index))
        return out[1 : self.num_routed + 1]

    def dispatch_by_load(
        self, layer: int, ids: torch.Tensor, counts: torch.Tensor, shared_movable: bool
    ) -> torch.Tensor:
        """`[T, K]` expert ids (the shared expert as id E in its own column, if any) ->
        slot ids of the same shape, by this step's load (worker_hooks/waterfill.py).

        counts: [G, X] every rank's `count_picks` of this layer and step (all-gathered).
        shared_movable: the shared expert's tokens may leave their GPU (`load+shared`).
        """
        if not self.by_load:
            raise RuntimeError("dispatch_by_load needs by_load=True at construction")
        if not is_layer_index(layer, self.num_layers):
            raise ValueError(
                f"dispatch needs a layer index in [0, {self.num_layers}), got {layer!r}"
            )
        flat = ids.reshape(-1).to(torch.int64)
        slot = self._route_by_load(
            flat,
            counts,
            self.fill_tables[layer],
            self.slot_on[layer],
            self.rank,
            shared_movable,
            self.shared_expert,
            self.waterfill_passes,
        )
        return slot.view(ids.shape).to(ids.dtype)

    # -- map swap (between replays) -----------------------------------------------------

    def stage(self, log2phy: torch.Tensor | np.ndarray) -> None:
        """Build the new tables and copy them to the device staging buffers.

        Runs before the pause; `commit()` then makes them live. Raises ValueError and
        changes nothing if the map does not fit the shapes fixed at construction.
        """
        arr = _as_numpy_map(log2phy)
        if arr.shape[:2] != (self.num_layers, self.num_logical):
            raise ValueError(
                f"log2phy must be [{self.num_layers}, {self.num_logical}, <= {self.max_replicas}], "
                f"got {arr.shape}"
            )
        table = candidate_table(arr, self.num_physical, self.num_gpus, self.rank, self.max_replicas)
        padded = np.full(tuple(self.log2phy.shape), -1, dtype=np.int64)
        r = min(arr.shape[2], self.max_replicas)
        padded[:, :, :r] = arr[:, :, :r]
        if self.by_load:
            replicas, slot_on = gpu_tables(
                padded, self.num_physical, self.num_gpus, self.shared_expert
            )
            # Small next to the map (L x X x G): copied synchronously, before the pause.
            self._staged_replicas.copy_(torch.from_numpy(replicas))
            self._staged_slot_on.copy_(torch.from_numpy(slot_on))
            self._staged_fill_tables.copy_(torch.from_numpy(waterfill_tables(replicas)))
        if self.device.type != "cuda":
            self._staged.copy_(torch.from_numpy(table))
            self._staged_map.copy_(torch.from_numpy(padded))
        else:
            if self._host_table is None:
                self._host_table = torch.empty(
                    tuple(self.table.shape), dtype=torch.int64, pin_memory=True
                )
                self._host_map = torch.empty(
                    tuple(self.log2phy.shape), dtype=torch.int64, pin_memory=True
                )
                self._h2d_done = torch.cuda.Event()
            assert self._host_map is not None and self._h2d_done is not None
            # The previous stage's copy may still read the pinned buffers.
            self._h2d_done.synchronize()
            self._host_table.numpy()[...] = table
            self._host_map.numpy()[...] = padded
            # Staging runs on the migration thread, whose current device is its own.
            with torch.cuda.device(self.device):
                self._staged.copy_(self._host_table, non_blocking=True)
                self._staged_map.copy_(self._host_map, non_blocking=True)
                self._h2d_done.record(torch.cuda.current_stream(self.device))
        self._has_staged = True

    def commit(self) -> None:
        """Make the staged tables live: in-place device copies, same storage."""
        if not self._has_staged:
            raise RuntimeError("commit() without a staged map")
        self.table.copy_(self._staged)
        self.log2phy.copy_(self._staged_map)
        if self.by_load:
            self.replicas.copy_(self._staged_replicas)
            self.slot_on.copy_(self._staged_slot_on)
            self.fill_tables.copy_(self._staged_fill_tables)
        self._has_staged = False

    def update_(self, log2phy: torch.Tensor | np.ndarray) -> None:
        """Stage and commit in one call (in place; shapes fixed at construction)."""
        self.stage(log2phy)
        self.commit()
