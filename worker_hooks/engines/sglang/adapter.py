"""One SGLang rank's side of the rebalancer: windows up, plans staged beside serving and
swapped at an agreed pass, or moved between passes at an agreed pass by SGLang's own updater.

Which one (config.choose_updater): where the weights move over NCCL (on GPU), SGLang's
updater between passes, by default. The staged update's transfers run NCCL p2p on a
background thread beside SGLang's forward collectives, which NCCL may deadlock on, and
the transports without NCCL (ipc, outbox: CUDA IPC in one host) cannot move SGLang's
per-layer expert tensors; `REBALANCER_UPDATER=staged` forces staging there, with a
WARNING. Over gloo (CPU) the staged update is the default. Either way, after SGLang's
expert location metadata changes, the `lp` dispatch solvers are rebuilt as SGLang's own
update rebuilds them (`_rebuild_lp_solvers`).

Created by the plugin (worker_hooks/engines/sglang/plugin.py) at the first forward pass that
SGLang's `EPLBManager` sees, once SGLang has loaded the model, set the global
`ExpertLocationMetadata` and initialised torch.distributed. The guarantees, and the one
SGLang still cannot give, are in the package docstring (worker_hooks/engines/sglang/__init__.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.layout import logical_counts
from worker_hooks import works
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent
from worker_hooks.agree import CommitAgreement
from worker_hooks.engines import require_engine
from worker_hooks.engines.sglang.config import SGLangAdapterConfig, Updater, choose_updater
from worker_hooks.engines.sglang.staged import layer_groups, ticket, ticket_parts
from worker_hooks.fence import TransfersDeclined
from worker_hooks.migrate import (
    LayerWeights,
    MigrationAborted,
    MigrationConfig,
    MigrationExecutor,
    P2PTransport,
)

log = logging.getLogger("worker_hooks.engines.sglang")


@dataclass
class AdapterStats:
    steps: int = 0
    windows: int = 0
    commits: list[tuple[int, int]] = field(default_factory=list)  # (pass, version)
    prepared: int = 0
    aborted: int = 0
    update_seconds: list[float] = field(default_factory=list)  # SGLang's updater, per plan
    swap_seconds: list[float] = field(default_factory=list)    # staged: per group swap
    groups: list[int] = field(default_factory=list)            # staged: groups per committed plan
    bytes_received: int = 0
    rank_faults: list[dict[str, Any]] = field(default_factory=list)  # SGLang's fault path runs


@dataclass
class StagedPlan:
    """A plan in staged mode: its groups of layers, how many are staged and swapped."""

    version: int
    new: np.ndarray                # [L, P] the plan's placement
    transfers: np.ndarray          # [K, 5] of the layers holding weights
    groups: list[list[int]]        # layers per group, in swap order
    weightless: list[int]          # changed layers without routed weights: maps only
    target: Any = None             # SGLang's ExpertLocationMetadata of `new`
    staged: int = 0                # groups staged so far
    swapped: int = 0               # groups live so far
    thread: threading.Thread | None = None


class SGLangRebalanceAdapter(PlanHandlers):
    """Lives on SGLang's model-executing thread (`on_forward_pass_end`, `add_pass_counts`);
    the plan handlers run on the agent thread and only stage a map or set a version."""

    def __init__(self, config: SGLangAdapterConfig, manager: Any) -> None:
        require_engine("sglang.srt.eplb.expert_location", "SGLang", "sglang")
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
        from sglang.srt.runtime_context import get_parallel

        metadata = get_global_expert_location_metadata()
        if metadata is None:
            raise InputError("SGLang has no expert location metadata: the model has no routed experts")
        self.config = config
        self.manager = manager
        # SGLang hands the updater tp_rank as the EP rank (EPLBManager.rebalance).
        self.rank = int(get_parallel().tp_rank)
        self.num_gpus = int(metadata.ep_size)
        self.num_nodes = int(get_parallel().nnodes)
        self.phy2log = metadata.physical_to_logical_map_cpu.numpy().astype(np.int64).copy()
        self.num_layers, self.num_slots = self.phy2log.shape
        self.num_logical = int(metadata.num_logical_experts)
        self.slots_per_rank = self.num_slots // self.num_gpus
        self.version = 0
        self.step = 0
        self.stats = AdapterStats()
        self.broken: str | None = None  # set when an update lost a peer: no more plans
        self.faulted: tuple[int, ...] | None = None  # ranks lost in SGLang's fault path
        self._finished = False
        self._window_start = 0
        self._counts: torch.Tensor | None = None  # [L, P] int64 on the pass's device
        self._snapshot: tuple[int, int, int, np.ndarray, torch.Tensor, torch.cuda.Event | None, bool] | None = None
        self._staged: dict[int, np.ndarray] = {}  # updater mode: the map of the plan to commit
        self._plan: StagedPlan | None = None      # staged mode: the plan in flight
        self._ticket = 0                          # what is live (staged.ticket)
        self._commit_ready = 0
        self._lock = threading.Lock()
        # Groups of the adapter's own, so its collectives never interleave with SGLang's.
        # Every rank builds them at the same (first) forward pass.
        timeout = timedelta(seconds=config.agree_timeout_seconds)
        self._agree_group = dist.new_group(backend="gloo", timeout=timeout)
        self._layer_group = dist.new_group(backend="gloo", timeout=timeout)
        self.agreement = CommitAgreement(self._agree_group, config.agree_every)
        weights = manager._get_model().routed_experts_weights_of_layer
        self.weight_layers = sorted(weights)
        self.executor: MigrationExecutor | None = None
        backend: Literal["nccl", "gloo"] = "gloo"
        if weights:
            # The adapter's own group for weights (NCCL on GPU, gloo on CPU), never SGLang's.
            device = weights[self.weight_layers[0]][0].device
            backend = P2PTransport.group_backend(device)
            self._migrate_group = dist.new_group(backend=backend, timeout=timeout)
            self.executor = MigrationExecutor(
                self.rank, self.num_gpus, self._layer_weights(weights), self._migrate_group,
                MigrationConfig(transport="p2p"),
            )
        # Staged beside serving on gloo; between passes with SGLang's updater on NCCL
        # (config.choose_updater says why). Read at each Prepare.
        self.updater: Updater
        self.updater, warning = choose_updater(config.updater, backend)
        if warning:
            log.warning("rank %d: %s", self.rank, warning)
        shape = pb.ModelShape(
            num_layers=self.num_layers, num_logical_experts=self.num_logical,
            num_physical_slots=self.num_slots, num_gpus=self.num_gpus,
            num_nodes=self.num_nodes, expert_bytes=self._expert_bytes(),
        )
        self.agent = WorkerAgent(
            AgentConfig(
                config.address, config.deployment, self.rank, shape,
                # The pid always: the controller tells a restarted rank by it (a mixed
                # placement clears only when the processes holding it are gone).
                f"{config.worker_id or socket.gethostname()} pid {os.getpid()}", pool=config.pool,
                token=config.token, ca_file=config.ca_file, cert_file=config.cert_file,
                key_file=config.key_file,
            ),
            self,
            lambda: self.version,
            initial_phy2log=self.phy2log.copy(),
            served_map=lambda: self.phy2log.copy(),  # written in place: read anew each time
        )
        self.agent.start()
        log.info("rank %d: rebalancer adapter on (%s, deployment %s, %d layers, %d slots, %s update, "
                 "weights over %s)", self.rank, config.address, config.deployment, self.num_layers,
                 self.num_slots, self.updater, backend)

    @staticmethod
    def _layer_weights(weights: dict[int, list[torch.Tensor]]) -> LayerWeights:
        """SGLang's live expert tensors (`[local slots, ...]` per layer, a list of them)
        as the executor's per-layer weights."""
        count = len(next(iter(weights.values())))
        return {f"w{i}": {layer: tensors[i] for layer, tensors in weights.items()} for i in range(count)}

    def _expert_bytes(self) -> int:
        """Bytes of one physical slot's weights (all its tensors), from SGLang's model."""
        weights = self.manager._get_model().routed_experts_weights_of_layer
        if not weights:
            return 0
        tensors = weights[min(weights)]
        return int(sum(t[0].numel() * t.element_size() for t in tensors))

    # ------------------------------------------------------------ SGLang's thread

    def add_pass_counts(self, global_physical_count: torch.Tensor) -> None:
        """One recorded pass: this rank's tokens per physical slot, `[L, P]` (device)."""
        if self._counts is None:
            self._counts = torch.zeros(global_physical_count.shape, dtype=torch.int64,
                                       device=global_physical_count.device)
        self._counts += global_physical_count

    def on_forward_pass_end(self) -> None:
        """Once per forward pass on every rank (SGLang's passes are in lockstep)."""
        self.step += 1
        self.stats.steps += 1
        self._poll_window()
        if self.faulted is not None:  # the adapter's groups hold dead ranks: windows only
            if self.step - self._window_start >= self.config.window_steps:
                self._flush_window()
            return
        agreed = self.agreement.on_step(self.step, self._ready_ticket(), serving=self._ticket)
        if self.broken is None and agreed is not None and agreed > self._ticket:
            self._flush_window(wait=True)  # a window never straddles two placements
            version, groups_done = ticket_parts(agreed)
            if groups_done:
                self._swap(agreed)
            else:
                self._apply(version)
        elif self.step - self._window_start >= self.config.window_steps:
            self._flush_window()

    def _ready_ticket(self) -> int:
        """The newest ticket this rank can switch to: the next staged group of a plan the
        controller said to commit, SGLang's updater's committed plan, or what is live."""
        with self._lock:
            plan, ready = self._plan, self._commit_ready
            if plan is not None:
                if plan.version <= ready and plan.staged > plan.swapped:
                    return ticket(plan.version, plan.staged)
                return self._ticket
            if ready in self._staged and ready > self.version:
                return ticket(ready, 0)
        return self._ticket

    def finish(self, timeout: float = 5.0) -> None:
        """At shutdown (the plugin calls it at the process's exit): send the last window,
        deliver what the agent holds within `timeout`, stop it. Once; later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        try:
            self._flush_window(wait=True)
        finally:
            self.agent.drain(timeout)
            self.agent.stop(timeout)
            self.agreement.close()

    def idle_step(self) -> None:
        """A pass while disabled: only the commit agreement, with the version served."""
        self.step += 1
        self.agreement.on_step(self.step, self._ticket)

    def disable(self, reason: str) -> None:
        """The plugin turned the adapter off after an error of its own: no more plans, and
        the agent stops without waiting (the controller sees the rank leave)."""
        self.broken = self.broken or f"adapter disabled ({reason})"
        self._finished = True
        self.agent.stop(timeout=0.0)

    def _flush_window(self, wait: bool = False) -> None:
        if self._snapshot is not None:
            self._poll_window(wait=wait)
        if self._snapshot is not None or self._counts is None or self.step == self._window_start:
            return  # a copy still in flight: the counts go on into the next window
        counts = self._counts
        if counts.device.type == "cuda":
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            event: torch.cuda.Event | None = torch.cuda.Event()
            assert event is not None
            event.record()
        else:
            host, event = counts.clone(), None
        counts.zero_()
        # Between the swaps of a plan's groups, and after a rank fault, the map is one no
        # version names: only the logical counts go up then.
        mixed = (self._plan is not None and self._plan.swapped > 0) or self.faulted is not None
        self._snapshot = (self._window_start, self.step - self._window_start, self.version,
                          self.phy2log.copy(), host, event, mixed)
        self._window_start = self.step
        self._poll_window(wait=wait)

    def _poll_window(self, wait: bool = False) -> None:
        """Hand a finished copy to the agent; waits for the device only when `wait`."""
        if self._snapshot is None:
            return
        first, steps, version, phy2log, host, event, mixed = self._snapshot
        if event is not None:
            if wait:
                event.synchronize()
            elif not event.query():
                return
        self._snapshot = None
        physical = host.numpy().astype(np.int64)
        logical = logical_counts(physical, phy2log, self.num_logical)
        self.agent.submit_window(first, steps, version, logical, None if mixed else physical)
        self.stats.windows += 1

    def _apply(self, version: int) -> None:
        """Install committed plan `version` with SGLang's updater, one layer at a time,
        every layer confirmed by every rank (see the package docstring)."""
        from sglang.srt.eplb.eplb_manager import update_expert_location_with_recovery
        from sglang.srt.eplb.expert_location import (
            ExpertLocationMetadata,
            get_global_expert_location_metadata,
        )
        from sglang.srt.runtime_context import get_exec

        start = time.perf_counter()
        with self._lock:
            new = self._staged.pop(version)
        manager = self.manager
        model = manager._get_model()
        weights = model.routed_experts_weights_of_layer
        target = ExpertLocationMetadata.init_by_mapping(
            manager._model_config, torch.from_numpy(new.copy()), moe_ep_rank=self.rank)
        before = ExpertLocationMetadata.init_by_mapping(
            manager._model_config, torch.from_numpy(self.phy2log.copy()), moe_ep_rank=self.rank)
        local = slice(self.rank * self.slots_per_rank, (self.rank + 1) * self.slots_per_rank)
        weight_updater = manager._get_weight_updater()
        dispatch_algorithm = get_exec().moe.ep_dispatch_algorithm

        for layer in sorted(weights):
            moves_here = not np.array_equal(self.phy2log[layer, local], new[layer, local])
            saved = [t.clone() for t in weights[layer]] if moves_here else None
            moved, error = False, ""
            try:
                self.before_layer(version, layer)
                update_expert_location_with_recovery(
                    expert_location_updater=manager._get_expert_location_updater(),
                    model=model,
                    new_expert_location_metadata=target,
                    update_layer_ids=[layer],
                    tp_rank=self.rank,
                    expert_backup_client=manager._get_expert_backup_client(),
                    update_weights_from_disk_callable=getattr(weight_updater, "update_weights_from_disk", None),
                    ep_dispatch_algorithm=dispatch_algorithm,
                    init_lplb_solvers_callable=self._rebuild_lp_solvers,
                )
                moved = True
            except Exception as exc:  # a peer lost mid-transfer: this layer is untouched
                error = works.reason(exc)
            all_moved = self._layer_done(moved)
            if all_moved:
                self.phy2log[layer] = new[layer]
                continue
            if moved:  # this rank's copy of the layer moved, a peer's did not: undo it
                if saved is not None:
                    for tensor, copy in zip(weights[layer], saved, strict=True):
                        tensor.copy_(copy)
                get_global_expert_location_metadata().update(before, update_layer_ids=[layer])
                self._rebuild_lp_solvers()
            self._fail(version, layer, error or "a peer did not finish the layer")
            return
        # Layers without routed weights (dense ones) have a map row but nothing to move.
        weightless = [layer for layer in range(self.num_layers) if layer not in weights]
        if weightless:
            get_global_expert_location_metadata().update(target, update_layer_ids=weightless)
            self.phy2log[weightless] = new[weightless]
            self._rebuild_lp_solvers()
        self.version = version
        self._ticket = ticket(version, 0)
        self.stats.update_seconds.append(time.perf_counter() - start)
        self.stats.commits.append((self.step, version))
        self.agent.report(version, pb.PLAN_PHASE_COMMITTED, step=self.step)
        log.info("rank %d: installed v%d at pass %d", self.rank, version, self.step)

    def _layer_done(self, moved: bool) -> bool:
        """All-reduce(MIN) of "this layer moved" over every rank; False if any rank's did
        not, or a rank is gone."""
        flag = torch.tensor([1 if moved else 0], dtype=torch.int64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._layer_group)
        except RuntimeError:
            return False
        return bool(flag.item())

    def _fail(self, version: int, layer: int, error: str) -> None:
        self.broken = f"v{version} stopped at layer {layer}: {error}"
        message = (f"update lost a peer at layer {layer} ({error}); layers before it are on "
                   f"v{version}, from it on v{self.version}; no more plans on this group")
        log.error("rank %d: %s", self.rank, message)
        # What this rank serves now: the controller records it (a mixed placement).
        self.agent.report(version, pb.PLAN_PHASE_FAILED, error=message[:500], serving=self.phy2log.copy())

    def before_layer(self, version: int, layer: int) -> None:
        """Called before each layer of an update; raising fails that layer. A seam for
        fault injection in tests."""

    def _swap(self, agreed: int) -> None:
        """Staged mode, at the agreed pass: the next group's staged experts are copied into
        the live rows (local copies, nothing crosses ranks) and SGLang's maps of its layers
        are updated in place (`ExpertLocationMetadata.update`: the captured tensors stay)."""
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        start = time.perf_counter()
        plan = self._plan
        assert plan is not None and self.executor is not None
        group = plan.swapped
        layers = list(plan.groups[group]) if plan.groups else []
        if plan.groups:
            self.executor.commit(ticket(plan.version, group + 1))
        if group == 0:  # layers without routed weights: their map rows move with the first
            layers += plan.weightless
        if layers:
            get_global_expert_location_metadata().update(plan.target, update_layer_ids=sorted(layers))
            self.phy2log[layers] = plan.new[layers]
            self._rebuild_lp_solvers()
        self.stats.swap_seconds.append(time.perf_counter() - start)
        with self._lock:
            plan.swapped = group + 1
            self._ticket = agreed
            done = plan.swapped >= max(1, len(plan.groups))
            if done:
                self._plan = None
        if not done:  # the next group is staged beside serving, then swapped at its own pass
            self._start_staging(plan, plan.swapped)
            return
        self.version = plan.version
        self.stats.groups.append(len(plan.groups))
        self.stats.commits.append((self.step, plan.version))
        self.agent.report(plan.version, pb.PLAN_PHASE_COMMITTED, step=self.step)
        log.info("rank %d: v%d live at pass %d (%d layer group(s))", self.rank, plan.version,
                 self.step, len(plan.groups))

    def planned_survivors(self, lost: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """SGLang's fault path lost `lost`: the survivor placement the controller planned for
        exactly that loss on the placement this rank serves, laid out as SGLang's
        elasticity-aware algorithm answers (fault.full_width), or None (no plan, another
        base version, a plan in the middle of a swap, a plan that does not fit)."""
        if self.faulted is not None or (self._plan is not None and self._plan.swapped > 0):
            return None  # not a placement the controller holds: nothing was planned on it
        planned = self.agent.survivor_map(lost, self.version)
        if planned is None:
            return None
        from worker_hooks.engines.sglang.fault import full_width

        phy2log, log2phy, logcnt = full_width(np.asarray(planned, dtype=np.int64), lost, self.num_gpus,
                                              self.num_logical)
        if phy2log.shape != (self.num_layers, self.num_slots):
            return None
        return phy2log, log2phy, logcnt

    def after_rank_fault(self, lost: tuple[int, ...], planned: bool) -> None:
        """SGLang's fault path installed a placement on the survivors (the planned one, or
        its own): this rank serves it from now on. The controller cannot adopt a placement
        no plan of its own describes, and the group has dead ranks its plans would place
        experts on, so the adapter tells it the truth as a FAILED report of the version it
        served, carrying the placement now served: the controller records it as the
        deployment's mixed placement (it is what the ranks serve, no plan starts on top of
        it, a restarted group clears it). From here the adapter takes no plans and runs no
        collective of its own (its groups hold the dead ranks); its windows go on with the
        logical counts and state the placement served (version, digest)."""
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        self._flush_window(wait=True)  # the counts so far were taken on the old placement
        served = get_global_expert_location_metadata().physical_to_logical_map_cpu.numpy().astype(np.int64)
        with self._lock:
            self.faulted = tuple(lost)
            self.broken = self.broken or f"ranks {list(lost)} lost (SGLang's elastic EP fault path)"
            self._staged.clear()
        self.agreement.broken = self.agreement.broken or "rank fault"
        self.phy2log[:] = served
        self.stats.rank_faults.append({"step": self.step, "lost": list(lost), "planned": planned})
        how = (f"the survivor placement the controller planned on v{self.version}" if planned
               else "SGLang's own placement (no planned survivor placement held by every rank)")
        message = (f"ranks {list(lost)} lost: SGLang's elastic EP serves {how} on the survivors "
                   f"outside any plan; no more plans on this group until it restarts")
        log.error("rank %d: %s", self.rank, message)
        self.agent.report(self.version, pb.PLAN_PHASE_FAILED, error=message[:500], serving=served.copy())

    def _rebuild_lp_solvers(self) -> None:
        """After the expert location metadata changed, what SGLang's own update does
        (`update_expert_location_with_recovery`): with `--ep-dispatch-algorithm lp`, the
        per-layer LP solvers are rebuilt from the metadata now served
        (`init_lplb_solvers`), so the dispatch weighs the new replicas, never the old."""
        from sglang.srt.runtime_context import get_exec

        if get_exec().moe.ep_dispatch_algorithm != "lp":
            return
        from sglang.srt.model_executor.model_runner_components.moe_ep_setup import init_lplb_solvers

        init_lplb_solvers(model_config=self.manager._model_config)

    def _start_staging(self, plan: StagedPlan, group: int) -> None:
        plan.thread = threading.Thread(target=self._stage, args=(plan, group), daemon=True,
                                       name=f"sglang-stage-v{plan.version}-g{group}")
        plan.thread.start()

    def _stage(self, plan: StagedPlan, group: int) -> None:
        """Background thread: receive group `group`'s incoming experts into staging over
        the adapter's own group (worker_hooks.migrate, after the transfer fence). Group 0
        ends in PREPARED; a later group (the plan is committed) in a swap at an agreed pass,
        or, when a peer is lost, in FAILED with the mixed placement this rank serves."""
        version = plan.version
        key = ticket(version, group + 1)
        try:
            if group == 0:
                from sglang.srt.eplb.expert_location import ExpertLocationMetadata

                plan.target = ExpertLocationMetadata.init_by_mapping(
                    self.manager._model_config, torch.from_numpy(plan.new.copy()), moe_ep_rank=self.rank)
            self.before_staging(version, group)
            if plan.groups:
                assert self.executor is not None
                layers = np.asarray(plan.groups[group])
                moves = plan.transfers[np.isin(plan.transfers[:, 0], layers)]
                stats = self.executor.prepare(key, moves)
                self.stats.bytes_received += stats.bytes_received
                received, seconds = stats.bytes_received, stats.seconds
            else:
                received, seconds = 0, 0.0
        except MigrationAborted:
            return  # on_abort dropped it and reported
        except Exception as exc:
            if self.executor is not None:
                self.executor.abort(key)
            self._staging_failed(plan, group, exc)
            return
        with self._lock:
            if self._plan is not plan:  # aborted meanwhile
                return
            plan.staged = group + 1
        if group == 0:
            self.stats.prepared += 1
            self.agent.report(version, pb.PLAN_PHASE_PREPARED, bytes_received=received, seconds=seconds)

    def _staging_failed(self, plan: StagedPlan, group: int, exc: Exception) -> None:
        error = works.reason(exc)
        with self._lock:
            if self._plan is plan:
                self._plan = None
        if group == 0:  # before the commit: the plan aborts everywhere, nothing live changed
            log.error("rank %d: staging v%d failed: %s", self.rank, plan.version, error)
            self.agent.report(plan.version, pb.PLAN_PHASE_FAILED, error=error[:500])
            return
        # After the commit (a later group): the swapped groups stay, every map matching
        # its weights; the controller records the mixed placement (as for SGLang's updater).
        self.broken = f"v{plan.version} stopped at layer group {group}: {error}"
        message = (f"staging layer group {group} of v{plan.version} failed ({error}); layers "
                   f"{[x for g in plan.groups[:group] for x in g]} are on v{plan.version}, the "
                   f"others on v{self.version}; no more plans on this group")
        log.error("rank %d: %s", self.rank, message)
        self.agent.report(plan.version, pb.PLAN_PHASE_FAILED, error=message[:500], serving=self.phy2log.copy())

    def before_staging(self, version: int, group: int) -> None:
        """Called on the staging thread before each group's transfers; raising fails the
        group. A seam for fault injection in tests."""

    # ------------------------------------------------------------ agent thread

    def on_prepare(self, prepare: pb.Prepare) -> None:
        """Check the plan; in staged mode start receiving its first layer group beside
        serving (PREPARED once staged), with SGLang's updater only stage the map (weights
        move after the commit, in SGLang's forward loop)."""
        version = prepare.version
        try:
            if self.broken is not None:
                raise InputError(f"rank stopped taking plans ({self.broken})")
            if prepare.base_version != self.version:
                raise InputError(f"plan is based on v{prepare.base_version}, rank serves v{self.version}")
            with self._lock:
                if self._plan is not None:
                    raise InputError(f"rank is still installing v{self._plan.version}")
            new = np.array(codec.decode_phy2log(
                prepare.placement.phy2log, self.num_layers, self.num_slots, self.num_logical), dtype=np.int64)
            transfers = codec.decode(prepare.transfers, "transfers") if self.updater == "staged" else None
        except InputError as exc:
            log.error("rank %d: plan v%d refused: %s", self.rank, version, exc)
            if self.executor is not None and self.updater == "staged":
                try:  # its peers stop waiting for this rank's transfers at once
                    self.executor.decline(ticket(version, 1), str(exc))
                except TransfersDeclined:
                    pass
            self.agent.report(version, pb.PLAN_PHASE_FAILED, error=str(exc)[:500])
            return
        if transfers is None:
            with self._lock:
                self._staged = {version: new}
            self.stats.prepared += 1
            self.agent.report(version, pb.PLAN_PHASE_PREPARED)
            return
        plan = self._staged_plan(version, new, np.asarray(transfers, dtype=np.int64).reshape(-1, 5))
        with self._lock:
            self._plan = plan
        self._start_staging(plan, 0)

    def _staged_plan(self, version: int, new: np.ndarray, transfers: np.ndarray) -> StagedPlan:
        """The plan's layer groups within the staging budget (the same on every rank)."""
        with_weights = set(self.weight_layers)
        changed = [int(layer) for layer in np.flatnonzero((new != self.phy2log).any(axis=1))]
        moves = transfers[np.isin(transfers[:, 0], sorted(with_weights))]
        groups = layer_groups(moves, [x for x in changed if x in with_weights], self.num_gpus,
                              self._expert_bytes(), self.config.staging_budget_bytes)
        return StagedPlan(version, new, moves, groups, [x for x in changed if x not in with_weights])

    def on_commit(self, version: int) -> None:
        with self._lock:
            self._commit_ready = max(self._commit_ready, version)

    def on_abort(self, version: int, reason: str) -> None:
        with self._lock:
            self._staged.pop(version, None)
            plan = self._plan
            if plan is not None and plan.version == version and plan.swapped == 0:
                self._plan = None
            else:
                plan = None
        if plan is not None and self.executor is not None:
            self.executor.abort(ticket(version, 1))  # drops the staging, also mid-transfer
        self.stats.aborted += 1
        log.warning("rank %d: plan v%d aborted: %s", self.rank, version, reason)
        self.agent.report(version, pb.PLAN_PHASE_ABORTED)
