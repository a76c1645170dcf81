"""Token exchange through DeepEP, addressed by our physical slot ids.

DeepEP sends each token to the ranks that hold its top-k "experts", numbered
0..num_experts-1 with num_experts / G consecutive ids per rank. Physical slots are laid
out the same way (slot s lives on rank s // (P / G)), so handing DeepEP the slot ids
from `ReplicaDispatch` with `num_experts = P` makes it deliver every token to the rank
of the replica the map chose, and a map swap redirects tokens with no change on the
DeepEP side. On the receiving rank DeepEP reports local slot indices (-1 for picks
held elsewhere) and the token count per local slot: a second, independent count
source for `ExpertRecorder` (see `record_received`).

`deep_ep` is an optional GPU extra built from source, so it is imported only when an
exchange is created, never when this module is imported.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from worker_hooks.record import ExpertRecorder

__all__ = [
    "DeepEPConfig",
    "DispatchedTokens",
    "SlotExchange",
    "expected_receive_counts",
    "global_slots",
    "load_deep_ep",
    "to_deepep_topk",
]


def load_deep_ep() -> ModuleType:
    """Import `deep_ep`, or say how to get it."""
    try:
        return importlib.import_module("deep_ep")
    except ImportError as exc:
        raise ImportError(
            "deep_ep is not installed: build DeepEP from source on the GPU host "
            "(the optional 'gpu' extra) to use worker_hooks.deepep"
        ) from exc


@dataclass
class DeepEPConfig:
    """What the exchange needs to know about the deployment."""

    num_physical: int
    num_gpus: int
    num_nvl_bytes: int = 1 << 30
    num_sms: int | None = None

    @property
    def slots_per_gpu(self) -> int:
        if self.num_physical % self.num_gpus:
            raise ValueError(f"P={self.num_physical} is not a multiple of G={self.num_gpus}")
        return self.num_physical // self.num_gpus


def to_deepep_topk(
    phys_ids: torch.Tensor, num_physical: int, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Slot ids `[T, K]` as DeepEP's `topk_idx` (-1 kept), checked to be in range.

    The check reads the tensor on the host: call it on the eager path only.
    """
    if phys_ids.dim() != 2:
        raise ValueError(f"slot ids must be [tokens, top_k], got shape {tuple(phys_ids.shape)}")
    if phys_ids.dtype.is_floating_point or phys_ids.dtype == torch.bool:
        raise TypeError(f"slot ids must be integers, got {phys_ids.dtype}")
    if phys_ids.numel():
        low, high = int(phys_ids.min()), int(phys_ids.max())
        if low < -1 or high >= num_physical:
            raise ValueError(f"slot ids must be -1 or in [0, {num_physical}), got [{low}, {high}]")
    return phys_ids.to(dtype).contiguous()


def global_slots(recv_local: torch.Tensor, rank: int, slots_per_gpu: int) -> torch.Tensor:
    """DeepEP's received local indices back to physical slot ids (-1 stays -1)."""
    return torch.where(recv_local >= 0, recv_local.to(torch.int64) + rank * slots_per_gpu, -1)


def expected_receive_counts(
    phys_ids_per_rank: list[np.ndarray], rank: int, slots_per_gpu: int
) -> np.ndarray:
    """Picks each local slot of `rank` gets from all source ranks (for checks)."""
    lo = rank * slots_per_gpu
    counts = np.zeros(slots_per_gpu, dtype=np.int64)
    for ids in phys_ids_per_rank:
        flat = np.asarray(ids).reshape(-1)
        local = flat[(flat >= lo) & (flat < lo + slots_per_gpu)] - lo
        counts += np.bincount(local, minlength=slots_per_gpu)
    return counts


@dataclass
class DispatchedTokens:
    """What one rank received: tokens, their picks as physical slots, and counts."""

    x: torch.Tensor  # [N, H] tokens received (each once, however many local picks)
    slots: torch.Tensor  # [N, K] physical slot ids on this rank, -1 = held elsewhere
    weights: torch.Tensor  # [N, K] routing weights
    per_slot: list[int]  # [P / G] picks received per local slot (DeepEP's count)
    sent_per_slot: torch.Tensor  # [P] picks this rank sent to each slot (layout count)
    handle: Any  # DeepEP's handle, needed by combine


class SlotExchange:
    """DeepEP dispatch/combine for one EP group, with physical slots as experts."""

    def __init__(self, group: torch.distributed.ProcessGroup, cfg: DeepEPConfig) -> None:
        deep_ep = load_deep_ep()
        self.cfg = cfg
        self.rank = torch.distributed.get_rank(group)
        if torch.distributed.get_world_size(group) != cfg.num_gpus:
            raise ValueError(
                f"group has {torch.distributed.get_world_size(group)} ranks, config {cfg.num_gpus}"
            )
        if cfg.num_sms is not None:
            deep_ep.Buffer.set_num_sms(cfg.num_sms)
        self.buffer = deep_ep.Buffer(group, cfg.num_nvl_bytes, 0)
        self.topk_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)

    def dispatch(
        self, x: torch.Tensor, phys_ids: torch.Tensor, weights: torch.Tensor
    ) -> DispatchedTokens:
        topk = to_deepep_topk(phys_ids, self.cfg.num_physical, self.topk_dtype)
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk, self.cfg.num_physical
        )
        recv_x, recv_idx, recv_w, per_slot, handle, _ = self.buffer.dispatch(
            x,
            topk_idx=topk,
            topk_weights=weights.float(),
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        slots = global_slots(recv_idx, self.rank, self.cfg.slots_per_gpu)
        return DispatchedTokens(recv_x, slots, recv_w, list(per_slot), per_expert, handle)

    def combine(self, y: torch.Tensor, received: DispatchedTokens) -> torch.Tensor:
        """Sum each token's expert outputs back on its source rank."""
        out, _, _ = self.buffer.combine(y, received.handle)
        return out

    def record_received(
        self, recorder: ExpertRecorder, layer: int, received: DispatchedTokens
    ) -> None:
        """Add DeepEP's per-slot receive counts to the recorder's physical counts."""
        counts = torch.tensor(received.per_slot, dtype=torch.int64, device=recorder.device)
        recorder.add_physical_counts(layer, self.rank * self.cfg.slots_per_gpu, counts)
