"""One SGLang rank's side of the rebalancer: SGLang's glue on the engine-neutral rank
session (worker_hooks/session/): counts from SGLang's recorder, plans staged beside
serving and swapped at an agreed pass, or moved between passes at an agreed pass by
SGLang's own updater.

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
from rebalancer.wire.shape import ClusterShape
from worker_hooks import works
from worker_hooks.agree import CommitAgreement
from worker_hooks.config import MigrationConfig
from worker_hooks.engines import require_engine
from worker_hooks.engines.sglang.config import SGLangAdapterConfig, Updater, choose_updater
from worker_hooks.fence import TransfersDeclined
from worker_hooks.migration import MigrationExecutor
from worker_hooks.session.rank import RankSession, SessionStats
from worker_hooks.session.staging import GroupStaging, StagedPlan, ticket, ticket_parts
from worker_hooks.transports.p2p import P2PTransport
from worker_hooks.weights import LayerWeights

log = logging.getLogger("worker_hooks.engines.sglang")


@dataclass
class AdapterStats(SessionStats):
    update_seconds: list[float] = field(default_factory=list)  # SGLang's updater, per plan
    swap_seconds: list[float] = field(default_factory=list)  # staged: per group swap
    groups: list[int] = field(default_factory=list)  # staged: groups per committed plan
    rank_faults: list[dict[str, Any]] = field(default_factory=list)  # SGLang's fault path runs


class SGLangRebalanceAdapter(RankSession):
    """Lives on SGLang's model-executing thread (`on_forward_pass_end`, `add_pass_counts`);
    the plan handlers run on the agent thread and only stage a map or set a version."""

    def __init__(self, config: SGLangAdapterConfig, manager: Any) -> None:
        require_engine("sglang.srt.eplb.expert_location", "SGLang", "sglang")
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
        from sglang.srt.runtime_context import get_parallel

        metadata = get_global_expert_location_metadata()
        if metadata is None:
            raise InputError(
                "SGLang has no expert location metadata: the model has no routed experts"
            )
        self.manager = manager
        self.num_gpus = int(metadata.ep_size)
        phy2log = metadata.physical_to_logical_map_cpu.numpy().astype(np.int64)
        weights = manager._get_model().routed_experts_weights_of_layer
        self.weight_layers = sorted(weights)
        self.expert_bytes = (
            int(sum(t[0].numel() * t.element_size() for t in weights[self.weight_layers[0]]))
            if weights
            else 0
        )
        shape = ClusterShape(
            num_layers=phy2log.shape[0],
            num_logical=int(metadata.num_logical_experts),
            num_slots=phy2log.shape[1],
            num_gpus=self.num_gpus,
            num_nodes=int(get_parallel().nnodes),
            expert_bytes=self.expert_bytes,
        )
        # SGLang hands the updater tp_rank as the EP rank (EPLBManager.rebalance).
        super().__init__(config, int(get_parallel().tp_rank), shape, phy2log, AdapterStats())
        self.config: SGLangAdapterConfig = config
        self.stats: AdapterStats
        self.slots_per_rank = self.num_slots // self.num_gpus
        self.faulted: tuple[int, ...] | None = None  # ranks lost in SGLang's fault path
        self._live_slots: torch.Tensor | None = (
            None  # after it: the survivors' slots of SGLang's [L, P]
        )
        # SGLang's EP world and this rank in it: they keep their width and numbers after a
        # rank fault, where the controller's world shrinks (after_rank_fault).
        self.ep_size, self.ep_rank = self.num_gpus, self.rank
        self.ranks_per_node = max(1, self.num_gpus // max(1, int(shape.num_nodes)))
        self._finished = False
        self._ticket = 0  # what is live (staging.ticket)
        # Groups of the adapter's own, so its collectives never interleave with SGLang's.
        # Every rank builds them at the same (first) forward pass.
        timeout = timedelta(seconds=config.agree_timeout_seconds)
        self._agree_group = dist.new_group(backend="gloo", timeout=timeout)
        self._layer_group = dist.new_group(backend="gloo", timeout=timeout)
        self.agreement = CommitAgreement(self._agree_group, config.agree_every)
        executor: MigrationExecutor | None = None
        backend: Literal["nccl", "gloo"] = "gloo"
        if weights:
            # The adapter's own group for weights (NCCL on GPU, gloo on CPU), never SGLang's.
            backend = P2PTransport.group_backend(weights[self.weight_layers[0]][0].device)
            self._migrate_group = dist.new_group(backend=backend, timeout=timeout)
            executor = MigrationExecutor(
                self.rank,
                self.num_gpus,
                self._layer_weights(weights),
                self._migrate_group,
                MigrationConfig(transport="p2p"),
            )
        self.executor = executor
        self.staging = GroupStaging(
            self,
            executor,
            self.weight_layers,
            self.num_gpus,
            self.expert_bytes,
            config.staging_budget_bytes,
            self._target_of,
        )
        # Staged beside serving on gloo; between passes with SGLang's updater on NCCL
        # (config.choose_updater says why). Read at each Prepare.
        self.updater: Updater
        self.updater, warning = choose_updater(config.updater, backend)
        if warning:
            log.warning("rank %d: %s", self.rank, warning)
        self.agent.start()
        log.info(
            "rank %d: rebalancer adapter on (%s, deployment %s, %d layers, %d slots, %s update, "
            "weights over %s)",
            self.rank,
            config.link.address,
            config.link.deployment,
            self.num_layers,
            self.num_slots,
            self.updater,
            backend,
        )

    @staticmethod
    def _layer_weights(weights: dict[int, list[torch.Tensor]]) -> LayerWeights:
        """SGLang's live expert tensors (`[local slots, ...]` per layer, a list of them)
        as the executor's per-layer weights."""
        count = len(next(iter(weights.values())))
        return {
            f"w{i}": {layer: tensors[i] for layer, tensors in weights.items()} for i in range(count)
        }

    # ------------------------------------------------------------ SGLang's thread

    def add_pass_counts(self, global_physical_count: torch.Tensor) -> None:
        """One recorded pass: this rank's tokens per physical slot, `[L, P]` (device); after
        a rank fault, the survivors' slots only (the world the controller knows)."""
        if self._live_slots is not None:
            if (
                self._live_slots.device != global_physical_count.device
            ):  # once: the index lives with the counts
                self._live_slots = self._live_slots.to(global_physical_count.device)
            global_physical_count = global_physical_count[:, self._live_slots]
        self.windows.add(global_physical_count)

    def on_forward_pass_end(self) -> None:
        """Once per forward pass on every rank (SGLang's passes are in lockstep)."""
        self.step += 1
        self.stats.steps += 1
        self.windows.poll()
        if self.faulted is None:  # else the adapter's groups hold dead ranks: windows only
            agreed = self.agreement.on_step(self.step, self._ready_ticket(), serving=self._ticket)
            if self.broken is None and agreed is not None and agreed > self._ticket:
                self._close_window(wait=True)  # a window never straddles two placements
                version, groups_done = ticket_parts(agreed)
                if groups_done:
                    self._swap(agreed)
                else:
                    self._apply(version)
                return
        if self.window_due():
            self._close_window()

    def _ready_ticket(self) -> int:
        """The newest ticket this rank can switch to: the next staged group of a plan the
        controller said to commit, SGLang's updater's committed plan, or what is live."""
        staged = self.staging.ready_ticket(self.plans.committed, self._ticket)
        if staged is not None:
            return staged
        ready = self.plans.ready(self.version)
        return ticket(ready, 0) if ready > self.version else self._ticket

    def _close_window(self, wait: bool = False) -> None:
        # Between the swaps of a plan's groups the map is one no version names: only the
        # logical counts go up then.
        plan = self.staging.plan
        mixed = plan is not None and plan.swapped > 0
        self.windows.close(self.step, self.version, self.phy2log, mixed=mixed, wait=wait)

    def finish(self, timeout: float = 5.0) -> None:
        """At shutdown (the plugin calls it at the process's exit): send the last window,
        deliver what the agent holds within `timeout`, stop it. Once; later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        try:
            super().finish(timeout)
        finally:
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
        new = self.plans.take(version)
        assert new is not None
        manager = self.manager
        model = manager._get_model()
        weights = model.routed_experts_weights_of_layer
        target = ExpertLocationMetadata.init_by_mapping(
            manager._model_config, torch.from_numpy(new.copy()), moe_ep_rank=self.ep_rank
        )
        before = ExpertLocationMetadata.init_by_mapping(
            manager._model_config, torch.from_numpy(self.phy2log.copy()), moe_ep_rank=self.ep_rank
        )
        local = slice(self.ep_rank * self.slots_per_rank, (self.ep_rank + 1) * self.slots_per_rank)
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
                    tp_rank=self.ep_rank,
                    expert_backup_client=manager._get_expert_backup_client(),
                    update_weights_from_disk_callable=getattr(
                        weight_updater, "update_weights_from_disk", None
                    ),
                    ep_dispatch_algorithm=dispatch_algorithm,
                    init_lplb_solvers_callable=self._rebuild_lp_solvers,
                )
                moved = True
            except Exception as exc:  # a peer lost mid-transfer: this layer is untouched
                error = works.reason(exc)
            if self._layer_done(moved):
                self.phy2log[layer] = new[layer]
                continue
            if moved:  # this rank's copy of the layer moved, a peer's did not: undo it
                if saved is not None:
                    for tensor, copy in zip(weights[layer], saved, strict=True):
                        tensor.copy_(copy)
                get_global_expert_location_metadata().update(before, update_layer_ids=[layer])
                self._rebuild_lp_solvers()
            error = error or "a peer did not finish the layer"
            self.stopped(
                version,
                f"update lost a peer at layer {layer} ({error}); layers before it are on "
                f"v{version}, from it on v{self.version}",
            )
            return
        # Layers without routed weights (dense ones) have a map row but nothing to move.
        weightless = [layer for layer in range(self.num_layers) if layer not in weights]
        if weightless:
            get_global_expert_location_metadata().update(target, update_layer_ids=weightless)
            self._rebuild_lp_solvers()
        self._ticket = ticket(version, 0)
        self.stats.update_seconds.append(time.perf_counter() - start)
        self.made_live(version, new)

    def _layer_done(self, moved: bool) -> bool:
        """All-reduce(MIN) of "this layer moved" over every rank; False if any rank's did
        not, or a rank is gone."""
        flag = torch.tensor([1 if moved else 0], dtype=torch.int64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._layer_group)
        except RuntimeError:
            return False
        return bool(flag.item())

    def before_layer(self, version: int, layer: int) -> None:
        """Called before each layer of an update; raising fails that layer. A seam for
        fault injection in tests."""

    def _swap(self, agreed: int) -> None:
        """Staged mode, at the agreed pass: the next group's staged experts are copied into
        the live rows (local copies, nothing crosses ranks) and SGLang's maps of its layers
        are updated in place (`ExpertLocationMetadata.update`: the captured tensors stay)."""
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        start = time.perf_counter()
        plan, layers, done = self.staging.swap_next()
        if layers:
            get_global_expert_location_metadata().update(plan.target, update_layer_ids=layers)
            self.phy2log[layers] = plan.new[layers]
            self._rebuild_lp_solvers()
        self.stats.swap_seconds.append(time.perf_counter() - start)
        self._ticket = agreed
        if done:
            self.stats.groups.append(len(plan.groups))
            self.made_live(plan.version, plan.new)

    def _target_of(self, plan: StagedPlan) -> None:
        """Staging thread, before the first group: SGLang's metadata of the plan's map."""
        from sglang.srt.eplb.expert_location import ExpertLocationMetadata

        plan.target = ExpertLocationMetadata.init_by_mapping(
            self.manager._model_config, torch.from_numpy(plan.new.copy()), moe_ep_rank=self.ep_rank
        )

    def planned_survivors(
        self, lost: tuple[int, ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """SGLang's fault path lost `lost`: the survivor placement the controller planned for
        exactly that loss on the placement this rank serves, laid out as SGLang's
        elasticity-aware algorithm answers (fault.full_width), or None (no plan, another
        base version, a plan in the middle of a swap, a plan that does not fit)."""
        plan = self.staging.plan
        if self.faulted is not None or (plan is not None and plan.swapped > 0):
            return None  # not a placement the controller holds: nothing was planned on it
        planned = self.agent.survivor_map(lost, self.version)
        if planned is None:
            return None
        from worker_hooks.engines.sglang.fault import full_width

        phy2log, log2phy, logcnt = full_width(
            np.asarray(planned, dtype=np.int64), lost, self.num_gpus, self.num_logical
        )
        if phy2log.shape != (self.num_layers, self.num_slots):
            return None
        return phy2log, log2phy, logcnt

    def after_rank_fault(self, lost: tuple[int, ...], planned: bool) -> None:
        """SGLang's fault path installed a placement on the survivors (planned, or its own)
        at full width, the lost ranks' slots out of every replica list. The survivors are
        a smaller world now (fault.survivors_world), which each one registers as a resize
        (`RankSession.rejoin_resized`): the controller commits the placement served under
        a new version, which the windows count from here (no silent drift). The adapter
        takes no plans and runs no collective of its own (its groups hold the dead
        ranks) until the group restarts."""
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        self._close_window(wait=True)  # the counts so far were taken on the old placement
        served = (
            get_global_expert_location_metadata()
            .physical_to_logical_map_cpu.numpy()
            .astype(np.int64)
        )
        self.faulted = tuple(lost)
        self.agreement.broken = self.agreement.broken or "rank fault"
        self.stats.rank_faults.append({"step": self.step, "lost": list(lost), "planned": planned})
        how = (
            f"the survivor placement the controller planned on v{self.version}"
            if planned
            else "SGLang's own placement (no planned survivor placement held by every rank)"
        )
        if self.ep_rank in lost:
            # This rank is one SGLang marked inactive: it serves nothing from here, and the
            # map it holds is not what the survivors serve (SGLang moves nothing onto it), so
            # it must not be what the controller records: its agent stops.
            self.broken = self.broken or f"rank {self.rank} marked inactive"
            self.plans.clear()
            log.warning(
                "rank %d: marked inactive by SGLang's elastic EP; it reports no placement",
                self.rank,
            )
            self.agent.stop(timeout=0.0)
            return
        from worker_hooks.engines.sglang.fault import survivors_world

        survivors, live, shape = survivors_world(
            self.agent.config.shape, lost, self.ep_size, self.slots_per_rank, self.ranks_per_node
        )
        self._live_slots = torch.from_numpy(live)
        log.warning(
            "rank %d: ranks %s lost; SGLang's elastic EP serves %s on the %d survivors",
            self.rank,
            list(lost),
            how,
            len(survivors),
        )
        self.rejoin_resized(
            survivors.index(self.ep_rank),
            shape,
            served[:, live],
            f"ranks {list(lost)} lost: SGLang's elastic EP group holds them until it restarts",
        )

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

    # ------------------------------------------------------------ agent thread

    def refusal(self) -> None:
        super().refusal()
        plan = self.staging.plan
        if plan is not None:
            raise InputError(f"rank is still installing v{plan.version}")

    def refuse(self, version: int, why: str) -> None:
        if self.executor is not None and self.updater == "staged":
            try:  # its peers stop waiting for this rank's transfers at once
                self.executor.decline(ticket(version, 1), why)
            except TransfersDeclined:
                pass
        super().refuse(version, why)

    def stage_plan(self, prepare: pb.Prepare, new: np.ndarray) -> None:
        """In staged mode start receiving the plan's first layer group beside serving
        (PREPARED once staged); with SGLang's updater only stage the map (weights move
        after the commit, in SGLang's forward loop)."""
        if self.updater != "staged":
            super().stage_plan(prepare, new)
            return
        try:
            transfers = codec.decode(prepare.transfers, "transfers")
        except InputError as exc:
            self.refuse(prepare.version, str(exc))
            return
        self.staging.begin(
            prepare.version, new, np.asarray(transfers, dtype=np.int64).reshape(-1, 5)
        )

    def dropped(self, version: int) -> None:
        self.staging.abort(version)
