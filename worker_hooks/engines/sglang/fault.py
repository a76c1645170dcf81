"""SGLang's elastic-EP fault path on the controller's planned survivor placement.

When a rank of an elastic EP group dies, SGLang marks it in
`ElasticEPStateManager.instance().active_ranks`, and at the next forward pass
`maybe_rebalance_after_rank_fault` (from `ModelRunner._maybe_rebalance_after_rank_fault`)
runs `EPLBManager.rebalance()`: the recorder's counts, all-reduced over the default group,
go to `ExpertLocationMetadata.init_by_eplb`, which asks `eplb_algorithms.rebalance_experts`
for a placement, builds the metadata of it, and SGLang's updater moves the survivors'
weights (experts that only the dead ranks held come from storage). SGLang keeps the full
width `[L, P]`: the elasticity-aware algorithm places every expert on the active ranks'
slots, fills each dead rank's slots with expert 0 and leaves them out of
`logical_to_all_physical_map`, so no token is sent there.

The plugin installs two AROUND hooks (HookRegistry, like its others):
  * `maybe_rebalance_after_rank_fault`: marks the call as the fault path, with the ranks
    now inactive, for its duration only (`_fault`), and tells the adapter afterwards
    what SGLang installed (SGLangRebalanceAdapter.after_rank_fault).
  * `eplb_algorithms.rebalance_experts`: inside the fault path only, answers with the
    survivor placement the controller planned for exactly that loss, on the placement the
    rank serves (WorkerAgent.survivor_map: told ahead, so it works with the controller
    gone), laid out as the elasticity-aware algorithm lays its answer out: the survivors'
    blocks of slots in place, the dead ranks' slots expert 0, left out of the expert's
    replicas. Everywhere else (and with no plan) SGLang's algorithm answers, unchanged.

Why the algorithm and not the metadata: `init_by_eplb` then builds the metadata of the
planned placement with SGLang's own code (its padding, replica counts and the static
dispatch table of this rank), exactly as it builds its own answer's; the algorithm's
three tensors are the whole contract. `init_by_mapping` would count the dead ranks'
filler slots as replicas of expert 0 and send tokens to them. Why only inside the fault
path: SGLang calls the algorithm elsewhere too (its periodic refit, which the plugin
replaces, and the post-scale-up rebalance, computed on rank 0 alone and broadcast), and a
planned loss is only the answer to a loss.

Every rank must install the same placement: before answering, the ranks all-reduce
(MIN of the digest and of its negation) a digest of (version served, placement) on the
default group, with the device of the counts, the group and device SGLang's recorder
all-reduced the counts on a moment earlier in this same path (SGLang's elastic backend
runs it over the active ranks). A rank with no plan, another plan, or an error
contributes "no plan"; unless every rank holds the same placement, or if the all-reduce
fails, SGLang's own algorithm answers on every rank (logged). Nothing here raises into
SGLang's forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from rebalancer.wire.shape import ClusterShape

log = logging.getLogger("worker_hooks.engines.sglang")

FAULT_PATH = "sglang.srt.elastic_ep.elastic_ep.maybe_rebalance_after_rank_fault"
REBALANCE_EXPERTS = "sglang.srt.eplb.eplb_algorithms.rebalance_experts"

# The inactive ranks while SGLang's fault path runs (None outside it), and whether the
# planned placement answered in it.
_fault: tuple[int, ...] | None = None
_planned_answer = False


def inactive_ranks() -> tuple[int, ...]:
    """The ranks of SGLang's elastic EP group marked inactive now (its effective size)."""
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

    state = ElasticEPStateManager.instance()
    if state is None or state.active_ranks is None:
        return ()
    active = state.active_ranks.detach().cpu().tolist()
    size = int(state.effective_ep_size or len(active))
    return tuple(r for r in range(min(size, len(active))) if not active[r])


def full_width(
    planned: np.ndarray,
    lost: tuple[int, ...],
    num_ranks: int,
    num_logical: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The survivors' placement `[L, P']` (new rank i = the i-th surviving rank) as SGLang's
    elasticity-aware algorithm answers: `phy2log [L, P]` with each survivor's block of
    slots in place and the lost ranks' slots expert 0; `log2phy [L, E, X]`, each expert's
    slots on the survivors in slot order, -1 padded; `logcnt [L, E]`. Raises ValueError
    when the plan does not fit (another shape, an expert without a slot)."""
    survivors = [r for r in range(num_ranks) if r not in lost]
    num_layers, width = planned.shape
    if not survivors or width % len(survivors):
        raise ValueError(f"a planned placement of {width} slots for {len(survivors)} survivors")
    per = width // len(survivors)
    phy2log = np.zeros((num_layers, per * num_ranks), dtype=np.int64)
    live = np.zeros(per * num_ranks, dtype=bool)
    for i, rank in enumerate(survivors):
        phy2log[:, rank * per : (rank + 1) * per] = planned[:, i * per : (i + 1) * per]
        live[rank * per : (rank + 1) * per] = True
    if planned.min() < 0 or planned.max() >= num_logical:
        raise ValueError("the planned placement names an expert the model does not have")
    logcnt = np.stack(
        [np.bincount(phy2log[layer, live], minlength=num_logical) for layer in range(num_layers)]
    )
    if (logcnt == 0).any():
        raise ValueError("the planned placement leaves an expert without a slot")
    log2phy = np.full((num_layers, num_logical, int(logcnt.max())), -1, dtype=np.int64)
    slots = np.flatnonzero(live)
    for layer in range(num_layers):
        for expert in range(num_logical):
            where = slots[phy2log[layer, slots] == expert]
            log2phy[layer, expert, : len(where)] = where
    return phy2log, log2phy, logcnt


def survivors_world(
    shape: ClusterShape,
    lost: tuple[int, ...],
    ep_size: int,
    slots_per_rank: int,
    ranks_per_node: int,
) -> tuple[list[int], np.ndarray, ClusterShape]:
    """The world SGLang's survivors are after losing `lost` of `ep_size` ranks, as the
    controller knows worlds: (the surviving ranks, survivor i being rank i of the new
    world; their slots of SGLang's full-width map `[P']`; the new world's shape, `shape`
    with its GPUs, slots and nodes those of the survivors)."""
    survivors = [r for r in range(ep_size) if r not in lost]
    live = np.concatenate(
        [np.arange(r * slots_per_rank, (r + 1) * slots_per_rank) for r in survivors]
    )
    world = replace(
        shape,
        num_gpus=len(survivors),
        num_slots=len(live),
        num_nodes=len({r // ranks_per_node for r in survivors}),
    )
    return survivors, live, world


def around_fault_path(
    adapter: Callable[[], Any], original: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """AROUND `maybe_rebalance_after_rank_fault`: the fault path, marked for its duration;
    then the adapter learns what SGLang installed. SGLang's own exceptions pass through."""
    global _fault, _planned_answer
    try:
        lost = inactive_ranks()
    except Exception:
        log.exception(
            "rebalancer: SGLang's elastic EP state could not be read; its fault path runs unchanged"
        )
        lost = ()
    _fault, _planned_answer = (lost or None), False
    try:
        rebalanced = original(*args, **kwargs)
    finally:
        planned, _fault, _planned_answer = _planned_answer, None, False
    if rebalanced and lost:
        live = adapter()
        if live is not None:
            try:
                live.after_rank_fault(lost, planned)
            except Exception:
                log.exception(
                    "rebalancer: the adapter could not take the placement after the rank fault"
                )
    return rebalanced


def around_rebalance_experts(
    adapter: Callable[[], Any], original: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """AROUND `eplb_algorithms.rebalance_experts`: inside the fault path, the planned
    survivor placement when every rank holds it (module docstring); else SGLang's."""
    global _planned_answer
    lost = _fault
    if lost is None:
        return original(*args, **kwargs)
    import torch
    import torch.distributed as dist
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

    from worker_hooks.session.agreement import NO_PLAN, all_reduce_min, plan_digest

    state = ElasticEPStateManager.instance()
    if state is None or state.has_scaled or not dist.is_initialized():
        # After a scale-up SGLang computes on rank 0 alone and broadcasts: no collective here.
        return original(*args, **kwargs)
    counts = kwargs.get("tokens_per_expert", args[0] if args else None)
    answer, digest = None, NO_PLAN
    try:  # every rank reaches the all-reduce below, whatever happens here
        live = adapter()
        if live is not None:
            answer = live.planned_survivors(lost)
        if answer is not None:
            digest = plan_digest(live.version, answer[0])
    except Exception:
        log.exception("rebalancer: the planned survivor placement was not used")
        answer, digest = None, NO_PLAN
    try:
        device = counts.device if isinstance(counts, torch.Tensor) else torch.device("cpu")
        low, neg_high = all_reduce_min(
            [digest, -digest], None, device
        )  # the default group: SGLang's
    except Exception:
        log.exception(
            "rebalancer: the ranks could not agree on a planned survivor placement; "
            "SGLang's own algorithm places the survivors"
        )
        return original(*args, **kwargs)
    if answer is None or low == NO_PLAN or low != -neg_high:
        log.warning(
            "rebalancer: ranks %s lost; %s: SGLang's own algorithm places the survivors",
            list(lost),
            "no rank holds a planned placement for that loss"
            if low == NO_PLAN and -neg_high == NO_PLAN
            else "the ranks do not all hold the same planned placement",
        )
        return original(*args, **kwargs)
    _planned_answer = True
    log.warning(
        "rebalancer: ranks %s lost; the survivor placement the controller planned on v%d answers "
        "SGLang's fault path",
        list(lost),
        adapter().version,
    )
    phy2log, log2phy, logcnt = answer
    return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
