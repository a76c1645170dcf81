"""A small fp32 MoE layer for CPU: the reference for invariant 1 ("same math").

An example of what an engine runs, not part of the product: the demo's workers
(worker_hooks/examples/cpu_worker.py) and the CPU tests serve it through `worker_hooks`.

Expert weights are a pure function of (seed, layer, expert), so every rank can
build the slots it holds and a single-process reference can build all logical
experts, and both compute each (token, expert) pair with the same function on
the same shapes. `ReferenceMoE` is the layer with every expert in one process;
`ExpertParallelMoE` is the same layer spread over an EP group, each rank computing
the picks routed to the rows it holds on its live (migrating) weights. A rebalanced
EP group must therefore reproduce the reference's output bit for bit, however its
slots moved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class MoEConfig:
    num_layers: int = 8
    num_experts: int = 32
    top_k: int = 4
    hidden: int = 32
    ffn: int = 64
    seed: int = 1234
    # A shared expert every token goes through (DeepSeek-V3/V4), the size of a routed one;
    # its weights are expert_weights(config, layer, num_experts). Off: none.
    shared_expert: bool = False

    @property
    def expert_bytes(self) -> int:
        return 2 * self.hidden * self.ffn * 4  # w1 + w2, fp32


def expert_weights(config: MoEConfig, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [H, F], w2 [F, H]) of one logical expert, deterministic."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + layer * 10_007 + expert)
    w1 = torch.randn(config.hidden, config.ffn, generator=gen) / config.hidden**0.5
    w2 = torch.randn(config.ffn, config.hidden, generator=gen) / config.ffn**0.5
    return w1, w2


def slot_weights(config: MoEConfig, phy2log: np.ndarray, slots: range) -> dict[str, torch.Tensor]:
    """Live weights of the given physical slots: w1 [L, S, H, F], w2 [L, S, F, H]."""
    L, S = config.num_layers, len(slots)
    w1 = torch.empty(L, S, config.hidden, config.ffn)
    w2 = torch.empty(L, S, config.ffn, config.hidden)
    for layer in range(L):
        for i, slot in enumerate(slots):
            w1[layer, i], w2[layer, i] = expert_weights(config, layer, int(phy2log[layer, slot]))
    return {"w1": w1, "w2": w2}


def expert_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert MLP per row: x [N, H], w1 [N, H, F], w2 [N, F, H] -> [N, H].

    Each row is its own small matmul, so a row's result does not depend on
    which other rows share the batch."""
    h = F.silu(torch.bmm(x.unsqueeze(1), w1))
    return torch.bmm(h, w2).squeeze(1)


def combine(y: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Weighted sum over top-k in a fixed order: y [T, K, H], gates [T, K] -> [T, H]."""
    return (y * gates.unsqueeze(-1)).sum(dim=1)


def with_shared(routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """The layer's output: routed combine plus the shared expert's output (one order)."""
    return routed if shared is None else routed + shared


class ReferenceMoE:
    """All logical experts in one process: the unbalanced reference model."""

    def __init__(self, config: MoEConfig) -> None:
        self.config = config
        self.w1 = torch.empty(config.num_layers, config.num_experts, config.hidden, config.ffn)
        self.w2 = torch.empty(config.num_layers, config.num_experts, config.ffn, config.hidden)
        for layer in range(config.num_layers):
            for e in range(config.num_experts):
                self.w1[layer, e], self.w2[layer, e] = expert_weights(config, layer, e)
        self.shared = shared_weights(config)

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, gates: torch.Tensor
    ) -> torch.Tensor:
        T, K = topk_ids.shape
        ids = topk_ids.reshape(-1)
        y = expert_forward(x.repeat_interleave(K, dim=0), self.w1[layer, ids], self.w2[layer, ids])
        shared = None
        if self.shared is not None:
            shared = expert_forward(x, *shared_rows(self.shared, layer, T))
        return with_shared(combine(y.view(T, K, -1), gates), shared)


def shared_rows(
    shared: tuple[torch.Tensor, torch.Tensor], layer: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert's weights once per row, materialised like a routed expert's
    gathered weights, so each row runs the same per-row matmul wherever it is computed."""
    w1, w2 = shared
    return w1[layer].expand(rows, -1, -1).contiguous(), w2[layer].expand(rows, -1, -1).contiguous()


def shared_weights(config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared expert of every layer (w1 [L, H, F], w2 [L, F, H]), or None without one."""
    if not config.shared_expert:
        return None
    pairs = [
        expert_weights(config, layer, config.num_experts) for layer in range(config.num_layers)
    ]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


class ExpertParallelMoE:
    """The layer of `ReferenceMoE` on one rank of an EP group of `world` ranks.

    Args:
        route: `(layer, topk_ids) -> row ids` (`RebalanceHook.route`: records the routing
            and picks each expert's replica; row ids are slot ids without spare rows).
        weights: this rank's live weights, w1 `[L, S + R, H, F]` and w2 `[L, S + R, F, H]`,
            on `device` (read at every forward: migration may move rows between calls).
        rows_per_rank: S + R.
        exchange: all-gather the tokens and all-reduce the outputs over the default group
            (False: serve alone with the experts held here, when peers may die).
        shared: the shared expert's weights (`shared_weights`), every rank holding them;
            `route` then returns one more column, `world * rows_per_rank + gpu`: where
            each token's shared expert is computed.
    """

    def __init__(
        self,
        route: Callable[[int, torch.Tensor], torch.Tensor],
        weights: dict[str, torch.Tensor],
        rows_per_rank: int,
        rank: int,
        world: int,
        device: torch.device,
        exchange: bool = True,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.route, self.weights, self.rows_per_rank = route, weights, rows_per_rank
        self.rank, self.world, self.device, self.exchange = rank, world, device, exchange
        self.shared = shared
        # Per layer, the tokens of this rank's expert compute (routed, shared) of the
        # last forward: what the GPU computed, to check against the recorded counts.
        self.computed: dict[int, tuple[int, int]] = {}

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, gates: torch.Tensor
    ) -> torch.Tensor:
        """This rank's tokens x [T, H] (on CPU) -> [T, H]."""
        phys = self.route(layer, topk_ids.to(self.device)).cpu()
        rank, S = self.rank, self.rows_per_rank
        if self.exchange:
            # One all-gather carries tokens and their rows (row ids are exact in fp32).
            packed = torch.cat([x, phys.to(x.dtype)], dim=1)
            parts = [torch.empty_like(packed) for _ in range(self.world)]
            dist.all_gather(parts, packed)
            gathered = torch.cat(parts)
            X, PH = gathered[:, : x.shape[1]], gathered[:, x.shape[1] :].to(phys.dtype)
        else:
            X, PH = x, phys
        K = gates.shape[1]
        routed = PH[:, :K]
        mine = (routed // S) == rank
        n, k = mine.nonzero(as_tuple=True)
        local = (routed[n, k] - rank * S).to(self.device)
        Y = torch.zeros(X.shape[0], K + (1 if self.shared is not None else 0), X.shape[1])
        Y[n, k] = expert_forward(
            X[n], self.weights["w1"][layer, local].cpu(), self.weights["w2"][layer, local].cpu()
        )
        shared_here = 0
        if self.shared is not None:
            # The shared expert's output rides in an extra column of Y: one all-reduce.
            ts = (PH[:, K] - self.world * S == rank).nonzero(as_tuple=True)[0]
            n_s = int(ts.numel())
            Y[ts, K] = expert_forward(X[ts], *shared_rows(self.shared, layer, n_s))
            shared_here = n_s
        self.computed[layer] = (int(n.numel()), shared_here)
        if self.exchange:
            dist.all_reduce(Y)  # each (token, k) is non-zero on exactly one rank: the sum is exact
            T = x.shape[0]
            Y = Y[rank * T : (rank + 1) * T]
        if self.shared is None:
            return combine(Y, gates)
        return with_shared(combine(Y[:, :K], gates), Y[:, K])
