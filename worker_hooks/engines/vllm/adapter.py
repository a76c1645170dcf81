"""One vLLM rank's side of the rebalancer: windows up from vLLM's own load window, plans
in through vLLM's own policy call.

Built by the worker extension (`RebalancerWorkerExtension`, worker_hooks/engines/vllm/plugin.py) at the first
EPLB step, once vLLM has built its `EplbState`. The policy installed by the plugin
(worker_hooks/engines/vllm/plugin.py) asks `choose_map` at vLLM's rearrangement point.
What holds, and what vLLM cannot give, is in the package docstring.

Models: vLLM registers every MoE model of the engine with one `EplbState` (a drafter such
as DeepSeek MTP first, named "<model> (draft)", then the main model) and calls the policy
once per model at each rearrangement, in that order. The adapter balances the main model
only: its windows, shape, plans and agreement are the main model's. A drafter's call is
answered with vLLM's own default policy: that is what vLLM itself would do, it is the
same on every rank (vLLM all-reduces the load before the call), it takes no part in the
agreement, and it never touches the main model's plan state, so a drafter can neither
fail nor delay a plan. The call is told apart by the map's shape when that is unique,
else by its position in the rearrangement (`_main_call`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.layout import logical_counts
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent
from worker_hooks.engines.vllm.config import VLLMAdapterConfig
from worker_hooks.warm import await_offer, group_holds

log = logging.getLogger("worker_hooks.engines.vllm")

NO_PLAN = 0  # the hash every rank contributes when it has no plan to switch to


def plan_hash(version: int, phy2log: np.ndarray) -> int:
    """A positive 63-bit digest of (version, map): equal on two ranks iff the plans are."""
    digest = hashlib.blake2b(np.ascontiguousarray(phy2log, dtype=np.int64).tobytes(),
                             digest_size=8, person=b"rebalancer-vllm",
                             salt=version.to_bytes(8, "little", signed=False)).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


DRAFT_SUFFIX = " (draft)"  # vLLM's eplb_draft_model_name: "<model> (draft)"


def main_model_state(eplb_state: Any) -> Any:
    """The main model's `EplbModelState`: the last one registered whose name is not a
    drafter's (both of vLLM's runners register a drafter first, the main model last)."""
    states = list(eplb_state.model_states.values())
    main = [s for s in states if not str(getattr(s, "model_name", "")).endswith(DRAFT_SUFFIX)]
    return (main or states)[-1]


def plan_misfit(plan: np.ndarray, serving: np.ndarray, num_logical: int) -> str | None:
    """Why `plan` cannot replace `serving` (None when it can): `[L, P]` like the map vLLM
    serves, every entry an expert, every expert held on every layer."""
    if plan.shape != serving.shape:
        return f"plan is {list(plan.shape)}, vLLM serves {list(serving.shape)}"
    try:
        codec.check_phy2log(plan, num_logical, name="plan")
    except InputError as exc:
        return str(exc)
    return None


@dataclass
class AdapterStats:
    steps: int = 0
    windows: int = 0
    tokens_sent: int = 0                 # routed (token, k) pairs in the windows sent
    prepared: int = 0
    aborted: int = 0
    rearrangements: list[dict[str, Any]] = field(default_factory=list)  # one per policy call
    commits: list[tuple[int, int]] = field(default_factory=list)  # (step, version) applied
    drafter_calls: int = 0               # policy calls for a drafter: vLLM's default answered
    other_world: list[dict[str, Any]] = field(default_factory=list)  # calls for another world


class VLLMRebalanceAdapter(PlanHandlers):
    """Lives on vLLM's model-executing thread (`before_step`, `after_step`) and, for
    `choose_map`, on whichever thread vLLM calls its policy from (the main one in sync
    mode, the async EPLB thread otherwise). The plan handlers run on the agent thread
    and only stage a map or mark a version committed."""

    def __init__(self, config: VLLMAdapterConfig, eplb_state: Any, cpu_group: Any,
                 rank: int, num_ranks: int, num_nodes: int = 1) -> None:
        model_state = main_model_state(eplb_state)
        model = model_state.model
        self.config = config
        self.eplb_state = eplb_state
        self.model_state = model_state
        self.cpu_group = cpu_group  # vLLM's EPLB CPU group: the agreement's collectives
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_logical = int(model.num_logical_experts)
        self.phy2log = model_state.physical_to_logical_map.cpu().numpy().astype(np.int64)
        self.num_layers, self.num_slots = self.phy2log.shape
        self.version = 0
        self.step = 0
        self.stats = AdapterStats()
        self._lock = threading.Lock()
        self._staged: dict[int, np.ndarray] = {}   # prepared plans by version
        self._committed = 0                        # newest version the controller committed
        self._returned: tuple[int, np.ndarray] | None = None  # given to vLLM, not applied yet
        self._window_start = 0
        self._window_version = 0
        self._window_map = self.phy2log.copy()
        self.resizing: dict[int, int] | None = None  # elastic EP's rank mapping, during a resize
        self._counts: torch.Tensor | None = None   # [L, P] int64, this window's slot counts
        self._policy_calls = 0                     # policy calls seen: which model is asked
        self._cursor = int(eplb_state.expert_load_window_step)
        window, interval = eplb_state.expert_load_window_size, eplb_state.expert_rearrangement_step_interval
        if window < interval:
            log.warning("vLLM records load only in the last %d of every %d steps "
                        "(--eplb-config window_size < step_interval): the windows sent miss the rest",
                        window, interval)
        weights = model.expert_weights[0] if model.expert_weights else []
        shape = pb.ModelShape(
            num_layers=self.num_layers, num_logical_experts=self.num_logical,
            num_physical_slots=self.num_slots, num_gpus=num_ranks, num_nodes=num_nodes,
            expert_bytes=int(sum(t[0].numel() * t.element_size() for t in weights)),
        )
        self.agent = WorkerAgent(
            AgentConfig(
                config.address, config.deployment, rank, shape,
                config.worker_id or f"{socket.gethostname()}:{os.getpid()}", pool=config.pool,
                token=config.token, ca_file=config.ca_file, cert_file=config.cert_file,
                key_file=config.key_file,
            ),
            self,
            lambda: self.version,
            initial_phy2log=self.phy2log.copy(),
            served_map=lambda: self.phy2log,  # replaced whole, never written in place
        )
        # A pool member's warm start is due at vLLM's first policy call (`_take_warm_start`);
        # the offer's bounded wait counts from here.
        self._warm_due = bool(config.pool)  # every rank: the agreement is a collective
        self._started = time.monotonic()
        self.agent.start()
        log.info("rank %d: rebalancer drives vLLM's EPLB (%s, deployment %s, %d MoE layers, %d slots)",
                 rank, config.address, config.deployment, self.num_layers, self.num_slots)

    # ------------------------------------------------------------ vLLM's step

    def after_step(self, serving_before: np.ndarray) -> None:
        """After vLLM's `EplbState.step`: take the rows vLLM recorded at its own cursor
        (counted on `serving_before`, the map the pass ran on), then see whether a plan
        given to vLLM is now in place."""
        self.step += 1
        self.stats.steps += 1
        state = self.eplb_state
        cursor = int(state.expert_load_window_step)
        size = int(state.expert_load_window_size)
        rows = (cursor - self._cursor) % size if size else 0
        if rows:
            if not np.array_equal(serving_before, self._window_map):
                # A window never spans two maps (async: layer by layer); it ends at the
                # step before this one, whose rows are the next window's.
                self._flush_window(end=self.step - 1)
                self._window_map = serving_before.copy()
            window = self.model_state.expert_load_window
            index = [(self._cursor + i) % size for i in range(rows)]
            recorded = window[index].sum(dim=0, dtype=torch.int64)
            self._counts = recorded if self._counts is None else self._counts + recorded
        self._cursor = cursor
        self._check_applied()
        if self.step - self._window_start >= self.config.window_steps:
            self._flush_window()

    def serving_map(self) -> np.ndarray:
        """The map vLLM serves now: the adapter's copy unless a rearrangement is under
        way (then read from vLLM: async mode changes it one layer per step)."""
        if self._returned is None:
            return self.phy2log
        return self.model_state.physical_to_logical_map.cpu().numpy().astype(np.int64)

    def _check_applied(self) -> None:
        """A version counts as applied when vLLM is done (`rebalanced` false) and its
        `physical_to_logical_map` equals the plan."""
        if self._returned is None or self.model_state.rebalanced:
            return
        version, plan = self._returned
        self._returned = None
        current = self.model_state.physical_to_logical_map.cpu().numpy().astype(np.int64)
        if not np.array_equal(current, plan):
            log.error("rank %d: vLLM did not install v%d (it kept another map)", self.rank, version)
            self.agent.report(version, pb.PLAN_PHASE_FAILED,
                              error=f"vLLM did not install v{version} (map differs after rearrange)")
            self.phy2log = current
            return
        self._flush_window()  # the last window on the old version
        self.phy2log = plan.copy()
        self.version = version
        self._window_version = version
        self._window_map = plan.copy()
        self.stats.commits.append((self.step, version))
        self.agent.report(version, pb.PLAN_PHASE_COMMITTED, step=self.step)
        log.info("rank %d: v%d in place at step %d", self.rank, version, self.step)

    def _flush_window(self, end: int | None = None) -> None:
        """Send the counts taken since the last window as steps [window start, `end`)
        (default: up to this step), on the map they were counted on."""
        end = self.step if end is None else end
        if self._counts is None or end == self._window_start:
            return
        physical = self._counts.cpu().numpy().astype(np.int64)
        self._counts = None
        if self.config.count_duplicates > 1:
            physical = np.rint(physical / self.config.count_duplicates).astype(np.int64)
        logical = logical_counts(physical, self._window_map, self.num_logical)
        self.agent.submit_window(self._window_start, end - self._window_start,
                                 self._window_version, logical, physical)
        self.stats.windows += 1
        self.stats.tokens_sent += int(logical.sum())
        self._window_start = end

    def finish(self, timeout: float = 5.0) -> None:
        """At shutdown: send the last window, deliver what the agent holds, stop it."""
        self._flush_window()
        self.agent.drain(timeout)
        self.agent.stop()

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
        if num_replicas != self.num_slots or num_ranks != self.num_ranks:
            planned = self._planned_survivors(int(num_replicas), int(num_ranks))
            self.stats.other_world.append({"step": self.step, "num_replicas": int(num_replicas),
                                           "num_ranks": int(num_ranks), "planned": planned is not None})
            if planned is not None:
                log.warning("rank %d: vLLM scales the group down to %d ranks: the survivor placement "
                            "the controller planned for v%d answers", self.rank, num_ranks, self.version)
                return torch.from_numpy(planned).to(old_map.dtype)
            log.warning("rank %d: vLLM asks for %d slots on %d ranks, the controller plans %d on %d: "
                        "vLLM's default policy answers this call", self.rank, num_replicas, num_ranks,
                        self.num_slots, self.num_ranks)
            return default(weight, num_replicas, num_groups, num_nodes, num_ranks, old_map)
        return self.choose_map(old_map)

    def _planned_survivors(self, num_replicas: int, num_ranks: int) -> np.ndarray | None:
        """The controller's survivor placement `[L, num_replicas]` for the resize vLLM runs
        now (`resizing`, set around `EplbState.rearrange(rank_mapping=...)`), its slots in
        the new ranks' order; None for a resize it did not plan (scale-up, another loss,
        another base version, no set received), and unless every rank holds the same
        answer (one all-reduce on the old group, which every rank of it runs: vLLM asks
        each the same)."""
        mapping = self.resizing
        if mapping is None or len(mapping) != self.num_ranks:
            return None
        answer, digest = None, NO_PLAN
        try:  # the same on every rank but for a defect: caught, so the collective below runs
            survivors = sorted(old for old, new in mapping.items() if new >= 0)
            lost = sorted(set(mapping) - set(survivors))
            per = self.num_slots // self.num_ranks
            planned = self.agent.survivor_map(lost, self.version) if lost else None
            if (planned is not None and len(survivors) == num_ranks and num_replicas == per * num_ranks
                    and planned.shape == (self.num_layers, num_replicas)
                    and sorted(mapping[old] for old in survivors) == list(range(num_ranks))):
                # The plan's i-th block of slots is the i-th surviving old rank's.
                answer = np.empty_like(planned)
                for i, old in enumerate(survivors):
                    new = mapping[old]
                    answer[:, new * per:(new + 1) * per] = planned[:, i * per:(i + 1) * per]
                digest = plan_hash(self.version, answer)
        except Exception:
            log.exception("rank %d: the planned survivor placement was not used", self.rank)
            answer, digest = None, NO_PLAN
        try:
            low, neg_high = self._all_reduce_min([digest, -digest])
        except Exception:
            log.exception("rank %d: the ranks could not agree on a survivor placement", self.rank)
            return None
        return answer if low != NO_PLAN and low == -neg_high else None

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
                self._take_warm_start(record)
            serving = old_map.cpu().numpy().astype(np.int64)
            with self._lock:
                ready = self._committed if self._committed in self._staged else self.version
            agreed = self._all_reduce_min([ready])[0]
            record["agreed_version"] = agreed
            digest, plan, why = NO_PLAN, None, ""
            if agreed > self.version:
                with self._lock:
                    plan = self._staged.get(agreed)
                if plan is None:
                    why = f"v{agreed} is not staged here"
                elif not np.array_equal(serving, self.phy2log):
                    why = "the plan is built on another map than vLLM serves"
                else:
                    why = plan_misfit(plan, serving, self.num_logical) or ""
                digest = NO_PLAN if why else plan_hash(agreed, plan)  # type: ignore[arg-type]
            low, neg_high = self._all_reduce_min([digest, -digest])
            if agreed <= self.version or low == NO_PLAN or low != -neg_high:
                if agreed > self.version:
                    why = why or "ranks hold different plans for this version"
                    record["refused"] = why
                    log.error("rank %d: v%d not installed, every rank keeps its map: %s",
                              self.rank, agreed, why)
                    self.agent.report(agreed, pb.PLAN_PHASE_FAILED, error=f"not installed: {why}"[:500])
                    with self._lock:
                        self._staged.pop(agreed, None)
                return old_map.clone()
            assert plan is not None
            self._returned = (agreed, plan.copy())
            record["installed"] = agreed
            return torch.from_numpy(plan.copy()).to(old_map.dtype)
        except Exception as exc:  # a lost peer in the agreement, or a defect here
            record["error"] = f"{type(exc).__name__}: {exc}"
            log.exception("rank %d: rearrangement kept the old map", self.rank)
            return old_map.clone()

    def _take_warm_start(self, record: dict[str, Any]) -> None:
        """The first policy call of a pool member still on its start map: the pool
        placement offered at Register (worker_hooks/warm.py), when every rank holds the
        same offer, becomes the committed plan this call installs (through the plan
        agreement below, as any plan). Ranks without the offer in time (the wait is
        bounded by `warm_start_seconds` from the adapter's start): none takes it, and
        every rank serves its map as without a pool."""
        offered, plan = 0, None
        if self.version == 0 and self.config.warm_start_seconds > 0:
            left = self.config.warm_start_seconds - (time.monotonic() - self._started)
            offered, plan = await_offer(self.agent, max(left, 0.0), self.num_layers, self.num_slots,
                                        self.num_logical, self.rank)
        if not group_holds(offered, self.cpu_group, self.num_ranks, self.rank) or plan is None:
            record["warm_start"] = 0
            log.info("rank %d: no warm start (offered v%d); vLLM keeps its start map", self.rank, offered)
            return
        record["warm_start"] = offered
        with self._lock:
            self._staged[offered] = plan
            self._committed = max(self._committed, offered)

    def _all_reduce_min(self, values: list[int]) -> list[int]:
        buf = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return [int(v) for v in buf.tolist()]

    # ------------------------------------------------------------ agent thread

    def on_prepare(self, prepare: pb.Prepare) -> None:
        """Check and stage the placement. vLLM moves weights only inside its own
        rearrangement, after the commit: PREPARED means checked, nothing staged on the
        device."""
        version = prepare.version
        try:
            if prepare.base_version != self.version:
                raise InputError(f"plan is based on v{prepare.base_version}, rank serves v{self.version}")
            new = codec.decode_phy2log(
                prepare.placement.phy2log, self.num_layers, self.num_slots, self.num_logical)
        except InputError as exc:
            log.error("rank %d: plan v%d refused: %s", self.rank, version, exc)
            self.agent.report(version, pb.PLAN_PHASE_FAILED, error=str(exc)[:500])
            return
        with self._lock:
            self._staged = {v: p for v, p in self._staged.items() if v > self.version}
            self._staged[version] = np.array(new, dtype=np.int64)
        self.stats.prepared += 1
        self.agent.report(version, pb.PLAN_PHASE_PREPARED)

    def on_commit(self, version: int) -> None:
        with self._lock:
            self._committed = max(self._committed, version)

    def on_abort(self, version: int, reason: str) -> None:
        with self._lock:
            self._staged.pop(version, None)
        self.stats.aborted += 1
        log.warning("rank %d: plan v%d aborted: %s", self.rank, version, reason)
        self.agent.report(version, pb.PLAN_PHASE_ABORTED)
