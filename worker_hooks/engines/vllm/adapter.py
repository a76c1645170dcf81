"""One vLLM rank's side of the rebalancer: vLLM's glue on the engine-neutral rank session
(worker_hooks/session/): windows up from vLLM's own load window, plans in through vLLM's
own policy call.

Built by the worker extension (`RebalancerWorkerExtension`, worker_hooks/engines/vllm/plugin.py) at
the first EPLB step, once vLLM has built its `EplbState`. The policy installed by the plugin
asks `answer` at vLLM's rearrangement point. What holds, and what vLLM cannot give, is in
the package docstring.

Models: the deployment is vLLM's main model and its drafters of the same expert shape, as
one layer set (layer_set.py). The agreement runs at a rearrangement's first policy call
of the set, on the set's whole map, and each model's call takes its own rows of that one
outcome: a plan switches every model or none, and no model's call fails another's plan.

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
from rebalancer.wire.shape import ClusterShape
from worker_hooks.engines.vllm.config import VLLMAdapterConfig
from worker_hooks.engines.vllm.layer_set import LayerSet, expert_groups
from worker_hooks.session.rank import RankSession, SessionStats, Switch

log = logging.getLogger("worker_hooks.engines.vllm")


@dataclass
class AdapterStats(SessionStats):
    rearrangements: list[dict[str, Any]] = field(default_factory=list)  # one per agreement
    drafter_calls: int = 0  # policy calls for a drafter (in the layer set or not)
    default_calls: int = 0  # calls for a model outside the layer set: vLLM's default
    other_world: list[dict[str, Any]] = field(default_factory=list)  # calls for another world


class VLLMRebalanceAdapter(RankSession):
    """Lives on vLLM's model-executing thread (`before_step`, `after_step`) and, for
    `answer`, on whichever thread vLLM calls its policy from (the main one in sync mode,
    the async EPLB thread otherwise). The plan handlers run on the agent thread and only
    stage a map or mark a version committed."""

    def __init__(
        self,
        config: VLLMAdapterConfig,
        eplb_state: Any,
        cpu_group: Any,
        rank: int,
        num_ranks: int,
        num_nodes: int = 1,
        resized_from: tuple[int, int] | None = None,
    ) -> None:
        self.layers = LayerSet(eplb_state)  # the models balanced, main first, and their rows
        model = self.layers.models[0].model
        phy2log = self.layers.read_map()
        weights = model.expert_weights[0] if model.expert_weights else []
        shape = ClusterShape(
            num_layers=phy2log.shape[0],
            num_logical=int(model.num_logical_experts),
            num_slots=phy2log.shape[1],
            num_gpus=num_ranks,
            num_nodes=num_nodes,
            expert_bytes=int(sum(t[0].numel() * t.element_size() for t in weights)),
            num_groups=expert_groups(model),
        )
        super().__init__(
            config,
            rank,
            shape,
            phy2log,
            AdapterStats(),
            count_duplicates=config.count_duplicates,
            resized_from=resized_from,
        )
        self.config: VLLMAdapterConfig = config
        self.stats: AdapterStats
        self.eplb_state = eplb_state
        self.model_state = self.layers.models[0]  # the main model
        self.cpu_group = cpu_group  # vLLM's EPLB CPU group: the agreement's collectives
        self._returned: tuple[int, np.ndarray] | None = None  # given to vLLM, not applied yet
        self._served = self.phy2log.copy()  # the map the next pass runs on (host mirror)
        self._pending: list[Any] = []  # async: per model, the layer result vLLM may make live
        self._switch: Switch | None = None  # the agreement of the rearrangement under way
        self._window_version = 0
        self._window_map = self.phy2log.copy()
        self.resizing: dict[int, int] | None = None  # elastic EP's rank mapping, during a resize
        self._cursor = int(eplb_state.expert_load_window_step)
        window, interval = (
            eplb_state.expert_load_window_size,
            eplb_state.expert_rearrangement_step_interval,
        )
        if window < interval:
            log.warning(
                "vLLM records load only in the last %d of every %d steps "
                "(--eplb-config window_size < step_interval): the windows sent miss the rest",
                window,
                interval,
            )
        # A pool member's warm start is due at vLLM's first policy call (`_take_warm_start`);
        # the offer's bounded wait counts from here.
        self._warm_due = bool(config.link.pool)  # every rank: the agreement is a collective
        self._started = time.monotonic()
        self.agent.start()
        left = self.layers.left_out()
        log.info(
            "rank %d: rebalancer drives vLLM's EPLB (%s, deployment %s, %d MoE layers, %d slots: "
            "%s)%s",
            rank,
            config.link.address,
            config.link.deployment,
            self.num_layers,
            self.num_slots,
            self.layers.describe(),
            f"; vLLM's default policy balances {', '.join(left)} (another expert shape)"
            if left
            else "",
        )

    # ------------------------------------------------------------ vLLM's step

    def before_step(self) -> None:
        """Before vLLM's `EplbState.step`: note the layer result an async rearrangement
        may make live in it, per model (vLLM's host-side copy of the layer's new map)."""
        self._pending = [getattr(m, "pending_result", None) for m in self.layers.models]

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
            if serving_before is not self._window_map and not np.array_equal(
                serving_before, self._window_map
            ):
                # A window never spans two maps (async: layer by layer); it ends at the
                # step before this one, whose rows are the next window's.
                self._close(self.step - 1)
                self._window_map = serving_before
            index = [(self._cursor + i) % size for i in range(rows)]
            self.windows.add(self.layers.window_rows(index))
        self._cursor = cursor
        for model, rows_of, pending in zip(
            self.layers.models, self.layers.rows, self._pending, strict=True
        ):
            if pending is not None and getattr(model, "pending_result", None) is not pending:
                if self._served is serving_before:
                    self._served = self._served.copy()  # replaced whole: the window's map stays
                self._served[rows_of.start + int(pending.layer_idx)] = np.asarray(
                    pending.new_physical_to_logical_map, dtype=np.int64
                )
        self._pending = []
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
        if self._returned is None or self.layers.rebalancing():
            return
        version, plan = self._returned
        self._returned = None
        current = self.layers.read_map()
        self._served = current
        if not np.array_equal(current, plan):
            log.error("rank %d: vLLM did not install v%d (it kept another map)", self.rank, version)
            self.agent.report(
                version,
                pb.PLAN_PHASE_FAILED,
                error=f"vLLM did not install v{version} (map differs after rearrange)",
            )
            self.phy2log[...] = current
            return
        self._close(self.step, wait=True)  # the old version's last
        self.made_live(version, plan)
        self._window_version = version
        self._window_map = current  # the map vLLM serves now, equal to the plan

    def serve_version(self, version: int) -> None:
        self._close(self.step)
        self.version = self._window_version = version

    def finish(self, timeout: float = 5.0) -> None:
        """At shutdown: send the last window, deliver what the agent holds, stop it."""
        self._close(self.step, wait=True)
        super().finish(timeout)

    # ------------------------------------------------------------ vLLM's policy call

    def answer(
        self,
        weight: Any,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_map: torch.Tensor,
        default: Any,
    ) -> torch.Tensor:
        """vLLM's policy call, for whichever model and world it asks: a model of the layer
        set in the world the controller plans for gets its rows of the agreed plan
        (`choose_map`); a model outside the set, or a request for another world (elastic
        EP's `rearrange(rank_mapping=...)`: other `num_replicas`/`num_ranks`) for which
        the controller planned nothing, gets vLLM's own `default` policy, whose answer has
        the shape asked for. Every condition here is the same on every rank (vLLM passes
        every rank the same arguments), so the agreement's collectives stay matched."""
        model = self.layers.model_of_call(old_map)
        if model is not self.model_state:
            self.stats.drafter_calls += 1
        index = self.layers.index_of(model)
        if index is None:
            self.stats.default_calls += 1
            return default(weight, num_replicas, num_groups, num_nodes, num_ranks, old_map)
        rows = self.layers.rows[index]
        if num_replicas != self.num_slots or num_ranks != self.num_gpus:
            planned = self.planned_for_mapping(
                self.resizing, int(num_replicas), int(num_ranks), self.cpu_group
            )
            self.stats.other_world.append(
                {
                    "step": self.step,
                    "num_replicas": int(num_replicas),
                    "num_ranks": int(num_ranks),
                    "planned": planned is not None,
                }
            )
            if planned is not None:
                log.warning(
                    "rank %d: vLLM scales the group down to %d ranks: the survivor placement "
                    "the controller planned for v%d answers",
                    self.rank,
                    num_ranks,
                    self.version,
                )
                return torch.from_numpy(planned[rows].copy()).to(old_map.dtype)
            log.warning(
                "rank %d: vLLM asks for %d slots on %d ranks, the controller plans %d on %d: "
                "vLLM's default policy answers this call",
                self.rank,
                num_replicas,
                num_ranks,
                self.num_slots,
                self.num_gpus,
            )
            return default(weight, num_replicas, num_groups, num_nodes, num_ranks, old_map)
        return self.choose_map(index, old_map)

    def choose_map(self, index: int, old_map: torch.Tensor) -> torch.Tensor:
        """vLLM's rearrangement point for the layer set's model `index`, on every rank: its
        rows of the agreed committed plan, or `old_map` (nothing moves). The agreement
        runs at the rearrangement's first call of the layer set, on the whole set's map;
        the later models' calls take their rows of that outcome. Never raises: an exception here
        stops vLLM's async EPLB thread for good, or the engine in sync mode."""
        rows = self.layers.rows[index]
        if not self.layers.opens_rearrangement(index):
            switch = self._switch
            if switch is None or switch.plan is None:
                return old_map.clone()
            return torch.from_numpy(switch.plan[rows].copy()).to(old_map.dtype)
        record: dict[str, Any] = {"step": self.step, "version": self.version}
        self.stats.rearrangements.append(record)
        self._switch = None
        try:
            if self._warm_due:
                self._warm_due = False
                left = self.config.warm_start_seconds - (time.monotonic() - self._started)
                record["warm_start"] = self.take_warm_start(
                    self.cpu_group, self.num_gpus, max(left, 0.0)
                )
            serving = self._served.copy()  # no rearrangement runs: the other models' maps as served
            serving[rows] = old_map.cpu().numpy().astype(np.int64)
            switch = self.agree_switch(serving, self.cpu_group)
            record["agreed_version"] = switch.agreed
            if switch.plan is None:
                if switch.refused:
                    record["refused"] = switch.refused
                return old_map.clone()
            self._switch = switch
            self._returned = (switch.agreed, switch.plan)
            record["installed"] = switch.agreed
            return torch.from_numpy(switch.plan[rows].copy()).to(old_map.dtype)
        except Exception as exc:  # a lost peer in the agreement, or a defect here
            record["error"] = f"{type(exc).__name__}: {exc}"
            log.exception("rank %d: rearrangement kept the old map", self.rank)
            return old_map.clone()
