"""A small reference MoE block for measuring the worker hooks on a GPU.

An example of what an engine runs, not part of the product: the GPU benches and tests
drive `worker_hooks` through it.

It is the minimum that behaves like one expert-parallel rank of a DeepSeek-V3-style
model: a router, the recorder and replica dispatch hooks, and SwiGLU expert MLPs for
the physical slots this rank holds, run as grouped matrix products over tokens sorted
by slot. Everything in `forward` has static shapes, so the whole multi-layer block can
be captured in one CUDA graph and replayed; expert weights are `[L, S + R, ...]` tensors
(S = slots on this rank, R spare rows, worker_hooks/rows.py), the layout the migration
executor moves; with spare rows, dispatch hands out row ids.

The expert output is combined per (token, top-k column) first and summed over top-k
in a fixed order, so a token's output does not depend on which slot or rank computed
it: the same input gives the same bits before and after a rebalance (invariant 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.record import ExpertRecorder

__all__ = ["MoEBlockConfig", "ReferenceMoEBlock", "expert_weights"]


@dataclass
class MoEBlockConfig:
    """Shapes of the block; the defaults are one DeepSeek-V3 MoE layer."""

    hidden: int = 7168
    intermediate: int = 2048
    num_experts: int = 256
    top_k: int = 8
    num_layers: int = 1
    num_gpus: int = 1
    rank: int = 0
    num_redundant: int = 0
    spare_rows: int = 0
    dtype: torch.dtype = field(default=torch.bfloat16)

    @property
    def num_physical(self) -> int:
        return self.num_experts + self.num_redundant

    @property
    def slots_per_gpu(self) -> int:
        if self.num_physical % self.num_gpus:
            raise ValueError(f"P={self.num_physical} is not a multiple of G={self.num_gpus}")
        return self.num_physical // self.num_gpus

    @property
    def rows_per_gpu(self) -> int:
        """Weight rows per layer on a rank: its slots plus the spare rows."""
        return self.slots_per_gpu + self.spare_rows

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (w13 + w2)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 3 * self.hidden * self.intermediate * elem


def expert_weights(
    cfg: MoEBlockConfig, layer: int, expert: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of one logical expert, a pure function of (layer, expert).

    Any rank can rebuild them, which lets a test check that migrated slots hold the
    right bytes. Returns w13 `[2I, H]` and w2 `[H, I]` (nn.Linear layout).
    """
    gen = torch.Generator(device=device).manual_seed(1_000_003 * layer + expert)
    scale = cfg.hidden**-0.5
    w13 = torch.randn(
        2 * cfg.intermediate, cfg.hidden, generator=gen, device=device, dtype=torch.float32
    )
    w2 = torch.randn(
        cfg.hidden, cfg.intermediate, generator=gen, device=device, dtype=torch.float32
    )
    return (w13 * scale).to(cfg.dtype), (w2 * cfg.intermediate**-0.5).to(cfg.dtype)


class ReferenceMoEBlock:
    """L MoE layers of one EP rank: router, hooks, grouped expert MLPs, residual.

    Args:
        cfg: shapes.
        phy2log: `[L, P]` the placement the weights are filled from.
        dispatch: logical -> physical ids; None means P == E and slot = expert. Every
            rank holds all tokens (replicated input, partial outputs all-reduced), but
            token chunk r (of G contiguous chunks) originates on rank r, so with G > 1
            pass G dispatchers, the one of rank r routing chunk r; every rank then
            agrees on each pick's slot.
        recorder: counts of this rank's own chunk (logical and, if it has P, physical).
        group: the EP process group for the all-reduce of partial outputs (G > 1).
        weights: share another block's expert weights instead of building them.
    """

    def __init__(
        self,
        cfg: MoEBlockConfig,
        phy2log: torch.Tensor,
        device: torch.device,
        dispatch: ReplicaDispatch | Sequence[ReplicaDispatch] | None = None,
        recorder: ExpertRecorder | None = None,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = device
        if isinstance(dispatch, ReplicaDispatch):
            dispatch = [dispatch]
        self.dispatchers: list[ReplicaDispatch] = list(dispatch or [])
        if len(self.dispatchers) not in (0, 1, cfg.num_gpus):
            raise ValueError(f"need 1 or G={cfg.num_gpus} dispatchers, got {len(self.dispatchers)}")
        self.recorder = recorder
        self.group = group
        if not self.dispatchers and cfg.num_physical != cfg.num_experts:
            raise ValueError("without a ReplicaDispatch the block needs P == E")
        gen = torch.Generator(device=device).manual_seed(seed)
        self.gate = (
            torch.randn(cfg.num_layers, cfg.num_experts, cfg.hidden, generator=gen, device=device)
            * cfg.hidden**-0.5
        ).to(cfg.dtype)
        s = cfg.rows_per_gpu
        if weights is not None:
            self.weights = weights
            return
        self.weights = {  # spare rows start zero: no map points to them
            "w13": torch.zeros(
                cfg.num_layers, s, 2 * cfg.intermediate, cfg.hidden, dtype=cfg.dtype, device=device
            ),
            "w2": torch.zeros(
                cfg.num_layers, s, cfg.hidden, cfg.intermediate, dtype=cfg.dtype, device=device
            ),
        }
        self.fill_from(phy2log)

    def fill_from(self, phy2log: torch.Tensor) -> None:
        """Write every local slot's weights from the placement (setup, not hot path)."""
        cfg = self.cfg
        s = cfg.slots_per_gpu
        cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(cfg.num_layers):
            for local in range(s):
                expert = int(phy2log[layer, cfg.rank * s + local])
                key = (layer, expert)
                if key not in cache:
                    cache = {key: expert_weights(cfg, layer, expert, self.device)}
                w13, w2 = cache[key]
                self.weights["w13"][layer, local].copy_(w13)
                self.weights["w2"][layer, local].copy_(w2)

    def route(self, layer: int, x: torch.Tensor, forced_ids: torch.Tensor | None):
        """Top-k experts and their weights; `forced_ids` replays a recorded routing."""
        logits = (x @ self.gate[layer].T).float()
        if forced_ids is None:
            weight, ids = torch.topk(logits.softmax(-1), self.cfg.top_k, dim=-1)
        else:
            ids = forced_ids
            weight = torch.gather(logits.softmax(-1), 1, ids.clamp(min=0))
        weight = weight / weight.sum(-1, keepdim=True)
        return ids, weight

    def own_chunk(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of `t` that originate on this rank."""
        if self.cfg.num_gpus == 1:
            return t
        return t.tensor_split(self.cfg.num_gpus)[self.cfg.rank]

    def dispatch(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Physical slots of every pick, each chunk routed by its source rank's map."""
        if not self.dispatchers:
            return ids
        if len(self.dispatchers) == 1:
            return self.dispatchers[0].dispatch(layer, ids)
        chunks = ids.tensor_split(len(self.dispatchers))
        return torch.cat(
            [d.dispatch(layer, c) for d, c in zip(self.dispatchers, chunks, strict=True)]
        )

    def experts(self, layer: int, x: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
        """Expert outputs of this rank's rows per pick, `[T, K, H]` (zero for remote)."""
        cfg = self.cfg
        num_tokens, top_k = phys.shape
        s = cfg.rows_per_gpu
        local = phys - cfg.rank * s
        is_local = (phys >= 0) & (local >= 0) & (local < s)
        key = torch.where(is_local, local, s).reshape(-1)
        order = torch.argsort(key, stable=True)
        per_slot = torch.zeros(s + 1, dtype=torch.int64, device=x.device)
        per_slot.index_add_(0, key, torch.ones_like(key))
        offs = torch.cumsum(per_slot[:s], 0).to(torch.int32)
        rows = x[order // top_k]
        w13 = self.weights["w13"][layer]
        w2 = self.weights["w2"][layer]
        if x.device.type == "cuda":
            h = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
        else:
            # CPU BLAS picks kernels by group size, so a row's rounding would depend
            # on how many rows share its expert; one small product per row does not.
            slot = key[order].clamp(max=s - 1)
            h = torch.bmm(w13[slot], rows[:, :, None])[..., 0]
            gate, up = h.chunk(2, dim=-1)
            out = torch.bmm(w2[slot], (F.silu(gate) * up)[:, :, None])[..., 0]
        # Rows past the last group are not written by the grouped product: mask them.
        zero = torch.zeros((), dtype=out.dtype, device=out.device)
        out = torch.where((key[order] < s)[:, None], out, zero)
        return torch.empty_like(out).index_copy_(0, order, out).view(num_tokens, top_k, -1)

    def forward(
        self, x: torch.Tensor, forced_ids: torch.Tensor | None = None, exact: bool = False
    ) -> torch.Tensor:
        """x `[T, H]`; forced_ids `[L, T, K]` or None. Returns the block output `[T, H]`.

        With several ranks, `exact` all-reduces per-pick outputs (each pick is non-zero
        on exactly one rank, so the sum is exact and placement-independent) instead of
        per-rank partial sums (K times less traffic, rounding depends on placement).
        """
        multi = self.group is not None and self.cfg.num_gpus > 1
        for layer in range(self.cfg.num_layers):
            ids, weight = self.route(layer, x, None if forced_ids is None else forced_ids[layer])
            phys = self.dispatch(layer, ids)
            if self.recorder is not None:
                self.recorder.record(layer, self.own_chunk(ids))
                if self.recorder.num_physical is not None:
                    self.recorder.record_physical(layer, self.own_chunk(phys))
            per_pick = self.experts(layer, x, phys)
            if multi and exact:
                dist.all_reduce(per_pick, group=self.group)
            partial = (per_pick.float() * weight[..., None]).sum(dim=1)
            if multi and not exact:
                dist.all_reduce(partial, group=self.group)
            x = (x.float() + partial).to(self.cfg.dtype)
        return x
