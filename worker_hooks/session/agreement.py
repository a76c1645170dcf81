"""What every rank of a group must hold alike before any rank acts: a version (the MIN
over the ranks, the newest all can switch to) and a plan (its digest, equal on every
rank). Blocking collectives on a small CPU group of the caller's, for the adapters whose
engine gives them one point to decide at (vLLM's policy call); the project's hook and the
SGLang adapter agree without waiting, every few steps (worker_hooks/agree.py).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.distributed as dist

NO_PLAN = 0  # the digest a rank contributes when it has no plan to switch to


def plan_digest(version: int, phy2log: np.ndarray) -> int:
    """A positive 63-bit digest of (version, map `[L, P]`): equal on two ranks iff the plans are."""
    digest = hashlib.blake2b(
        np.ascontiguousarray(phy2log, dtype=np.int64).tobytes(),
        digest_size=8,
        person=b"rebalancer-plan",
        salt=version.to_bytes(8, "little", signed=False),
    ).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


def all_reduce_min(
    values: list[int], group: dist.ProcessGroup | None, device: torch.device | None = None
) -> list[int]:
    """The element-wise MIN of `values` over the ranks of `group` (collective; `device`:
    where the group's backend takes its tensors, the host by default)."""
    buf = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in buf.tolist()]


def held_everywhere(digest: int, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of `group` contributed this same `digest`, not NO_PLAN
    (collective: MIN of (d, -d) gives the smallest and the largest at once)."""
    low, neg_high = all_reduce_min([digest, -digest], group)
    return low != NO_PLAN and low == -neg_high
