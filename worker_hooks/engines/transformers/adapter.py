"""Serve a Hugging Face transformers MoE model with expert parallelism, rebalanced live.

    ep = attach(model, AdapterConfig(Link("127.0.0.1:50051", deployment="ds-v3")))
    ep.start()
    for each step: logits = model(input_ids).logits; ep.step_end()

Families: DeepseekV3, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V4 (transformers 5.17 and
5.24). In all of them a MoE block is `mlp` with a router `mlp.gate` returning
`(logits, top_k_weights, top_k_index)` and experts `mlp.experts` holding 3-D
`gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`, called `experts(h, top_k_index,
top_k_weights)`.

The seam: `mlp.experts` is replaced by `SlotExperts`, a module with the same call. Why
this one: the block's own forward stays the engine's code (router with its group
limits or hash table, shared experts, residuals), and the call it makes to its experts
is the contract transformers' experts registry (`integrations.moe`) dispatches on, so it
is the same in both versions. Not the registry itself: it is keyed by
`config._experts_implementation`, one name shared by every layer of the model, so the
per-layer state (layer index, hook, slot weights) would hang on the stock module, and
that module would keep its `[E, ...]` parameters alive on every rank. Not `layer.mlp`:
that would re-implement five block forwards (shared experts, DeepSeek-V4's
`input_ids`). Each family's gate activation is kept by calling its experts class's own
`_apply_gate` (DeepSeek-V4 clamps; the others are SiLU(gate) * up).

Per MoE layer and step, `SlotExperts`:
1. `hook.route(layer, top_k_index)`: counts this rank's picks (logical and by slot) and
   maps every pick to a physical row (replica dispatch; row ids with spare rows);
2. with G > 1 ranks, all-gathers the tokens and their rows over the EP group (every
   rank runs the whole model on its own tokens; only the experts are split);
3. computes the picks routed to the rows this rank holds, from the live slot weights
   `[L, S + R, ...]` that the hook migrates (`hook.weights`);
4. all-reduces the per-pick outputs (each pick is non-zero on exactly one rank, so the
   sum is exact), keeps its own tokens and combines over top-k in a fixed order.
Hash-routed layers (DeepSeek-V4) are MoE layers like the others: each has its own
layer index, so its counts and placement are its own.

CPU: each pick is its own small product (`torch.bmm`), the same product transformers'
`batched_mm` experts run, so a wrapped model's fp32 logits equal the unwrapped
`batched_mm` model's bit for bit, before and after any rebalance. CUDA: the local picks
are sorted by row and run through one grouped matrix product per projection, with static
shapes and no host sync, so the blocks capture in a CUDA graph (`graph_moe_blocks`); a
map swap is in-place copies between replays.

torch.distributed must be initialized (a world of one is fine): the commit agreement
all-reduces over it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rebalancer.wire.layout import trivial_placement
from rebalancer.wire.link import Link
from rebalancer.wire.shape import ClusterShape
from worker_hooks.config import (
    CommitConfig,
    HookConfig,
    MigrationConfig,
    Transport,
    WindowConfig,
)
from worker_hooks.hook import RebalanceHook
from worker_hooks.transports import transport_class

__all__ = [
    "AdapterConfig",
    "ExpertParallelModel",
    "Link",
    "MoEBlock",
    "SlotExperts",
    "attach",
    "find_moe_blocks",
    "graph_moe_blocks",
    "slot_weights",
]

# How a rank computes its local picks: "auto" picks grouped on CUDA (graph-capturable,
# fast) and per-pick on CPU (bit-exact against transformers' batched_mm).
ExpertCompute = Literal["auto", "per_pick", "grouped"]
EXPERT_COMPUTES: tuple[ExpertCompute, ...] = get_args(ExpertCompute)

# The expert weights the adapter reads and the hook migrates, by their transformers names.
WEIGHT_NAMES = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterConfig:
    # The controller (host:port) or the pod's sidecar, the deployment, the worker token;
    # the worker id defaults to the model's class and the rank.
    link: Link
    redundant_slots: int = 0  # P = E + redundant_slots physical slots, P % world == 0
    spare_rows: int = 0  # weight rows per layer and rank beyond its slots (zero-copy commits)
    windows: WindowConfig = field(default_factory=WindowConfig)  # counting into windows
    agree_every: int = 4
    migrate_transport: Transport = "p2p"
    expert_compute: ExpertCompute = "auto"

    def __post_init__(self) -> None:
        if self.redundant_slots < 0 or self.spare_rows < 0:
            raise ValueError(
                f"redundant_slots and spare_rows must be >= 0, got {self.redundant_slots}, "
                f"{self.spare_rows}"
            )
        if self.expert_compute not in EXPERT_COMPUTES:
            raise ValueError(
                f"expert_compute must be one of {', '.join(EXPERT_COMPUTES)}, got "
                f"{self.expert_compute!r}"
            )


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block of the model, in order: `layer` is its index for the hook."""

    layer: int
    name: str  # module path, e.g. "model.layers.3.mlp"
    block: Any  # the family's MoE block (an nn.Module with `gate` and `experts`)
    hash_routed: bool  # DeepSeek-V4's frozen token -> experts table


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The MoE blocks of `model` in module order: modules with a router `gate` and
    `experts` holding 3-D `gate_up_proj` / `down_proj` (stock or already wrapped)."""
    found: list[MoEBlock] = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if getattr(module, "gate", None) is None or not isinstance(experts, nn.Module):
            continue
        weight = getattr(experts, "gate_up_proj", None)
        stock = isinstance(weight, torch.Tensor) and weight.dim() == 3
        if stock or isinstance(experts, SlotExperts):
            found.append(
                MoEBlock(len(found), name, module, bool(getattr(module, "is_hash", False)))
            )
    return found


def slot_weights(
    blocks: list[MoEBlock], phy2log: np.ndarray, rank: int, slots_per_rank: int, spare_rows: int
) -> dict[str, torch.Tensor]:
    """This rank's live weights from the stock experts: name -> `[L, S + R, ...]`, slot s
    of layer l holding expert `phy2log[l, rank * S + s]`; spare rows start zero."""
    out: dict[str, torch.Tensor] = {}
    mine = phy2log[:, rank * slots_per_rank : (rank + 1) * slots_per_rank]
    for name in WEIGHT_NAMES:
        first = getattr(blocks[0].block.experts, name)
        # One allocation, filled layer by layer: no per-layer copies held at once.
        held = first.new_zeros((len(blocks), slots_per_rank + spare_rows) + tuple(first.shape[1:]))
        for b in blocks:
            full = getattr(b.block.experts, name).detach()
            index = torch.as_tensor(mine[b.layer], device=full.device)
            torch.index_select(full, 0, index, out=held[b.layer, :slots_per_rank])
        out[name] = held.requires_grad_(False)
    return out


def _default_gate(module: Any, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [N, in] sorted by group; w [G, in, out]; offs [G] int32 cumulative ends."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w, offs=offs)


class SlotExperts(nn.Module):
    """The experts of one MoE layer on one EP rank, computed from the hook's slot rows.

    Same call as the stock experts: `(hidden [T, H], top_k_index [T, K], top_k_weights
    [T, K]) -> [T, H]`. See the module docstring for the steps."""

    def __init__(
        self,
        stock: Any,
        layer: int,
        route: Callable[[int, torch.Tensor], torch.Tensor],
        weights: dict[str, torch.Tensor],
        rows_per_rank: int,
        rank: int,
        world: int,
        group: dist.ProcessGroup | None,
        compute: ExpertCompute,
    ) -> None:
        super().__init__()
        if getattr(stock, "has_bias", False) or getattr(stock, "is_transposed", False):
            raise ValueError(
                f"{type(stock).__name__}: experts with biases or transposed weights "
                "are not supported"
            )
        self.num_experts = int(stock.num_experts)
        self.layer, self.route, self.weights = layer, route, weights
        self.rows_per_rank, self.rank, self.world, self.group = rows_per_rank, rank, world, group
        self.compute = compute
        self.act_fn = stock.act_fn
        if hasattr(stock, "limit"):  # read by DeepSeek-V4's _apply_gate
            self.limit = stock.limit
        # The family's gate activation, called on this module (it reads act_fn, limit).
        self._family_gate: Callable[[Any, torch.Tensor], torch.Tensor] = getattr(
            type(stock), "_apply_gate", _default_gate
        )

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer}, rank={self.rank}/{self.world}, rows_per_rank={self.rows_per_rank}"
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        rows = self.route(self.layer, top_k_index)
        x, picks = hidden_states, rows
        if self.world > 1:
            x, picks = self._all_gather(hidden_states), self._all_gather(rows)
        grouped = self.compute == "grouped" or (self.compute == "auto" and x.device.type == "cuda")
        per_pick = self._grouped(x, picks) if grouped else self._per_pick(x, picks)
        if self.world > 1:
            dist.all_reduce(per_pick, group=self.group)  # one rank wrote each pick: exact
            per_pick = per_pick.narrow(0, self.rank * num_tokens, num_tokens)
        # The combine of transformers' experts: weight each pick, sum over top-k in order.
        out = (per_pick * top_k_weights.unsqueeze(-1)).sum(dim=1)
        return out.to(hidden_states.dtype)

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts)

    def _local(self, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(is this rank's, row within this rank) of every pick."""
        local = picks - self.rank * self.rows_per_rank
        return (picks >= 0) & (local >= 0) & (local < self.rows_per_rank), local

    def _per_pick(self, x: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        """Per-pick products of this rank's picks `[N, K, H]` (zero elsewhere), exactly
        as transformers' batched_mm experts compute each pick. Eager only (nonzero)."""
        mine, local = self._local(picks)
        n, k = mine.nonzero(as_tuple=True)
        rows = local[n, k]
        w_gate_up = self.weights["gate_up_proj"][self.layer]
        w_down = self.weights["down_proj"][self.layer]
        h = torch.bmm(w_gate_up[rows], x[n].unsqueeze(-1)).squeeze(-1)
        h = self._family_gate(self, h)
        y = torch.bmm(w_down[rows], h.unsqueeze(-1)).squeeze(-1)
        out = x.new_zeros(picks.shape + (x.shape[-1],))
        out[n, k] = y.to(out.dtype)
        return out

    def _grouped(self, x: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        """This rank's picks `[N, K, H]` (zero elsewhere) through grouped products over
        its rows: static shapes, no host sync (CUDA-graph capturable)."""
        num_tokens, top_k = picks.shape
        s = self.rows_per_rank
        mine, local = self._local(picks)
        key = torch.where(mine, local, s).reshape(-1)
        order = torch.argsort(key, stable=True)
        per_row = torch.zeros(s + 1, dtype=torch.int64, device=x.device)
        per_row.index_add_(0, key, torch.ones_like(key))
        offs = torch.cumsum(per_row[:s], 0).to(torch.int32)
        w_gate_up = self.weights["gate_up_proj"][self.layer]
        w_down = self.weights["down_proj"][self.layer]
        xs = x[order // top_k].to(w_gate_up.dtype)
        h = self._family_gate(self, _grouped_mm(xs, w_gate_up.transpose(-2, -1), offs))
        y = _grouped_mm(h.to(w_down.dtype), w_down.transpose(-2, -1), offs)
        # Rows past the last group are not written by the grouped product: mask them.
        y = torch.where(
            (key[order] < s)[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device)
        )
        return torch.empty_like(y).index_copy_(0, order, y).view(num_tokens, top_k, -1).to(x.dtype)


class ExpertParallelModel:
    """A transformers model whose MoE blocks serve through `RebalanceHook` on this rank."""

    def __init__(self, model: nn.Module, hook: RebalanceHook, blocks: list[MoEBlock]) -> None:
        self.model, self.hook, self.blocks = model, hook, blocks

    def start(self) -> None:
        """Start talking to the controller (background agent thread)."""
        self.hook.start()

    def step_end(self) -> None:
        """Once per forward step on every rank: windows out, agreed plans committed."""
        self.hook.step_end()

    def finish(self, timeout: float = 5.0, transfer_timeout: float = 30.0) -> bool:
        return self.hook.finish(timeout, transfer_timeout)

    @property
    def version(self) -> int:
        return self.hook.version


def attach(
    model: nn.Module,
    config: AdapterConfig,
    agree_group: dist.ProcessGroup | None = None,
    migrate_group: dist.ProcessGroup | None = None,
    ep_group: dist.ProcessGroup | None = None,
) -> ExpertParallelModel:
    """Replace every MoE block's experts of `model` with this rank's `SlotExperts`.

    Rank and world come from torch.distributed (which must be initialized); every rank
    calls this with the same model (same weights) and config. New groups are made for
    the commit agreement (gloo) and the migrations (the transport's backend) unless
    given; the token exchange uses `ep_group` (default: the world). The stock experts'
    `[E, ...]` weights are dropped: this rank keeps only the slots it holds.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("attach needs torch.distributed initialized (a world of one is fine)")
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no MoE block (a `gate` and 3-D `experts` weights)"
        )
    if any(isinstance(b.block.experts, SlotExperts) for b in blocks):
        raise ValueError("model is already attached")
    num_experts = {int(b.block.experts.num_experts) for b in blocks}
    if len(num_experts) != 1:
        raise ValueError(f"MoE blocks differ in their number of experts: {sorted(num_experts)}")
    (num_logical,) = num_experts
    rank, world = dist.get_rank(), dist.get_world_size()
    num_slots = num_logical + config.redundant_slots
    if num_slots % world:
        raise ValueError(f"{num_slots} slots (experts + redundant) do not split over {world} ranks")
    per_rank = num_slots // world
    first = blocks[0].block.experts.gate_up_proj
    device = first.device
    phy2log = trivial_placement(len(blocks), num_logical, num_slots, world)
    weights = slot_weights(blocks, phy2log, rank, per_rank, config.spare_rows)
    expert_bytes = sum(int(np.prod(w.shape[2:])) for w in weights.values()) * first.element_size()
    if agree_group is None:
        agree_group = dist.new_group(backend="gloo")
    if migrate_group is None:
        migrate_group = dist.new_group(
            backend=transport_class(config.migrate_transport).group_backend(device)
        )
    hook = RebalanceHook(
        HookConfig(
            link=replace(
                config.link,
                worker_id=config.link.worker_id
                or f"transformers-{type(model).__name__}-rank{rank}",
            ),
            rank=rank,
            shape=ClusterShape(
                num_layers=len(blocks),
                num_logical=num_logical,
                num_slots=num_slots,
                num_gpus=world,
                expert_bytes=expert_bytes,
            ),
            windows=config.windows,
            commit=CommitConfig(agree_every=config.agree_every, spare_rows=config.spare_rows),
            migration=MigrationConfig(transport=config.migrate_transport),
        ),
        phy2log,
        weights,
        agree_group,
        migrate_group,
        device=device,
    )
    for b in blocks:
        stock = b.block.experts
        b.block.experts = SlotExperts(
            stock,
            b.layer,
            hook.route,
            hook.weights,
            hook.config.rows_per_rank,
            rank,
            world,
            ep_group,
            config.expert_compute,
        )
        for name in WEIGHT_NAMES:  # free the [E, ...] weights even if something holds the module
            setattr(stock, name, None)
    return ExpertParallelModel(model, hook, blocks)


class _GraphedBlock(nn.Module):
    """A MoE block replayed from a CUDA graph captured on static input buffers.

    Tensor arguments are copied into the buffers, the graph replays, and the output
    buffer is returned (valid until the next replay of this block)."""

    def __init__(self, block: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.block = block
        self.static_hidden = hidden.clone()
        self.static_kwargs = {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
        }
        side = torch.cuda.Stream(hidden.device)
        side.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):  # warm up outside the capture (allocator, kernels' setup)
                block(self.static_hidden, **self.static_kwargs)
        torch.cuda.current_stream(hidden.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.static_out = block(self.static_hidden, **self.static_kwargs)

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.static_hidden.copy_(hidden_states)
        for k, v in kwargs.items():
            static = self.static_kwargs.get(k)
            if isinstance(static, torch.Tensor) and isinstance(v, torch.Tensor):
                static.copy_(v)
        self.graph.replay()
        return self.static_out


def graph_moe_blocks(
    model: nn.Module, example: Callable[[MoEBlock], tuple[torch.Tensor, dict[str, Any]]]
) -> list[MoEBlock]:
    """Capture every MoE block of `model` (CUDA) in a graph of its own and make the
    decoder layers replay it. `example(block)` gives the block's (hidden_states, kwargs)
    of the static shape served. Map swaps and migrations write the tensors the graphs
    read in place, so the graphs stay valid across rebalances."""
    blocks = find_moe_blocks(model)
    for b in blocks:
        experts = b.block.experts
        if isinstance(experts, SlotExperts):
            w = experts.weights[WEIGHT_NAMES[0]]
            if w.device.type != "cuda" or w.dtype != torch.bfloat16:
                # torch runs grouped products of other dtypes through a host-side loop over
                # the groups (it reads the offsets on the host): not capturable.
                raise ValueError(
                    "graph_moe_blocks needs bfloat16 expert weights on a CUDA device, got "
                    f"{w.dtype} on {w.device}"
                )
    names = dict(model.named_modules())
    for b in blocks:
        parent_name, _, attr = b.name.rpartition(".")
        parent = names[parent_name] if parent_name else model
        hidden, kwargs = example(b)
        setattr(parent, attr, _GraphedBlock(b.block, hidden, kwargs))
    return blocks
