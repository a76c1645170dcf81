"""Warm start: the pool placement a fresh rank group is offered, taken by all ranks or none.

The controller offers a member of a replica pool the pool's placement when it registers
fresh (proto: RegisterResponse.warm_start, or ControllerMessage.warm_start through a
sidecar), as plan version W. One home for the two steps every integration shares (the
project's hooks, the SGLang and vLLM adapters):

* `await_offer`: wait a bounded time for the offer the rank's agent received and decode
  it against the rank's shape; no offer, no controller, a bad map: (0, None), never
  longer than the bound;
* `group_holds`: all-reduce MIN of (W, -W) over the rank group: every rank installs only
  when all offered versions are equal and above 0 (a rank without the offer contributes
  0, so none installs).

What installing means is the integration's own (load weights, hand SGLang its initial
expert location, answer vLLM's first policy call); then it reports
PLAN_PHASE_COMMITTED for W, which the controller adopts.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.errors import InputError
from rebalancer.wire import codec
from worker_hooks.agent import WorkerAgent

log = logging.getLogger("worker_hooks.warm")

# Seconds a pool member waits at start for the controller's offer (HookConfig and the
# adapters' REBALANCER_WARM_START_SECONDS): a Register round trip through a sidecar with
# room for a loaded controller, short enough that an unreachable one costs little.
DEFAULT_WARM_START_SECONDS = 3.0


def check_warm_start_seconds(seconds: float, name: str) -> None:
    """InputError (a ValueError) naming the setting unless 0 <= seconds < inf (0: never wait)."""
    if not 0.0 <= seconds < float("inf"):
        raise InputError(f"{name} must be >= 0 and finite, got {seconds}")


def await_offer(
    agent: WorkerAgent, seconds: float, num_layers: int, num_slots: int, num_logical: int, rank: int
) -> tuple[int, np.ndarray | None]:
    """(W, the `[L, P]` map) of the warm start the agent holds or receives within
    `seconds`, or (0, None): none in time, or one that does not fit this rank's shape
    (logged)."""
    if not agent.warm_offered.is_set() and (seconds <= 0 or not agent.warm_offered.wait(seconds)):
        return 0, None
    offer = agent.warm_start
    if offer is None:
        return 0, None
    try:
        phy2log = codec.decode_phy2log(offer.phy2log, num_layers, num_slots, num_logical)
    except InputError as exc:
        log.error("rank %d: warm start v%d refused: %s", rank, offer.version, exc)
        return 0, None
    return int(offer.version), np.asarray(phy2log, dtype=np.int64)


def group_holds(version: int, group: dist.ProcessGroup | None, num_ranks: int, rank: int) -> bool:
    """Whether every rank of `group` holds `version` (> 0). Collective: every rank of the
    group calls it once per step of the warm start. A lost peer: False (start as without
    a pool). One rank alone (no group): its own version."""
    if num_ranks == 1 or not dist.is_initialized():
        return version > 0 and num_ranks == 1
    buf = torch.tensor([version, -version], dtype=torch.int64)
    try:
        dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=group)
    except RuntimeError as exc:
        log.error("rank %d: warm start agreement failed: %s", rank, exc)
        return False
    low, high = int(buf[0]), -int(buf[1])
    return low == high > 0
