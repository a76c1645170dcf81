"""The dispatch modes both sides of the link name, and the water-fill's fixed settings.

A rank dispatches each (token, expert) pick to one replica; how it picks is the
deployment's dispatch mode. The worker (worker_hooks/waterfill.py, torch, inside CUDA
graphs) and the placement math (rebalancer/placement/metrics.py, numpy, for the
controller and the simulator) run the same water-fill; its settings live here once so
that the two cannot drift apart.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Literal, get_args

import numpy as np

from rebalancer.errors import InputError

# split: the even hash split among an expert's replicas (local ones first), whatever
#   the batch looks like (worker_hooks.dispatch.ReplicaDispatch.dispatch);
# load: each step, an expert's tokens are divided among its replicas by water-filling
#   against this batch's per-GPU load (needs every rank's per-expert counts of the step);
# load+shared: as load, with the shared expert as one more expert that has a replica on
#   every GPU (a token's shared work stays local unless its GPU is the busy one).
DispatchMode = Literal["split", "load", "load+shared"]
DISPATCH_MODES: tuple[DispatchMode, ...] = get_args(DispatchMode)
DEFAULT_DISPATCH_MODE: DispatchMode = "split"

# The water-fill runs in integers: a token is `WATERFILL_UNITS` units (fixed point), so
# every step of it (sums, sort, floor divisions) is exact, whatever the summation order.
# The workers' torch and the placement math's numpy therefore give the same allocation
# bit for bit, and every rank of the group the same one on any device. Range: a layer's
# picks of a step are below 2^24 (32 GPUs x 16,384 tokens x 9 picks is 2^22.2), so units
# stay below 2^34 and `WATERFILL_FAR` (the level of a GPU that lacks the expert) plus a
# cumulative sum over 2^10 GPUs below 2^61: int64 never overflows.
WATERFILL_UNITS = 1 << 10
WATERFILL_FAR = 1 << 50
# Rows of `waterfill_tables`: held, far, spread, total, tail.
WATERFILL_TABLES = 5

# Water-filling passes per layer and step: a fixed number (graph-safe, no host sync);
# the knob is `HookConfig.dispatch.waterfill_passes` / `StepConfig.waterfill_passes`. Each pass
# moves every expert's split `WATERFILL_DAMPING` of the way to its own water level
# against the other experts' loads, in 14 kernels. On DeepSeek-V3 routing (simulator,
# adaptive placement, EP32) load+shared gains over split at 64 / 4,096 tokens per GPU:
# 2 passes +5.6 / +3.3 %, 4 passes +7.2 / +4.4 %, 8 passes +8.5 / +5.1 %: 4 keeps most of
# it at half the kernels. The result is kept only if its peak GPU load is below the
# start's (the hash split's expectation), so it is never worse than split.
WATERFILL_PASSES = 4
MAX_WATERFILL_PASSES = 32
WATERFILL_DAMPING = Fraction(5, 16)


def check_waterfill_passes(passes: object) -> int:
    """`passes` as a pass count in [1, MAX_WATERFILL_PASSES], or an InputError."""
    if (
        not isinstance(passes, int)
        or isinstance(passes, bool)
        or not 1 <= passes <= MAX_WATERFILL_PASSES
    ):
        raise InputError(
            f"waterfill passes must be an integer in [1, {MAX_WATERFILL_PASSES}], got {passes!r}"
        )
    return passes


def waterfill_tables(replicas: np.ndarray) -> np.ndarray:
    """The static per-placement tables of the water-fill, computed once per placement.

    replicas: [..., X, G] int64 replicas of each expert on each GPU. Returns
    [..., WATERFILL_TABLES, X, G] int64, in this order: `held` (1 where the GPU holds the
    expert), `far` (0 where held, WATERFILL_FAR where not: such a GPU sorts last and
    never fills), `spread` (replicas * WATERFILL_UNITS) and `total` (the expert's
    replicas on all GPUs, >= 1, repeated along G): the hash split sends a GPU
    remote * spread // total units of an expert's remote tokens; `tail` (1 from the
    expert's last GPU on: where rounding leaves the remainder).
    """
    reps = np.asarray(replicas, dtype=np.int64)
    held = reps > 0
    total = np.broadcast_to(np.maximum(reps.sum(axis=-1, keepdims=True), 1), reps.shape)
    num_gpus = reps.shape[-1]
    last = num_gpus - 1 - np.argmax(held[..., ::-1], axis=-1)
    tail = np.arange(num_gpus) >= last[..., None]
    far = np.where(held, 0, WATERFILL_FAR)
    spread = reps * WATERFILL_UNITS
    return np.stack([held.astype(np.int64), far, spread, total, tail.astype(np.int64)], axis=-3)


def check_dispatch_mode(mode: object, what: str = "dispatch mode") -> DispatchMode:
    """`mode` as a DispatchMode, or an InputError naming the choices."""
    if mode not in DISPATCH_MODES:
        raise InputError(f"unknown {what} {mode!r}; expected one of {', '.join(DISPATCH_MODES)}")
    return mode  # type: ignore[return-value]


def has_shared_replicas(mode: DispatchMode) -> bool:
    """Whether the shared expert is dispatched like a routed expert (a replica per GPU)."""
    return mode == "load+shared"
