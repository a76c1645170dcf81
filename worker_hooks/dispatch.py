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

from worker_hooks.devices import resolve_device
from worker_hooks.record import is_layer_index

__all__ = ["ReplicaDispatch", "candidate_table"]

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
    """

    def __init__(
        self,
        log2phy: torch.Tensor | np.ndarray,
        num_gpus: int,
        rank: int,
        max_replicas: int | None = None,
        device: torch.device | str = "cpu",
        num_physical: int | None = None,
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
        self._has_staged = False

    def update_(self, log2phy: torch.Tensor | np.ndarray) -> None:
        """Stage and commit in one call (in place; shapes fixed at construction)."""
        self.stage(log2phy)
        self.commit()
