"""One rank's expert weights, as the migration executor and every transport see them.

`check_weights` says what a rank's weights may be: a dict of name -> tensor `[L, S + R,
...]` (stacked: S slots on this rank, R spare rows) or `LayerWeights` (name -> {layer:
tensor}, an engine's own per-layer parameters). `RankWeights` wraps them with what moving
them needs (the group, the row map of worker_hooks/rows.py, the flat views and indices,
the side stream, the versions aborted so far); `RowWriter` writes staged rows into the live
ones in place at commit. `MigrationAborted` is what a plan's weight moves raise once it is
aborted.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.wire.layout import DST_SLOT, LAYER, SRC_SLOT
from worker_hooks.rows import RowMap


class MigrationAborted(RuntimeError):
    """A plan was aborted while its weights moved (`RankWeights.check_aborted`, a transport,
    the executor): its staging is dropped, the served placement stays."""


# Weights stored one tensor per layer (an engine's own parameters, SGLang's
# `routed_experts_weights_of_layer`): name -> {layer: [rows, ...]}. Only "p2p" moves them
# (the peer-memory transports map one tensor per weight), without spare rows.
LayerWeights = dict[str, dict[int, torch.Tensor]]


def check_weights(weights: object) -> None:
    """TypeError / ValueError (naming what was given) unless `weights` is a non-empty dict
    of name -> torch.Tensor `[L, rows, ...]` (one rank's expert weights), or of
    name -> {layer: torch.Tensor `[rows, ...]`} (`LayerWeights`)."""
    what = (
        "weights must be a dict of name -> torch.Tensor [L, slots on this rank (+ spare rows), "
        "...] or of name -> {layer: torch.Tensor [slots on this rank, ...]}"
    )
    if isinstance(weights, torch.Tensor):
        raise TypeError(
            f"{what}, got one Tensor of shape {list(weights.shape)}: name it, e.g. {{'w': weights}}"
        )
    if not isinstance(weights, dict):
        raise TypeError(f"{what}, got {type(weights).__name__}")
    if not weights:
        raise ValueError(f"{what}: it names no tensor")
    for name, w in weights.items():
        if isinstance(name, str) and isinstance(w, dict):
            if not w:
                raise ValueError(f"weight {name!r} has no layer")
            for layer, t in w.items():
                if not isinstance(layer, int) or layer < 0 or not isinstance(t, torch.Tensor):
                    raise TypeError(f"{what}, got {name!r}[{layer!r}]: {type(t).__name__}")
                if t.dim() < 1:
                    raise ValueError(
                        f"weight {name!r} of layer {layer} is a scalar: it needs [rows, ...]"
                    )
            continue
        if not isinstance(name, str) or not isinstance(w, torch.Tensor):
            raise TypeError(f"{what}, got {name!r}: {type(w).__name__}")
        if w.dim() < 2:
            raise ValueError(
                f"weight {name!r} has shape {list(w.shape)}: it needs at least [L, rows]"
            )


class RankWeights:
    """One rank's live weights and what every transport needs around them.

    weights: name -> live tensor `[L, S + R, ...]` (S slots on this rank, R spare rows),
    all of one dtype and device, contiguous; or `LayerWeights` (name -> {layer: `[S,
    ...]`}, one device, each name one dtype and row shape, no spare rows), whose layers
    without an entry hold no routed experts. Also holds the group, the row map, the side
    stream (GPU), the event of the last commit and the versions aborted so far.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        weights: dict[str, torch.Tensor] | LayerWeights,
        group: dist.ProcessGroup | None,
        row_map: RowMap | None = None,
    ) -> None:
        check_weights(weights)
        self.rank, self.world_size = rank, world_size
        self.weights = weights
        self.group = group
        # Per layer (LayerWeights) or stacked; the shape and dtype of one row of each weight.
        self.by_layer: LayerWeights | None = None
        # The stacked weights (empty for LayerWeights): what the peer-memory transports map.
        self.stacked: dict[str, torch.Tensor] = {}
        if all(isinstance(w, dict) for w in weights.values()):
            by_layer: LayerWeights = weights  # type: ignore[assignment]
            self.by_layer = by_layer
            layers, first, rows_shape = self._check_layers(by_layer)
            self.num_layers, self.rows_per_layer = max(layers) + 1, int(first.shape[0])
            self.row_shapes = rows_shape
            self.row_dtypes = {name: next(iter(w.values())).dtype for name, w in by_layer.items()}
            self.layers_with_weights = frozenset(layers)
        else:
            if any(isinstance(w, dict) for w in weights.values()):
                raise TypeError(
                    "weights must be all stacked tensors or all per-layer dicts, not a mix"
                )
            stacked: dict[str, torch.Tensor] = weights  # type: ignore[assignment]
            self.stacked = stacked
            first = next(iter(stacked.values()))
            for name, w in stacked.items():
                if (
                    w.shape[:2] != first.shape[:2]
                    or w.dtype != first.dtype
                    or w.device != first.device
                ):
                    raise ValueError(
                        f"weight {name!r} must share [L, S], dtype and device with the others"
                    )
                if not w.is_contiguous():
                    raise ValueError(
                        f"weight {name!r} must be contiguous (its flat view is updated in place)"
                    )
            self.num_layers, self.rows_per_layer = int(first.shape[0]), int(first.shape[1])
            self.row_shapes = {name: tuple(w.shape[2:]) for name, w in stacked.items()}
            self.row_dtypes = {name: w.dtype for name, w in stacked.items()}
            self.layers_with_weights = frozenset(range(self.num_layers))
        if row_map is None:
            row_map = RowMap(world_size, self.num_layers, self.rows_per_layer)
        if (row_map.num_gpus, row_map.num_layers, row_map.rows_per_rank) != (
            world_size,
            self.num_layers,
            self.rows_per_layer,
        ):
            raise ValueError(
                f"row map of {row_map.num_gpus} ranks x {row_map.num_layers} layers x "
                f"{row_map.rows_per_rank} rows does not fit weights [{self.num_layers}, "
                f"{self.rows_per_layer}] on {world_size} ranks"
            )
        if self.by_layer is not None and row_map.spare_rows:
            raise ValueError("per-layer weights take no spare rows (the commit copies in place)")
        self.row_map = row_map
        self.slots_per_rank = row_map.slots_per_rank
        self.device = first.device
        self.dtype = first.dtype
        self.expert_bytes = sum(
            int(np.prod(shape)) * torch.empty(0, dtype=self.row_dtypes[name]).element_size()
            for name, shape in self.row_shapes.items()
        )
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.commit_event: torch.cuda.Event | None = None  # peers may read once it is done
        self.aborted: set[int] = set()

    @staticmethod
    def _check_layers(
        weights: LayerWeights,
    ) -> tuple[list[int], torch.Tensor, dict[str, tuple[int, ...]]]:
        """Every weight covers the same layers, one device, rows and a row shape and dtype
        per name; returns the layers, one tensor and each name's row shape."""
        names = list(weights)
        layers = sorted(weights[names[0]])
        first = weights[names[0]][layers[0]]
        shapes: dict[str, tuple[int, ...]] = {}
        for name, per_layer in weights.items():
            if sorted(per_layer) != layers:
                raise ValueError(
                    f"weight {name!r} covers layers {sorted(per_layer)}, "
                    f"{names[0]!r} covers {layers}"
                )
            one = per_layer[layers[0]]
            shapes[name] = tuple(one.shape[1:])
            for layer, t in per_layer.items():
                if (
                    t.shape[0] != first.shape[0]
                    or tuple(t.shape[1:]) != shapes[name]
                    or t.dtype != one.dtype
                    or t.device != first.device
                ):
                    raise ValueError(
                        f"weight {name!r} of layer {layer} ({list(t.shape)}, {t.dtype}, "
                        f"{t.device}) differs from its other layers or weights"
                    )
        return layers, first, shapes

    def check_aborted(self, version: int) -> None:
        if version in self.aborted:
            raise MigrationAborted(f"plan v{version} aborted while preparing")

    def flat(self, w: torch.Tensor) -> torch.Tensor:
        """`w` as its flat `[L * (S + R), ...]` view."""
        return w.view((self.num_layers * self.rows_per_layer,) + tuple(w.shape[2:]))

    def flat_index(self, layers: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """This rank's (layer, slot) pairs as row indices of its flat weight views,
        through the row map."""
        rows = layers * self.rows_per_layer + self.row_map.rows[self.rank, layers, slots]
        return torch.as_tensor(rows, dtype=torch.int64, device=self.device)

    def free_rows_of(
        self, new_rows: np.ndarray, incoming: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """For this rank's incoming transfer rows: which get a free row (their row changes
        from now to `new_rows` [G, L, S]), and that row in the flat weight views."""
        layers, slots = incoming[:, LAYER], incoming[:, DST_SLOT]
        new = new_rows[self.rank][layers, slots]
        take = new != self.row_map.rows[self.rank][layers, slots]
        return take, layers * self.rows_per_layer + new

    def new_staging(self, rows: int) -> dict[str, torch.Tensor]:
        """One contiguous tensor per weight, allocated on the current (side) stream."""
        return {
            name: torch.empty((rows,) + shape, dtype=self.row_dtypes[name], device=self.device)
            for name, shape in self.row_shapes.items()
        }

    def gather(
        self, name: str, layers: np.ndarray, slots: np.ndarray, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The live rows of weight `name` at this rank's (layer, slot) pairs, in that order
        (into `out` when given): one `index_select` on the flat view, or one per layer."""
        if self.by_layer is None:
            idx = self.flat_index(layers, slots)
            w = self.flat(self.stacked[name])
            return (
                torch.index_select(w, 0, idx, out=out)
                if out is not None
                else w.index_select(0, idx)
            )
        per_layer = self.by_layer[name]
        if out is None:
            out = torch.empty(
                (len(layers),) + self.row_shapes[name],
                dtype=self.row_dtypes[name],
                device=self.device,
            )
        for layer, at, rows in self._by_layer_runs(layers, slots):
            torch.index_select(per_layer[layer], 0, rows, out=out[at])
        return out

    def _live_rows(self, layers: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(layers as int64, this rank's live row of each (layer, slot)); ValueError for a
        layer this rank holds no weights of."""
        layers = np.asarray(layers, dtype=np.int64)
        missing = set(np.unique(layers).tolist()) - self.layers_with_weights
        if missing:
            raise ValueError(f"layer(s) {sorted(missing)} hold no expert weights on this rank")
        return layers, self.row_map.rows[self.rank, layers, slots]

    def _by_layer_runs(
        self, layers: np.ndarray, slots: np.ndarray
    ) -> list[tuple[int, slice, torch.Tensor]]:
        """(layer, positions, rows) for each run of equal layers in `layers` (callers pass
        rows sorted by layer, so a layer is usually one run)."""
        layers, rows = self._live_rows(layers, slots)
        if not len(layers):
            return []
        starts = np.flatnonzero(np.r_[True, layers[1:] != layers[:-1]])
        ends = np.r_[starts[1:], len(layers)]
        return [
            (
                int(layers[lo]),
                slice(int(lo), int(hi)),
                torch.as_tensor(rows[lo:hi], dtype=torch.int64, device=self.device),
            )
            for lo, hi in zip(starts, ends, strict=True)
        ]

    def writer(self, layers: np.ndarray, slots: np.ndarray) -> RowWriter:
        """What writes staged rows into this rank's live rows at (layer, slot), index
        tensors built now (on the caller's stream) so that the commit only copies."""
        if self.by_layer is None:
            return RowWriter(self, self.flat_index(layers, slots), [])
        return RowWriter(self, None, self._copy_runs(layers, slots))

    def _copy_runs(self, layers: np.ndarray, slots: np.ndarray) -> list[tuple[int, int, int, int]]:
        """(layer, first staging row, first live row, rows) for each run of staging rows
        that lands on consecutive live rows of one layer: one `copy_` each, at the copy
        bandwidth (an `index_copy_` of 88 MB rows ran at a third of it on an H200)."""
        layers, rows = self._live_rows(layers, slots)
        if not len(layers):
            return []
        breaks = np.flatnonzero((np.diff(layers) != 0) | (np.diff(rows) != 1)) + 1
        starts, ends = np.r_[0, breaks], np.r_[breaks, len(layers)]
        return [
            (int(layers[lo]), int(lo), int(rows[lo]), int(hi - lo))
            for lo, hi in zip(starts, ends, strict=True)
        ]

    def copy_local(self, rows: np.ndarray, staging: dict[str, torch.Tensor], lo: int) -> None:
        """Experts this rank already holds: straight from the live weights into staging."""
        if len(rows):
            for name in self.weights:
                self.gather(
                    name, rows[:, LAYER], rows[:, SRC_SLOT], out=staging[name][lo : lo + len(rows)]
                )


class RowWriter:
    """Writes staged rows (staging row i -> its live row) in place: one `index_copy_` per
    weight on the flat view, or for `LayerWeights` one `copy_` per weight and run of
    consecutive rows. Storage never changes (CUDA graphs stay valid)."""

    def __init__(
        self,
        ctx: RankWeights,
        flat_index: torch.Tensor | None,
        runs: list[tuple[int, int, int, int]],
    ) -> None:
        self.ctx, self.flat_index, self.runs = ctx, flat_index, runs

    def __len__(self) -> int:
        if self.flat_index is not None:
            return len(self.flat_index)
        return sum(n for _, _, _, n in self.runs)

    def write(self, staging: dict[str, torch.Tensor]) -> None:
        ctx = self.ctx
        if self.flat_index is not None:
            if len(self.flat_index):
                for name, w in ctx.stacked.items():
                    ctx.flat(w).index_copy_(0, self.flat_index, staging[name])
            return
        assert ctx.by_layer is not None
        for name, per_layer in ctx.by_layer.items():
            for layer, lo, row, n in self.runs:
                per_layer[layer][row : row + n].copy_(staging[name][lo : lo + n])
