"""Moving expert weights between ranks for a plan, off the serving path.

`MigrationExecutor` runs a plan's life on one rank: `prepare` receives every expert the
rank gains, `commit` makes them live, `abort` drops them. How the experts travel is
one `WeightTransport`, picked from `MigrationConfig.transport` by `make_transport`; the
executor sees only its `connect` / `receive` / `close`, and an engine asks the class
(`transport_class`) what it needs: `group_backend`, `one_host`, `maps_live_weights`.
- `P2PTransport` ("p2p"): torch.distributed point-to-point transfers on a process group
  of its own (gloo on CPU, NCCL on GPU, on a side stream there), a few layers per round:
  in each round each pair of ranks exchanges one packed buffer per weight tensor,
  received in place into staging, so transfers are large and few. Works across hosts.
- `IpcTransport` ("ipc"): ranks of one host map each other's live weights once (CUDA
  IPC on GPU; on CPU the weights must live in shared-memory files) and each receiver
  reads the rows it gains straight from its peers with `copy_`: on GPU the copy engines
  do the work, no kernel of the migration takes SMs from serving, and nothing is packed
  or buffered. Safe because live weights change only at commit, and no rank commits a
  plan before every rank prepared it; one all-gather at the start makes sure every peer
  committed the plan's base version on its device (and carries an abort to all).
- `OutboxTransport` ("outbox"): as "ipc", but senders pack their rows into two shared
  outboxes of bounded size and receivers read from there, one all-gather per step; for
  weights that cannot be mapped whole.
  Both need every rank of the group on one host and a gloo group.
Before any transport moves a weight, every rank of the group takes the plan (or none
does) through the group's store (worker_hooks/fence.py): a transfer never waits for a
rank that will not run it.
Serving keeps using the live weights meanwhile; `max_gbps` paces any transport so an
operator can bound its interference. With spare rows (worker_hooks/rows.py) each
incoming expert goes into a free row of the live weights during prepare (the ipc
transport reads it straight there; the executor writes the others' received experts
there), and commit only moves the row map (the caller swaps the dispatch maps): no
weight is copied in the pause. Without them, or beyond them, `commit` copies staging
into the live weights in place (storage unchanged: CUDA graphs stay valid); `abort`
drops staging.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.wire.layout import DST_RANK, DST_SLOT, LAYER, SRC_RANK, SRC_SLOT
from worker_hooks.fence import ABORTED, TransferFence, TransfersDeclined, group_store
from worker_hooks.outbox import SharedOutboxes, map_peer_weights, outbox_schedule
from worker_hooks.rows import RowMap

Transport = Literal["p2p", "ipc", "outbox"]
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)


@dataclass(frozen=True)
class MigrationConfig:
    """How a rank moves weights; checked on construction.

    transport: "p2p", "ipc" or "outbox" (module docstring); "ipc" and "outbox" need
        every rank of the group on this host and the group a gloo group.
    layers_per_chunk: p2p: layers exchanged per round of transfers.
    rounds_in_flight: p2p: rounds posted before the oldest is waited for; above 1 the
        packing of a round overlaps the transfers of the previous ones (correct on
        gloo, tests/unit/worker_hooks/test_migrate.py; not yet measured on GPU, so the
        default keeps the measured one-round-at-a-time behaviour).
    outbox_bytes: outbox: size of each of the two outboxes per rank, rounded down to
        whole experts (at least one).
    copy_streams: ipc on GPU: reads from one peer spread round-robin over this many
        streams (copy engines work in parallel).
    max_gbps: any transport: at most this many GB/s received per rank (0: as fast as
        the links go).
    join_seconds: any transport: how long a rank that took a plan waits for every rank
        of the group to take it before the plan fails everywhere (worker_hooks/fence.py).
    """

    transport: Transport = "p2p"
    layers_per_chunk: int = 4
    rounds_in_flight: int = 1
    outbox_bytes: int = 1 << 30
    copy_streams: int = 2
    max_gbps: float = 0.0
    join_seconds: float = 1.5

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        for name in ("layers_per_chunk", "rounds_in_flight", "outbox_bytes", "copy_streams"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.max_gbps >= 0:
            raise ValueError(f"max_gbps must be >= 0, got {self.max_gbps}")
        if not self.join_seconds > 0:
            raise ValueError(f"join_seconds must be > 0, got {self.join_seconds}")


@dataclass(frozen=True)
class PrepareStats:
    version: int
    experts_received: int
    bytes_received: int
    bytes_sent: int
    seconds: float


class MigrationAborted(RuntimeError):
    pass


# Weights stored one tensor per layer (an engine's own parameters, SGLang's
# `routed_experts_weights_of_layer`): name -> {layer: [rows, ...]}. Only "p2p" moves them
# (the peer-memory transports map one tensor per weight), without spare rows.
LayerWeights = dict[str, dict[int, torch.Tensor]]


def check_weights(weights: object) -> None:
    """TypeError / ValueError (naming what was given) unless `weights` is a non-empty dict
    of name -> torch.Tensor `[L, rows, ...]` (one rank's expert weights), or of
    name -> {layer: torch.Tensor `[rows, ...]`} (`LayerWeights`)."""
    what = ("weights must be a dict of name -> torch.Tensor [L, slots on this rank (+ spare rows), ...] "
            "or of name -> {layer: torch.Tensor [slots on this rank, ...]}")
    if isinstance(weights, torch.Tensor):
        raise TypeError(f"{what}, got one Tensor of shape {list(weights.shape)}: name it, e.g. {{'w': weights}}")
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
                    raise ValueError(f"weight {name!r} of layer {layer} is a scalar: it needs [rows, ...]")
            continue
        if not isinstance(name, str) or not isinstance(w, torch.Tensor):
            raise TypeError(f"{what}, got {name!r}: {type(w).__name__}")
        if w.dim() < 2:
            raise ValueError(f"weight {name!r} has shape {list(w.shape)}: it needs at least [L, rows]")


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
                raise TypeError("weights must be all stacked tensors or all per-layer dicts, not a mix")
            stacked: dict[str, torch.Tensor] = weights  # type: ignore[assignment]
            self.stacked = stacked
            first = next(iter(stacked.values()))
            for name, w in stacked.items():
                if w.shape[:2] != first.shape[:2] or w.dtype != first.dtype or w.device != first.device:
                    raise ValueError(f"weight {name!r} must share [L, S], dtype and device with the others")
                if not w.is_contiguous():
                    raise ValueError(f"weight {name!r} must be contiguous (its flat view is updated in place)")
            self.num_layers, self.rows_per_layer = int(first.shape[0]), int(first.shape[1])
            self.row_shapes = {name: tuple(w.shape[2:]) for name, w in stacked.items()}
            self.row_dtypes = {name: w.dtype for name, w in stacked.items()}
            self.layers_with_weights = frozenset(range(self.num_layers))
        if row_map is None:
            row_map = RowMap(world_size, self.num_layers, self.rows_per_layer)
        if (row_map.num_gpus, row_map.num_layers, row_map.rows_per_rank) != (
            world_size, self.num_layers, self.rows_per_layer
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
    def _check_layers(weights: LayerWeights) -> tuple[list[int], torch.Tensor, dict[str, tuple[int, ...]]]:
        """Every weight covers the same layers, one device, rows and a row shape and dtype
        per name; returns the layers, one tensor and each name's row shape."""
        names = list(weights)
        layers = sorted(weights[names[0]])
        first = weights[names[0]][layers[0]]
        shapes: dict[str, tuple[int, ...]] = {}
        for name, per_layer in weights.items():
            if sorted(per_layer) != layers:
                raise ValueError(f"weight {name!r} covers layers {sorted(per_layer)}, "
                                 f"{names[0]!r} covers {layers}")
            one = per_layer[layers[0]]
            shapes[name] = tuple(one.shape[1:])
            for layer, t in per_layer.items():
                if (t.shape[0] != first.shape[0] or tuple(t.shape[1:]) != shapes[name]
                        or t.dtype != one.dtype or t.device != first.device):
                    raise ValueError(f"weight {name!r} of layer {layer} ({list(t.shape)}, {t.dtype}, "
                                     f"{t.device}) differs from its other layers or weights")
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

    def free_rows_of(self, new_rows: np.ndarray, incoming: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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

    def gather(self, name: str, layers: np.ndarray, slots: np.ndarray,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The live rows of weight `name` at this rank's (layer, slot) pairs, in that order
        (into `out` when given): one `index_select` on the flat view, or one per layer."""
        if self.by_layer is None:
            idx = self.flat_index(layers, slots)
            w = self.flat(self.stacked[name])
            return torch.index_select(w, 0, idx, out=out) if out is not None else w.index_select(0, idx)
        per_layer = self.by_layer[name]
        if out is None:
            out = torch.empty((len(layers),) + self.row_shapes[name], dtype=self.row_dtypes[name],
                              device=self.device)
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

    def _by_layer_runs(self, layers: np.ndarray, slots: np.ndarray) -> list[tuple[int, slice, torch.Tensor]]:
        """(layer, positions, rows) for each run of equal layers in `layers` (callers pass
        rows sorted by layer, so a layer is usually one run)."""
        layers, rows = self._live_rows(layers, slots)
        if not len(layers):
            return []
        starts = np.flatnonzero(np.r_[True, layers[1:] != layers[:-1]])
        ends = np.r_[starts[1:], len(layers)]
        return [(int(layers[lo]), slice(int(lo), int(hi)),
                 torch.as_tensor(rows[lo:hi], dtype=torch.int64, device=self.device))
                for lo, hi in zip(starts, ends, strict=True)]

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
        return [(int(layers[lo]), int(lo), int(rows[lo]), int(hi - lo)) for lo, hi in zip(starts, ends, strict=True)]

    def copy_local(self, rows: np.ndarray, staging: dict[str, torch.Tensor], lo: int) -> None:
        """Experts this rank already holds: straight from the live weights into staging."""
        if len(rows):
            for name in self.weights:
                self.gather(name, rows[:, LAYER], rows[:, SRC_SLOT], out=staging[name][lo:lo + len(rows)])


class RowWriter:
    """Writes staged rows (staging row i -> its live row) in place: one `index_copy_` per
    weight on the flat view, or for `LayerWeights` one `copy_` per weight and run of
    consecutive rows. Storage never changes (CUDA graphs stay valid)."""

    def __init__(self, ctx: RankWeights, flat_index: torch.Tensor | None,
                 runs: list[tuple[int, int, int, int]]) -> None:
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
                per_layer[layer][row:row + n].copy_(staging[name][lo:lo + n])


@dataclass(frozen=True)
class PlanMoves:
    """What a transport moves for one plan.

    transfers: [K, 5] (layer, dst_rank, dst_slot, src_rank, src_slot), checked, the same
        on every rank.
    new_rows: [G, L, S] every rank's rows once the plan commits (rows.RowMap.plan): an
        incoming expert whose row differs from today's goes to that free row.
    start: `time.perf_counter()` when prepare began (pacing counts from there).
    """

    version: int
    transfers: np.ndarray
    new_rows: np.ndarray
    start: float


@dataclass
class Received:
    """A transport's result: `incoming` [n, 5] transfer rows and their experts in
    `staging` (name -> [n, ...]), plus bytes moved. Experts a transport wrote straight
    into their free rows are left out; the executor writes the returned ones that have
    a free row into it and keeps the rest for commit."""

    staging: dict[str, torch.Tensor]
    incoming: np.ndarray
    bytes_sent: int
    bytes_received: int


class WeightTransport(ABC):
    """How one rank receives a plan's experts: the interface the executor sees.

    `receive` runs on the migration thread, inside the side stream on GPU; it is
    collective on the group (every rank calls it for the same plan) and raises
    MigrationAborted once the plan is aborted. `connect` does any collective setup once
    (mapping the peers' memory), `close` releases it."""

    name: ClassVar[Transport]
    # Every rank of the group on one host, the group a gloo group (peers' memory is mapped).
    one_host: ClassVar[bool] = False
    # Peers map this rank's live weights: on CPU they must live in shared-memory files
    # (worker_hooks.outbox.in_shared_memory).
    maps_live_weights: ClassVar[bool] = False

    def __init__(self, ctx: RankWeights, config: MigrationConfig) -> None:
        self.ctx = ctx
        self.config = config

    @classmethod
    def group_backend(cls, device: torch.device) -> Literal["nccl", "gloo"]:
        """The backend of the process group this transport needs for weights on `device`."""
        return "nccl" if device.type == "cuda" and not cls.one_host else "gloo"

    @abstractmethod
    def connect(self) -> None:
        """Collective setup, done by the first `receive` unless called earlier (at startup,
        say); a no-op once connected or when there is nothing to set up."""

    @abstractmethod
    def receive(self, plan: PlanMoves) -> Received:
        """This rank's incoming experts of `plan` (see `Received`)."""

    @abstractmethod
    def close(self) -> None:
        """Release what `connect` set up."""

    def _settle(self) -> None:
        """Wait until what was queued so far has moved."""
        if self.ctx.stream is not None:
            self.ctx.stream.synchronize()

    def _pace(self, start: float, bytes_done: int) -> None:
        """Sleep until `bytes_done` is within the `max_gbps` budget since `start`."""
        if self.config.max_gbps > 0 and bytes_done:
            self._settle()  # pace what has moved, not what is queued
            ahead = bytes_done / (self.config.max_gbps * 1e9) - (time.perf_counter() - start)
            if ahead > 0:
                time.sleep(ahead)


def plan_tag(version: int) -> int:
    """The point-to-point tag of plan `version`'s messages: positive, fits a C int, and
    differs between consecutive plans."""
    return 1 + version % (2**31 - 2)


class P2PTransport(WeightTransport):
    """torch.distributed send/recv on the group, a few layers per round (any hosts)."""

    name = "p2p"

    def connect(self) -> None:
        """Nothing to set up: the process group is all it needs."""

    def close(self) -> None:
        """Nothing to release."""

    def receive(self, plan: PlanMoves) -> Received:
        """Staging holds one contiguous tensor per weight, its rows ordered by (round,
        source rank, layer, slot): the experts one peer sends in one round are one
        contiguous block, received in place with no copy afterwards. Each round
        sends one `index_select`-packed buffer per weight and peer."""
        ctx, per_round = self.ctx, self.config.layers_per_chunk
        t = plan.transfers
        # 1. One order on every rank: round, then source rank, then layer and slot.
        rounds = t[:, LAYER] // per_round
        t = t[np.lexsort((t[:, DST_SLOT], t[:, LAYER], t[:, DST_RANK], t[:, SRC_RANK], rounds))]
        rounds = t[:, LAYER] // per_round
        incoming = t[t[:, DST_RANK] == ctx.rank]
        in_rounds = incoming[:, LAYER] // per_round
        # 2. Staging, allocated on the side stream that fills it.
        staging = ctx.new_staging(len(incoming))
        sent = received = 0
        # 3. Rounds are pipelined: round r+1 is packed while round r is on the wire,
        #    with at most `rounds_in_flight` rounds (and their send buffers) alive.
        in_flight: deque[list[dist.Work]] = deque()
        # Each plan's messages carry a tag of their own: a plan aborted on one rank
        # mid-exchange leaves its peers' buffers on the wire, and on a shared tag the next
        # plan's receives would take them (a size mismatch aborts the process in gloo).
        tag = plan_tag(plan.version)
        # An abort does not stop the exchange half-way: the peers would wait for this
        # rank's buffers until their group times out (and gloo closes its pairs for good).
        # Every rank runs every round; the executor drops the staging after (invariant 5).
        for r in np.unique(rounds):
            while len(in_flight) >= self.config.rounds_in_flight:
                for work in in_flight.popleft():
                    work.wait()
            chunk = t[rounds == r]
            ops = []
            for peer in range(ctx.world_size):
                in_mask = (in_rounds == r) & (incoming[:, SRC_RANK] == peer)
                lo = int(np.argmax(in_mask)) if in_mask.any() else 0
                hi = lo + int(in_mask.sum())
                if peer == ctx.rank:  # local moves: straight into staging
                    ctx.copy_local(incoming[lo:hi], staging, lo)
                    continue
                out_rows = chunk[(chunk[:, SRC_RANK] == ctx.rank) & (chunk[:, DST_RANK] == peer)]
                if len(out_rows):
                    for name in ctx.weights:
                        buf = ctx.gather(name, out_rows[:, LAYER], out_rows[:, SRC_SLOT])
                        ops.append(dist.P2POp(dist.isend, buf, peer, ctx.group, tag))
                        sent += buf.numel() * buf.element_size()
                if hi > lo:
                    for name in ctx.weights:
                        view = staging[name][lo:hi]  # contiguous rows: received in place
                        ops.append(dist.P2POp(dist.irecv, view, peer, ctx.group, tag))
                        received += view.numel() * view.element_size()
            if ops:
                in_flight.append(dist.batch_isend_irecv(ops))
            self._pace(plan.start, received)
        while in_flight:
            for work in in_flight.popleft():
                work.wait()
        return Received(staging, incoming, sent, received)


class _PeerMemoryTransport(WeightTransport):
    """What the transports that read their peers' memory on this host share: read
    streams, and one collective that checks the ranks agree before reading."""

    one_host = True

    def __init__(self, ctx: RankWeights, config: MigrationConfig) -> None:
        super().__init__(ctx, config)
        # Streams that peer reads run on, by (device index, lane); made once.
        self._read_streams: dict[tuple[int | None, int], torch.cuda.Stream] = {}

    def close(self) -> None:
        self._read_streams.clear()

    def _settle(self) -> None:
        super()._settle()
        self._sync_reads()

    def _reading_from(self, src: torch.device, lane: int) -> contextlib.ExitStack:
        """Run `copy_` from a peer's memory on `src` on read streams of its own at both
        ends (torch copies between devices on the source's current stream, then makes
        the destination's current stream wait): reads stay off serving's stream and off
        the side stream, whose packing they then overlap. No-op on CPU."""
        ctx = contextlib.ExitStack()
        if self.ctx.device.type == "cuda":
            for dev in (self.ctx.device, src):
                key = (dev.index, lane)
                if key not in self._read_streams:
                    self._read_streams[key] = torch.cuda.Stream(dev)
                ctx.enter_context(torch.cuda.stream(self._read_streams[key]))
        return ctx

    def _sync_reads(self) -> None:
        for stream in self._read_streams.values():
            stream.synchronize()

    def _agree(self, version: int) -> None:
        """Collective on the group: every rank got here in plan `version`, with the same
        rows for every rank (a peer's expert is read where this rank's row map says it
        is). An abort seen by any rank stops all of them here together, none is left
        waiting; a disagreement fails the plan on every rank."""
        ctx = self.ctx
        state = torch.tensor(
            [int(version in ctx.aborted), version, ctx.row_map.digest()], dtype=torch.int64
        )
        states = [torch.zeros_like(state) for _ in range(ctx.world_size)]
        dist.all_gather(states, state, group=ctx.group)
        if any(int(s[0]) for s in states):
            raise MigrationAborted(f"plan v{version} aborted while preparing")
        if len({int(s[1]) for s in states}) > 1:
            raise RuntimeError(f"ranks prepare different plans: {[int(s[1]) for s in states]}")
        digests = [int(s[2]) for s in states]
        if len(set(digests)) > 1:
            odd = [r for r, d in enumerate(digests) if digests.count(d) == 1]
            raise RuntimeError(
                f"ranks disagree on where the weights of the EP group are (row maps differ; "
                f"rank(s) {odd or list(range(ctx.world_size))} differ): a rank restarted "
                "alone? Restart the whole EP group"
            )


class IpcTransport(_PeerMemoryTransport):
    """Receivers read their rows from the peers' mapped live weights (one host)."""

    name = "ipc"
    maps_live_weights = True

    def __init__(self, ctx: RankWeights, config: MigrationConfig) -> None:
        super().__init__(ctx, config)
        self._peer_weights: dict[int, dict[str, torch.Tensor]] | None = None

    def connect(self) -> None:
        if self._peer_weights is None:
            ctx = self.ctx
            self._peer_weights = map_peer_weights(ctx.rank, ctx.world_size, ctx.stacked, ctx.group)

    def close(self) -> None:
        self._peer_weights = None
        super().close()

    def receive(self, plan: PlanMoves) -> Received:
        """Read each gained row from the peer's live weights, straight into its free row
        where `plan.new_rows` gives it one, else into staging (returned with its incoming
        rows). Rows are ordered by (source rank, layer, source slot), so rows adjacent in
        a peer's weights and at the destination are one `copy_` per weight."""
        ctx, t, version = self.ctx, plan.transfers, plan.version
        # 1. Every rank's last commit is done on its device, nobody aborted, and all
        #    prepare the same plan (each rank's hook checked the plan's base version).
        if ctx.commit_event is not None:
            ctx.commit_event.synchronize()
        self._agree(version)
        self.connect()
        assert self._peer_weights is not None
        # 2. Incoming rows, sorted so that runs of adjacent source rows are contiguous
        #    (free rows are handed out in the same order, rows.RowMap.plan); each goes to
        #    its free row (live weights) or to the next staging row.
        incoming = t[t[:, DST_RANK] == ctx.rank]
        src_row = incoming[:, LAYER] * ctx.rows_per_layer + ctx.row_map.rows[
            incoming[:, SRC_RANK], incoming[:, LAYER], incoming[:, SRC_SLOT]
        ]
        order = np.lexsort((src_row, incoming[:, SRC_RANK]))
        incoming, src_row = incoming[order], src_row[order]
        live, live_row = ctx.free_rows_of(plan.new_rows, incoming)
        staged = incoming[~live]
        staging = ctx.new_staging(len(staged))
        dst_row = np.where(live, live_row, np.cumsum(~live) - 1)
        breaks = np.flatnonzero(
            (np.diff(src_row) != 1) | (np.diff(incoming[:, SRC_RANK]) != 0)
            | (np.diff(dst_row) != 1) | (np.diff(live.astype(np.int8)) != 0)
        ) + 1
        runs = np.split(np.arange(len(incoming)), breaks) if len(incoming) else []
        own = {name: ctx.flat(w) for name, w in ctx.stacked.items()}
        received = 0
        for i, run in enumerate(runs):
            ctx.check_aborted(version)
            lo, n = int(run[0]), len(run)
            peer = int(incoming[lo, SRC_RANK])
            first, to = int(src_row[lo]), int(dst_row[lo])
            target = own if live[lo] else staging
            if peer == ctx.rank:  # a local move: free rows and mapped rows never overlap
                for name in ctx.weights:
                    target[name][to:to + n].copy_(own[name][first:first + n])
                continue
            peer_weights = self._peer_weights[peer]
            src = next(iter(peer_weights.values())).device
            with self._reading_from(src, lane=i % self.config.copy_streams):
                for name, w in peer_weights.items():
                    target[name][to:to + n].copy_(ctx.flat(w)[first:first + n], non_blocking=True)
            received += n * ctx.expert_bytes
            self._pace(plan.start, received)
        self._sync_reads()
        # Senders do no work: their rows are read by the receivers.
        sent = int(((t[:, SRC_RANK] == ctx.rank) & (t[:, DST_RANK] != ctx.rank)).sum())
        return Received(staging, staged, sent * ctx.expert_bytes, received)


class OutboxTransport(_PeerMemoryTransport):
    """Senders pack into two bounded shared outboxes, receivers read them (one host)."""

    name = "outbox"

    def __init__(self, ctx: RankWeights, config: MigrationConfig) -> None:
        super().__init__(ctx, config)
        self.outbox_rows = max(1, config.outbox_bytes // max(1, ctx.expert_bytes))
        self._outboxes: SharedOutboxes | None = None

    def connect(self) -> None:
        if self._outboxes is None:
            ctx = self.ctx
            shapes = {name: tuple(w.shape[2:]) for name, w in ctx.stacked.items()}
            self._outboxes = SharedOutboxes(
                ctx.rank, ctx.world_size, shapes, ctx.dtype, ctx.device, self.outbox_rows, ctx.group
            )

    def close(self) -> None:
        super().close()
        if self._outboxes is not None:
            self._outboxes.close()
            self._outboxes = None

    def receive(self, plan: PlanMoves) -> Received:
        """Step k: pack this rank's rows of step k into outbox k % 2, wait until every
        rank packed step k and finished reading step k - 1 (`_agree`, which also
        carries an abort seen by any rank so that all stop together), then pull step
        k's rows from each peer's outbox into staging. Reading step k overlaps packing
        step k + 1 into the other outbox.

        Staging rows: the remote experts in schedule order (source rank, layer, slot),
        then the local ones."""
        ctx, t, version = self.ctx, plan.transfers, plan.version
        self.connect()
        boxes = self._outboxes
        assert boxes is not None
        schedule = outbox_schedule(t, self.outbox_rows)
        step = schedule.step_of()
        row = schedule.position % schedule.rows
        mine_out = schedule.remote[:, SRC_RANK] == ctx.rank
        mine_in = schedule.remote[:, DST_RANK] == ctx.rank
        local = t[(t[:, DST_RANK] == ctx.rank) & (t[:, SRC_RANK] == ctx.rank)]
        incoming = np.concatenate([schedule.remote[mine_in], local])
        in_step, in_row = step[mine_in], row[mine_in]
        in_src = schedule.remote[mine_in, SRC_RANK]
        staging = ctx.new_staging(len(incoming))
        ctx.copy_local(local, staging, int(mine_in.sum()))
        sent = received = 0
        for k in range(schedule.steps):
            # 1. Pack step k (outbox k % 2 was last read in step k - 2: free).
            out_rows = schedule.remote[mine_out & (step == k)]
            box = boxes.own[k % 2]
            if len(out_rows):
                idx = ctx.flat_index(out_rows[:, LAYER], out_rows[:, SRC_SLOT])
                for name, w in ctx.stacked.items():
                    torch.index_select(ctx.flat(w), 0, idx, out=box[name][: len(out_rows)])
                sent += len(out_rows) * ctx.expert_bytes
            self._settle()  # packed, and step k - 1's reads are done
            # 2. Everyone packed k and read k - 1; any abort stops every rank here.
            self._agree(version)
            # 3. Read step k from each peer: one contiguous block per peer and weight.
            for peer in np.unique(in_src[in_step == k]):
                sel = np.flatnonzero((in_step == k) & (in_src == peer))
                lo, n = int(sel[0]), len(sel)
                first = int(in_row[sel[0]])
                src_box = boxes.peer[int(peer)][k % 2]
                with self._reading_from(next(iter(src_box.values())).device, lane=0):
                    for name in ctx.weights:
                        staging[name][lo:lo + n].copy_(src_box[name][first:first + n], non_blocking=True)
                received += n * ctx.expert_bytes
            self._pace(plan.start, received)
        self._sync_reads()
        # 4. No rank reuses its outboxes before every peer finished reading them.
        if schedule.steps:
            self._agree(version)
        return Received(staging, incoming, sent, received)


_TRANSPORT_CLASSES: dict[Transport, type[WeightTransport]] = {
    cls.name: cls for cls in (P2PTransport, IpcTransport, OutboxTransport)
}


def transport_class(name: Transport) -> type[WeightTransport]:
    """The class of the transport `name` (what it needs: `one_host`, `maps_live_weights`,
    `group_backend`)."""
    if name not in _TRANSPORT_CLASSES:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    return _TRANSPORT_CLASSES[name]


def make_transport(config: MigrationConfig, ctx: RankWeights) -> WeightTransport:
    """The transport `config.transport` names, over this rank's weights."""
    return transport_class(config.transport)(ctx, config)


class MigrationExecutor:
    """Stages, commits or drops the expert weights of one plan at a time.

    Args:
        rank, world_size: this rank within `group`.
        weights: name -> live tensor `[L, S + R, ...]` (S slots on this rank, R spare
            rows); all tensors share one dtype and device.
        group: the process group for transfers (keep it apart from serving's).
        config: the transport and its settings (MigrationConfig; default p2p).
        row_map: the rows of every rank (worker_hooks/rows.py); from here on this
            executor moves it (at commit), the caller only reads it (for dispatch);
            default: no spare rows.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        weights: dict[str, torch.Tensor] | LayerWeights,
        group: dist.ProcessGroup | None = None,
        config: MigrationConfig | None = None,
        row_map: RowMap | None = None,
    ) -> None:
        self.config = config if config is not None else MigrationConfig()
        self.ctx = RankWeights(rank, world_size, weights, group, row_map)
        if self.ctx.by_layer is not None and transport_class(self.config.transport).one_host:
            raise ValueError(f"transport {self.config.transport!r} maps one tensor per weight: "
                             "per-layer weights move with 'p2p'")
        self.transport = make_transport(self.config, self.ctx)
        self.weights = weights
        self.row_map = self.ctx.row_map
        self._lock = threading.Lock()
        self._staged_version: int | None = None
        self._staging: dict[str, torch.Tensor] | None = None  # name -> [n_in, ...]
        self._staged_writer: RowWriter | None = None           # staging row i -> its live row
        self._staged_rows: np.ndarray | None = None            # [G, L, S] after commit
        # No rank moves a plan's weights before every rank of the group said it will
        # (a rank left waiting for a peer that never comes breaks the group for good).
        shared = group_store(group) if world_size > 1 else None
        self.fence = (TransferFence(shared[0], rank, world_size, self.config.join_seconds, prefix=shared[1])
                      if shared is not None else None)

    @property
    def staged_rows(self) -> np.ndarray | None:
        """The rows of every rank `[G, L, S]` once the staged plan commits."""
        return self._staged_rows

    def connect(self) -> None:
        """The transport's collective setup (mapping the peers' weights or outboxes), done
        by the first prepare unless called earlier (at startup, say)."""
        self.transport.connect()

    def close(self) -> None:
        """Release what the transport holds (the peers' mapped weights, the outboxes)."""
        self.transport.close()

    # ------------------------------------------------------------ prepare

    def decline(self, version: int, reason: str) -> None:
        """This rank will not take plan `version`: no rank runs its transfers, and its
        peers fail the plan at once (raises TransfersDeclined, with `reason`)."""
        if self.fence is not None:
            self.fence.decline(version, reason)
        raise TransfersDeclined(reason)

    def _join(self, version: int) -> None:
        """Wait until every rank of the group takes plan `version` (fence.py). Raises
        MigrationAborted if this rank's Abort came first, TransfersDeclined if a peer
        declined or did not join in time."""
        if self.fence is None:
            return
        aborted = self.ctx.aborted
        try:
            self.fence.join(version, lambda: ABORTED if version in aborted else "")
        except TransfersDeclined as exc:
            self.ctx.check_aborted(version)
            if exc.aborted:  # a peer heard the Abort first: this rank will hear it too
                raise MigrationAborted(f"plan v{version} aborted before its transfers ({exc})") from exc
            raise

    def prepare(self, version: int, transfers: np.ndarray) -> PrepareStats:
        """Receive this rank's incoming experts of plan `version` into staging.

        transfers: [K, 5] int (layer, dst_rank, dst_slot, src_rank, src_slot), the
        same list on every rank. First every rank of the group takes the plan (or none
        does: TransfersDeclined, within `join_seconds`); then blocks the calling
        (background) thread until every exchange of this rank finished, raises on a
        failed peer, and raises MigrationAborted when the plan is aborted meanwhile.
        """
        start = time.perf_counter()
        ctx = self.ctx
        t = np.asarray(transfers, dtype=np.int64).reshape(-1, 5)
        if t.size and (t[:, [DST_RANK, SRC_RANK]].max() >= ctx.world_size or t.min() < 0
                       or t[:, [DST_SLOT, SRC_SLOT]].max() >= ctx.slots_per_rank
                       or t[:, LAYER].max() >= ctx.num_layers):
            raise ValueError("transfer list refers to ranks, slots or layers out of range")
        if t.size and not set(np.unique(t[:, LAYER]).tolist()) <= ctx.layers_with_weights:
            raise ValueError("transfer list moves experts of layers that hold no expert weights")
        # The current CUDA device is per thread: prepare runs on a background thread
        # whose device would otherwise be cuda:0 (NCCL and events need this rank's).
        stream_ctx = contextlib.ExitStack()
        if ctx.stream is not None:
            stream_ctx.enter_context(torch.cuda.device(ctx.device))
            stream_ctx.enter_context(torch.cuda.stream(ctx.stream))
        self._join(version)
        new_rows = self.row_map.plan(t)
        experts_in = int((t[:, DST_RANK] == ctx.rank).sum())
        with stream_ctx:
            got = self.transport.receive(PlanMoves(version, t, new_rows, start))
            staging, incoming = self._fill_free_rows(new_rows, got.staging, got.incoming)
            # Built here, on the side stream: made on the thread's default stream, its
            # host-to-device copy would wait for every replay serving has queued there.
            writer = ctx.writer(incoming[:, LAYER], incoming[:, DST_SLOT])
        if ctx.stream is not None:
            ctx.stream.synchronize()
        with self._lock:
            ctx.check_aborted(version)
            self._staging, self._staged_writer, self._staged_version = staging, writer, version
            self._staged_rows = new_rows
        return PrepareStats(
            version, experts_in, got.bytes_received, got.bytes_sent, time.perf_counter() - start
        )

    def _fill_free_rows(
        self, new_rows: np.ndarray, staging: dict[str, torch.Tensor], incoming: np.ndarray
    ) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """Write the received experts that get a free row under `new_rows` into it now;
        returns the staging and incoming rows left for commit to copy in place."""
        ctx = self.ctx
        take, rows = ctx.free_rows_of(new_rows, incoming)
        if not take.any():
            return staging, incoming
        # Rows freed by the last commit may still be read by replays queued before it.
        if ctx.commit_event is not None and ctx.stream is not None:
            ctx.stream.wait_event(ctx.commit_event)
        dst = torch.as_tensor(rows[take], dtype=torch.int64, device=ctx.device)
        if take.all():
            for name, w in ctx.stacked.items():
                ctx.flat(w).index_copy_(0, dst, staging[name])
            return ctx.new_staging(0), incoming[:0]
        src = torch.as_tensor(np.flatnonzero(take), dtype=torch.int64, device=ctx.device)
        for name, w in ctx.stacked.items():
            ctx.flat(w).index_copy_(0, dst, staging[name].index_select(0, src))
        keep = torch.as_tensor(np.flatnonzero(~take), dtype=torch.int64, device=ctx.device)
        rest = {name: buf.index_select(0, keep) for name, buf in staging.items()}
        return rest, incoming[~take]

    # ------------------------------------------------------------ commit / abort

    def commit(self, version: int) -> int:
        """Make the staged plan live: copy the staged experts (those without a free row)
        into their rows in place, then move the row map; returns experts written.

        One `index_copy_` per weight on its flat [L * (S + R), ...] view (per weight and
        layer for LayerWeights). Call between
        forward steps (between graph replays): storage never changes."""
        ctx = self.ctx
        with self._lock:
            if (self._staged_version != version or self._staging is None
                    or self._staged_writer is None or self._staged_rows is None):
                raise RuntimeError(f"commit of v{version} but staged is v{self._staged_version}")
            staging, writer, rows = self._staging, self._staged_writer, self._staged_rows
            self._staging = self._staged_writer = self._staged_rows = None
            self._staged_version = None
        writer.write(staging)
        self.row_map.switch(rows)  # this executor owns the rows (worker_hooks/rows.py)
        if ctx.device.type == "cuda":  # peers read these rows once the copy is done
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(ctx.device))
            ctx.commit_event = event
        return len(writer)

    def abort(self, version: int) -> None:
        """Drop the staging of `version` (also while it is still being prepared)."""
        with self._lock:
            self.ctx.aborted.add(version)
            if self._staged_version == version:
                self._staging = self._staged_writer = self._staged_rows = None
                self._staged_version = None
