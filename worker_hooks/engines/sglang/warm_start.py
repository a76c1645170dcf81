"""A pool member's warm start on SGLang: the pool placement as SGLang's initial expert
location, taken before SGLang loads its weights (issue #24).

The plugin wraps `ModelRunner.maybe_init_expert_location_metadata` (AROUND), which runs
once per rank with torch.distributed up and before `load_model`. After SGLang computed
its initial metadata (trivial, or its `--init-expert-location`), a rank of a pool member
(`REBALANCER_POOL`) registers with the controller (or its pod's sidecar), waits at most
`REBALANCER_WARM_START_SECONDS` for the offer, and the ranks agree all-or-none
(worker_hooks/warm.py, on a gloo group of its own). When they hold the same offer W,
SGLang's expert location metadata and its recorder are rebuilt from the pool's map with
SGLang's own `ExpertLocationMetadata.init_by_mapping` (what `--init-expert-location`
with a `physical_to_logical_map` does), so `load_model` loads each slot's expert from the
pool's placement. The adapter, built at the first forward pass, then serves W and reports
it COMMITTED at step 0 (`hand_over`), which the controller adopts.

This registration happens before the weights exist, so its shape says expert_bytes 0
("not known yet", rebalancer/controller/deployment.py UNKNOWN_EXPERT_BYTES); the
adapter's Register fills them in. Its agent stops once the offer is answered (its
session ends with its stream). No pool, no controller, no offer in time, a rank without
it, an error here: SGLang starts on its own initial location, as without the plugin,
never later than the bound.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.shape import ClusterShape
from worker_hooks.agent import AgentConfig, WorkerAgent
from worker_hooks.engines.sglang.config import SGLangAdapterConfig
from worker_hooks.session.rank import worker_identity
from worker_hooks.warm import await_offer, group_holds

log = logging.getLogger("worker_hooks.engines.sglang")

# SGLang's start path the plugin wraps (before load_model, torch.distributed up).
INIT_EXPERT_LOCATION = (
    "sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_expert_location_metadata"
)

# Seconds the early agent may take to end its session once the offer is answered.
STOP_SECONDS = 1.0

_taken: tuple[int, np.ndarray] | None = None  # (W, the [L, P] map) SGLang starts on


class _Starting:
    """The early agent's plan handlers: no plan can be taken before SGLang serves."""

    def __init__(self) -> None:
        self.agent: WorkerAgent | None = None

    def on_prepare(self, prepare: pb.Prepare) -> None:
        if self.agent is not None:
            self.agent.report(
                prepare.version, pb.PLAN_PHASE_FAILED, error="rank is starting (warm start)"
            )

    def on_commit(self, version: int) -> None:
        return None

    def on_abort(self, version: int, reason: str) -> None:
        return None


def taken() -> tuple[int, np.ndarray] | None:
    """(W, map) of the warm start this rank's SGLang started on, or None."""
    return _taken


def around_init_expert_location(
    config: SGLangAdapterConfig, original: Any, runner: Any, *args: Any, **kwargs: Any
) -> Any:
    """The AROUND hook: SGLang's own step, then the warm start. Never raises."""
    result = original(runner, *args, **kwargs)
    if getattr(runner, "is_draft_worker", False):
        return result
    try:
        install(config, runner.model_config)
    except Exception:
        log.exception(
            "rebalancer: warm start failed; SGLang starts on its own initial expert location"
        )
    return result


def install(config: SGLangAdapterConfig, model_config: Any) -> int:
    """Offer, agreement and install (module docstring); the version installed, or 0.
    Collective: every rank calls it once when the pool is set."""
    global _taken
    if not config.link.pool:
        return 0
    from sglang.srt.eplb.expert_distribution import (
        ExpertDistributionRecorder,
        set_global_expert_distribution_recorder,
    )
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.runtime_context import get_exec, get_parallel

    metadata = get_global_expert_location_metadata()
    if metadata is None or get_exec().moe.is_ep_scale_joiner:
        return 0  # no routed experts; an elastic-EP joiner takes its peers' map
    start = time.monotonic()
    rank = int(get_parallel().tp_rank)  # the adapter's rank (its Register)
    expert_rank = int(get_parallel().moe_ep_rank)
    phy2log = metadata.physical_to_logical_map_cpu.numpy().astype(np.int64)
    num_layers, num_slots = phy2log.shape
    num_logical = int(metadata.num_logical_experts)
    num_ranks = dist.get_world_size() if dist.is_initialized() else 1
    # A rank that never waits (REBALANCER_WARM_START_SECONDS=0) still takes part in the
    # agreement, with no offer: its peers never wait on it, and none installs.
    agent = None
    if config.warm_start_seconds > 0:
        agent = _early_agent(
            config, rank, phy2log, num_logical, int(metadata.ep_size), int(get_parallel().nnodes)
        )
    group = None
    offered, plan = 0, None
    try:
        if agent is not None:
            agent.start()
        if num_ranks > 1:  # built while the agent registers (every rank, the same step)
            group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=config.agree_timeout_seconds)
            )
        if agent is not None:
            # The bound counts from the registration's start, as in the vLLM adapter.
            left = max(config.warm_start_seconds - (time.monotonic() - start), 0.0)
            offered, plan = await_offer(agent, left, num_layers, num_slots, num_logical, rank)
            agent.stop(STOP_SECONDS)  # the early session ends with its stream
        holds = group_holds(offered, group, num_ranks, rank)
    finally:
        if agent is not None:
            agent.stop(0.0)
        if group is not None:
            dist.destroy_process_group(group)
    if not holds or plan is None:
        log.info(
            "rank %d: no warm start (offered v%d); SGLang starts on its initial expert location",
            rank,
            offered,
        )
        return 0
    warm = ExpertLocationMetadata.init_by_mapping(
        model_config, physical_to_logical_map=torch.from_numpy(plan.copy()), moe_ep_rank=expert_rank
    )
    set_global_expert_location_metadata(warm, allow_overwrite=True)
    set_global_expert_distribution_recorder(
        ExpertDistributionRecorder.init_new(warm, rank=expert_rank)
    )
    _taken = (offered, plan.copy())
    log.info(
        "rank %d: warm start v%d installed as SGLang's initial expert location (%.2f s)",
        rank,
        offered,
        time.monotonic() - start,
    )
    return offered


def _early_agent(
    config: SGLangAdapterConfig,
    rank: int,
    phy2log: np.ndarray,
    num_logical: int,
    num_gpus: int,
    num_nodes: int,
) -> WorkerAgent:
    """The agent that registers before the weights are loaded, for the offer only."""
    num_layers, num_slots = phy2log.shape
    shape = ClusterShape(
        num_layers=num_layers,
        num_logical=num_logical,
        num_slots=num_slots,
        num_gpus=num_gpus,
        num_nodes=num_nodes,
        expert_bytes=0,
    )  # not known before load_model (module docstring)
    handlers = _Starting()
    agent = WorkerAgent(
        AgentConfig(replace(config.link, worker_id=worker_identity(config.link)), rank, shape),
        handlers,
        lambda: 0,
        initial_phy2log=phy2log.copy(),
    )
    handlers.agent = agent
    return agent


def hand_over(adapter: Any) -> None:
    """The adapter, built at the first forward pass, serves the warm start: its windows
    carry W and it reports W COMMITTED at step 0 (the controller adopts it)."""
    if _taken is None or adapter.version != 0:
        return
    version, phy2log = _taken
    if not np.array_equal(adapter.phy2log, phy2log):
        log.error(
            "rank %d: SGLang does not serve the warm start v%d it installed; the adapter "
            "serves what SGLang holds (v0)",
            adapter.rank,
            version,
        )
        return
    adapter.version = version
    adapter.agent.report(version, pb.PLAN_PHASE_COMMITTED, step=0)
