"""One vLLM rank's side of the rebalancer: vLLM's glue on the engine-neutral rank session
(worker_hooks/session/): windows up from vLLM's own load window, plans in through vLLM's
own policy call.

Built by the worker extension (`RebalancerWorkerExtension`, worker_hooks/engines/vllm/plugin.py) at the first
EPLB step, once vLLM has built its `EplbState`. The policy installed by the plugin
asks `answer` at vLLM's rearrangement point. What holds, and what vLLM cannot give, is in
the package docstring.

Models: vLLM registers every MoE model of the engine with one `EplbState` (a drafter such
as DeepSeek MTP first, named "<model> (draft)", then the main model) and calls the policy
once per model at each rearrangement, in that order. The adapter balances the main model
only: its windows, shape, plans and agreement are the main model's. A drafter's call is
answered with vLLM's own default policy: that is what vLLM itself would do, it is the
same on every rank (vLLM all-reduces the load before the call), it takes no part in the
agreement, and it never touches the main model's plan state, so a drafter can neither
fail nor delay a plan. The call is told apart by the map's shape when that is unique,
else by its position in the rearrangement (`_main_call`).

The serving thread never waits for the device on the adapter's account: the counts go
to the host with `CountWindows`' non-blocking copies, and the map the passes run on is
kept on the host, from the plan vLLM was given and, in async mode, from each layer's
host-side result vLLM makes live (`EplbModelState.pending_result`). The one read of
vLLM's map is once per plan, to confirm vLLM installed it, at the step where vLLM's own
rearrangement synchronises (sync mode: the policy call; async: its readiness all-reduce).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rebalancer.v1 import rebalancer_pb2 as pb
from worker_hooks.engines.vllm.config import VLLMAdapterConfig
from worker_hooks.session.rank import RankSession, SessionStats

log = logging.getLogger("worker_hooks.engines.vllm")

DRAFT_SUFFIX = " (draft)"  # vLLM's eplb_draft_model_name: "<model> (draft)"


def main_model_state(eplb_state: Any) -> Any:
    """The main model's `EplbModelState`: the last one registered whose name is not a
    drafter's (both of vLLM's runners register a drafter first, the main model last)."""
    states = list(eplb_state.model_states.values())
    main = [s for s in states if not str(getattr(s, "model_name", "")).endswith(DRAFT_SUFFIX)]
    return (main or states)[-1]


def empty_slots(eplb_state: Any) -> int:
    """Slots of the main model's map that hold no expert (-1: elastic EP grew the slots,
    and vLLM's own rearrangement has not filled them yet)."""
    return int((main_model_state(eplb_state).physical_to_logical_map < 0).sum())


def expert_groups(model: Any) -> int:
    """The expert groups vLLM's hierarchical policy keeps (`num_expert_groups`), as the
    shape registers them: 0 (none) unless there are several and they divide the experts."""
    groups = int(getattr(model, "num_expert_groups", 0) or 0)
    return groups if groups > 1 and int(model.num_logical_experts) % groups == 0 else 0


@dataclass
class AdapterStats(SessionStats):
    rearrangements: list[dict[str, Any]] = field(default_factory=list)  # one per policy call
    drafter_calls: int = 0               # policy calls for a drafter: vLLM's default answered
    other_world: list[dict[str, Any]] = field(default_factory=list)  # calls for another world


class VLLMRebalanceAdapter(RankSession):
    """Lives on vLLM's model-executing thread (`before_step`, `after_step`) and, for
    `answer`, on whichever thread vLLM calls its policy from (the main one in sync mode,
    the async EPLB thread otherwise). The plan handlers run on the agent thread and only
    stage a map or mark a version committed."""

    def __init__(self, config: VLLMAdapterConfig, eplb_state: Any, cpu_group: Any,
                 rank: int, num_ranks: int, num_nodes: int = 1) -> None:
        model_state = main_model_state(eplb_state)
        model = model_state.model
        phy2log = model_state.physical_to_logical_map.cpu().numpy().astype(np.int64)
        weights = model.expert_weights[0] if model.expert_weights else []
        shape = pb.ModelShape(
            num_layers=phy2log.shape[0], num_logical_experts=int(model.num_logical_experts),
            num_physical_slots=phy2log.shape[1], num_gpus=num_ranks, num_nodes=num_nodes,
            expert_bytes=int(sum(t[0].numel() * t.element_size() for t in weights)),
            num_groups=expert_groups(model),
        )
        super().__init__(config, rank, shape, phy2log, AdapterStats(), count_duplicates=config.count_duplicates)
        self.config: VLLMAdapterConfig = config
        self.stats: AdapterStats
        self.eplb_state = eplb_state
        self.model_state = model_state
        self.cpu_group = cpu_group  # vLLM's EPLB CPU group: the agreement's collectives
        self._returned: tuple[int, np.ndarray] | None = None  # given to vLLM, not applied yet
        self._served = self.phy2log.copy()  # the map the next pass runs on (host mirror)
        self._pending: Any = None           # async: the layer result vLLM may make live this step
        self._window_version = 0
        self._window_map = self.phy2log.copy()
        self.resizing: dict[int, int] | None = None  # elastic EP's rank mapping, during a resize
        self._policy_calls = 0                     # policy calls seen: which model is asked
        self._cursor = int(eplb_state.expert_load_window_step)
        window, interval = eplb_state.expert_load_window_size, eplb_state.expert_rearrangement_step_interval
        if window < interval:
            log.warning("vLLM records load only in the last %d of every %d steps "
                        "(--eplb-config window_size < step_interval): the windows sent miss the rest",
                        window, interval)
        # A pool member's warm start is due at vLLM's first policy call (`_take_warm_start`);
        # the offer's bounded wait counts from here.
        self._warm_due = bool(config.pool)  # every rank: the agreement is a collective
        self._started = time.monotonic()
        self.agent.start()
        log.info("rank %d: rebalancer drives vLLM's EPLB (%s, deployment %s, %d MoE layers, %d slots)",
                 rank, config.address, config.deployment, self.num_layers, self.num_slots)

    # ------------------------------------------------------------ vLLM's step

    def before_step(self) -> None:
        """Before vLLM's `EplbState.step`: note the layer result an async rearrangement
        may make live in it (vLLM's host-side copy of the layer's new map)."""
        self._pending = getattr(self.model_state, "pending_result", None)

    def after_step(self) -> None:
        """After vLLM's `EplbState.step`: take the rows vLLM recorded at its own cursor
        (counted on the map the pass ran on), then follow the map vLLM made live."""
        serving_before = self._served
        self.step += 1
        self.stats.steps += 1
        state = self.eplb_state
        cursor = int(state.expert_load_window_step)
        size = int(state.expert_load_window_size)
        rows = (cursor - self._cursor) % size if size else 0
        if rows:
            # The map is replaced whole when it changes: the same object is the same map.
            if serving_before is not self._window_map and not np.array_equal(serving_before, self._window_map):
                # A window never spans two maps (async: layer by layer); it ends at the
                # step before this one, whose rows are the next window's.
                self._close(self.step - 1)
                self._window_map = serving_before
            index = [(self._cursor + i) % size for i in range(rows)]
            self.windows.add(self.model_state.expert_load_window[index].sum(dim=0, dtype=torch.int64))
        self._cursor = cursor
        pending = self._pending
        if pending is not None and getattr(self.model_state, "pending_result", None) is not pending:
            self._served = self._served.copy()  # replaced whole: the window's map stays as it was
            self._served[int(pending.layer_idx)] = np.asarray(pending.new_physical_to_logical_map, dtype=np.int64)
        self._pending = None
        self._check_applied()
        if self.window_due():
            self._close(self.step)
        else:
            self.windows.poll()

    def _close(self, end: int, wait: bool = False) -> None:
        """Close the open window at step `end` on the map its passes ran on. A map between
        two versions (an async rearrangement's layers) is one no version names: only the
        logical counts of such a window go up."""
        mixed = not np.array_equal(self._window_map, self.phy2log)
        self.windows.close(end, self._window_version, self._window_map, mixed=mixed, wait=wait)

    def _check_applied(self) -> None:
        """A version counts as applied when vLLM is done (`rebalanced` false) and its
        `physical_to_logical_map` equals the plan (read once per plan)."""
        if self._returned is None or self.model_state.rebalanced:
            return
        version, plan = self._returned
        self._returned = None
        current = self.model_state.physical_to_logical_map.cpu().numpy().astype(np.int64)
        self._served = current
        if not np.array_equal(current, plan):
            log.error("rank %d: vLLM did not install v%d (it kept another map)", self.rank, version)
            self.agent.report(version, pb.PLAN_PHASE_FAILED,
                              error=f"vLLM did not install v{version} (map differs after rearrange)")
            self.phy2log[...] = current
            return
        self._close(self.step, wait=True)  # the old version's last
        self.made_live(version, plan)
        self._window_version = version
        self._window_map = current  # the map vLLM serves now, equal to the plan

    def finish(self, timeout: float = 5.0) -> None:
        """At shutdown: send the last window, deliver what the agent holds, stop it."""
        self._close(self.step, wait=True)
        super().finish(timeout)

    # ------------------------------------------------------------ vLLM's policy call

    def answer(self, weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
               num_ranks: int, old_map: torch.Tensor, default: Any) -> torch.Tensor:
        """vLLM's policy call, for whichever model and world it asks: the main model in
        the world the controller plans for gets `choose_map`; a drafter, or a request
        for another world (elastic EP's `rearrange(rank_mapping=...)`: other
        `num_replicas`/`num_ranks`), gets vLLM's own `default` policy, whose answer has
        the shape asked for. Every condition here is the same on every rank (vLLM passes
        every rank the same arguments), so the agreement's collectives stay matched."""
        if not self._main_call(old_map):
            self.stats.drafter_calls += 1
            return default(weight, num_replicas, num_groups, num_nodes, num_ranks, old_map)
        if num_replicas != self.num_slots or num_ranks != self.num_gpus:
            planned = self.planned_for_mapping(self.resizing, int(num_replicas), int(num_ranks), self.cpu_group)
            self.stats.other_world.append({"step": self.step, "num_replicas": int(num_replicas),
                                           "num_ranks": int(num_ranks), "planned": planned is not None})
            if planned is not None:
                log.warning("rank %d: vLLM scales the group down to %d ranks: the survivor placement "
                            "the controller planned for v%d answers", self.rank, num_ranks, self.version)
                return torch.from_numpy(planned).to(old_map.dtype)
            log.warning("rank %d: vLLM asks for %d slots on %d ranks, the controller plans %d on %d: "
                        "vLLM's default policy answers this call", self.rank, num_replicas, num_ranks,
                        self.num_slots, self.num_gpus)
            return default(weight, num_replicas, num_groups, num_nodes, num_ranks, old_map)
        return self.choose_map(old_map)

    def _main_call(self, old_map: torch.Tensor) -> bool:
        """Whether this policy call is for the main model. vLLM asks for every model of
        its `EplbState` once per rearrangement, in registration order (sync: inside
        `rearrange`; async: the worker thread, each model in turn), so the k-th call is
        for model k modulo their number; a map shape that only one model has settles it
        (and re-aligns the count)."""
        states = list(self.eplb_state.model_states.values())
        index = self._policy_calls % len(states)
        shape = tuple(old_map.shape)
        fits = [i for i, s in enumerate(states) if tuple(s.physical_to_logical_map.shape) == shape]
        if len(fits) == 1:
            index = fits[0]
        self._policy_calls = index + 1
        return states[index] is self.model_state

    def choose_map(self, old_map: torch.Tensor) -> torch.Tensor:
        """vLLM's rearrangement point, on every rank: the agreed committed plan, or
        `old_map` (nothing moves). Never raises: an exception here stops vLLM's async
        EPLB thread for good, or the engine in sync mode."""
        record: dict[str, Any] = {"step": self.step, "version": self.version}
        self.stats.rearrangements.append(record)
        try:
            if self._warm_due:
                self._warm_due = False
                left = self.config.warm_start_seconds - (time.monotonic() - self._started)
                record["warm_start"] = self.take_warm_start(self.cpu_group, self.num_gpus, max(left, 0.0))
            switch = self.agree_switch(old_map.cpu().numpy().astype(np.int64), self.cpu_group)
            record["agreed_version"] = switch.agreed
            if switch.plan is None:
                if switch.refused:
                    record["refused"] = switch.refused
                return old_map.clone()
            self._returned = (switch.agreed, switch.plan)
            record["installed"] = switch.agreed
            return torch.from_numpy(switch.plan.copy()).to(old_map.dtype)
        except Exception as exc:  # a lost peer in the agreement, or a defect here
            record["error"] = f"{type(exc).__name__}: {exc}"
            log.exception("rank %d: rearrangement kept the old map", self.rank)
            return old_map.clone()
