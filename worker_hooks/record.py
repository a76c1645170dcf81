"""Per-layer expert counts recorded inside the forward pass.

The inference process calls `ExpertRecorder.record(layer, topk_ids)` from every MoE
layer (gate-routed, hash-routed, or with a shared expert fused as an extra routed
expert: all are just top-k selections). Recording must run inside captured CUDA
graphs, so it is one scatter-add into a static buffer: no host sync, no boolean
indexing, no allocation that outlives the call. Padding ids (-1) and out-of-range ids
are redirected to a sink element that is never reported.

Counts must land on the layer that routed them. The layer index is explicit and a
missing or out-of-range one is an error in eager mode; under graph capture (where
raising would break the capture) it records nothing and is counted in
`dropped_calls`, so a bug never shows up as silent extra load on layer 0.

Windows are read between replays: a rank's window pipeline
(worker_hooks/session/windows.py, the one the engine adapters use) copies `counts` to
pinned host memory and zeroes it in place, stream-ordered, never waiting on the host;
`take_window()` is the blocking form for tests, benches and offline tools.
"""

from __future__ import annotations

from typing import TypeGuard

import numpy as np
import torch

from worker_hooks.devices import resolve_device

__all__ = ["ExpertRecorder"]


def is_layer_index(layer: object, num_layers: int) -> TypeGuard[int]:
    """An explicit layer index: a plain int in [0, num_layers) (never a bool or None)."""
    return isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < num_layers


def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class ExpertRecorder:
    """Per-layer expert counts in static tensors; CUDA-graph safe.

    Args:
        num_layers: every decoder layer of the model (dense layers simply stay zero).
        num_logical: logical experts per layer, including a fused shared expert if the
            model routes one as an extra expert.
        num_physical: dispatch targets per layer, to also count the ids `route` handed
            out: physical slots, or weight rows where the hook keeps spare rows (then
            rows; the hook maps them back to slots before a window leaves the rank).
        device: where the counters live (the device the forward pass runs on).
    """

    def __init__(
        self,
        num_layers: int,
        num_logical: int,
        num_physical: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_layers <= 0 or num_logical <= 0:
            raise ValueError(
                f"num_layers and num_logical must be > 0, got {num_layers}, {num_logical}"
            )
        if num_physical is not None and num_physical <= 0:
            raise ValueError(f"num_physical must be > 0, got {num_physical}")
        self.num_layers = num_layers
        self.num_logical = num_logical
        self.num_physical = num_physical
        self.device = resolve_device(device)
        n_log = num_layers * num_logical
        n_phy = num_layers * num_physical if num_physical is not None else 0
        self._n_log = n_log
        self._n_phy = n_phy
        # One flat buffer: logical counts, physical counts, then one sink element that
        # absorbs padding and bad ids. A single buffer means a single snapshot copy.
        self._sink = n_log + n_phy
        self._flat = torch.zeros(n_log + n_phy + 1, dtype=torch.int64, device=self.device)
        self.logical_counts: torch.Tensor = self._flat[:n_log].view(num_layers, num_logical)
        self.physical_counts: torch.Tensor | None = (
            self._flat[n_log : n_log + n_phy].view(num_layers, num_physical)
            if num_physical is not None
            else None
        )
        # Calls under capture with a missing layer: they record nothing (see module doc).
        self.dropped_calls = 0

    # -- hot path -------------------------------------------------------------------

    def record(self, layer: int | None, topk_ids: torch.Tensor) -> None:
        """Add one routing decision of `layer`: ids of any shape, -1 = padding."""
        self._add(layer, topk_ids, base=0, width=self.num_logical)

    def record_physical(self, layer: int | None, phys_ids: torch.Tensor) -> None:
        """Add the target ids (slots, or rows with spare rows) `layer` dispatched to
        (-1 = padding)."""
        if self.num_physical is None:
            raise ValueError("record_physical needs num_physical at construction")
        self._add(layer, phys_ids, base=self._n_log, width=self.num_physical)

    def add_logical_counts(self, layer: int, counts: torch.Tensor) -> None:
        """Add one step's dense per-expert counts [num_logical] of `layer` (what `record`
        would count from the ids, when the caller has counted them already)."""
        if not is_layer_index(layer, self.num_layers):
            raise ValueError(
                f"needs an explicit layer index in [0, {self.num_layers}), got {layer!r}"
            )
        if counts.shape != (self.num_logical,):
            raise ValueError(
                f"counts of shape {tuple(counts.shape)}, expected ({self.num_logical},)"
            )
        self.logical_counts[layer] += counts.to(torch.int64)

    def add_physical_counts(self, layer: int, first_slot: int, counts: torch.Tensor) -> None:
        """Add dense per-slot counts (e.g. DeepEP's receive counts) from `first_slot` on."""
        if self.physical_counts is None:
            raise ValueError("add_physical_counts needs num_physical at construction")
        if not is_layer_index(layer, self.num_layers):
            raise ValueError(
                f"needs an explicit layer index in [0, {self.num_layers}), got {layer!r}"
            )
        if (
            counts.dim() != 1
            or not 0 <= first_slot <= self.physical_counts.shape[1] - counts.numel()
        ):
            raise ValueError(
                f"{counts.numel()} counts from slot {first_slot} do not fit "
                f"{self.physical_counts.shape[1]} slots"
            )
        self.physical_counts[layer, first_slot : first_slot + counts.numel()] += counts.to(
            torch.int64
        )

    def _add(self, layer: int | None, ids: torch.Tensor, base: int, width: int) -> None:
        if not is_layer_index(layer, self.num_layers):
            if _is_capturing(self.device):
                # Raising here would invalidate the whole capture; recording nothing
                # is the only safe choice, and the counter makes it visible.
                self.dropped_calls += 1
                return
            raise ValueError(
                f"record needs an explicit layer index in [0, {self.num_layers}), got {layer!r}"
            )
        if ids.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"expert ids must be an integer tensor, got {ids.dtype}")
        if ids.device != self.device:
            raise ValueError(f"ids on {ids.device}, recorder on {self.device}")
        flat_ids = ids.reshape(-1).to(torch.int64)
        in_range = (flat_ids >= 0) & (flat_ids < width)
        index = torch.where(in_range, flat_ids + (base + layer * width), self._sink)
        self._flat.index_add_(0, index, torch.ones_like(index))

    # -- window read-out ----------------------------------------------------------------

    @property
    def counts(self) -> torch.Tensor:
        """Every counter (logical, then physical), flat, without the sink: the buffer a
        rank's window pipeline copies out and zeroes in place between replays
        (worker_hooks/session/windows.py); `split` reads it."""
        return self._flat[: self._sink]

    def take_window(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Copy the counts out as int64 numpy ([L, E], [L, P] or None) and zero them,
        blocking until they are on the host (tests, benches, offline tools)."""
        flat = self.counts.cpu().numpy().copy()
        self.counts.zero_()
        return self.split(flat)

    def split(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """`counts` read on the host: logical [L, E] and physical [L, P] (or None)."""
        logical = flat[: self._n_log].reshape(self.num_layers, self.num_logical)
        physical = None
        if self.num_physical is not None:
            physical = flat[self._n_log : self._n_log + self._n_phy].reshape(
                self.num_layers, self.num_physical
            )
        return logical, physical
