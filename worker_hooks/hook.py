"""What an inference process wires into its forward loop.

    hook = RebalanceHook(config, phy2log, weights, agree_group, migrate_group)
    hook.start()
    for each step:
        for each MoE layer:
            phys = hook.route(layer, topk_ids)   # record + logical -> physical
            ... expert compute on the live weights ...
        hook.step_end()                          # windows, agreed commits

The per-step work is O(1) host work plus graph-safe tensor ops: counts are
recorded into static tensors, a finished window is handed to the agent
without waiting, and a commit (when every rank agreed) is in-place copies of
map tables, plus the staged weights of any expert that found no spare row
(`CommitConfig.spare_rows`, worker_hooks/rows.py: with enough of them a commit copies no
weight). This file is that hot path and the start and stop around it (a pool's warm
start included); nothing else: the plan driver
(worker_hooks/plans.py) prepares plans on migration threads for the agent
(worker_hooks/agent.py), which talks to the controller on its own thread; count files
are worker_hooks/counts.py's; the settings worker_hooks/config.py's.

With spare rows the weights are `[L, S + R, ...]` and `route` returns row ids
(`rank * (S + R) + row`, see `rows_per_rank`), which the expert compute indexes
exactly as it would slot ids; physical counts still reach the controller by slot.

`HookConfig.dispatch.mode` picks how an expert's tokens are divided among its replicas
(rebalancer.wire.dispatch): `split` (the hash split, default), `load` or `load+shared`
(by this step's load: one all-gather of `[G, X]` counts per layer on `dispatch_group`,
worker_hooks/waterfill.py). With `shared_expert` the model's shared expert is counted as
expert E of every layer, and `route` returns one more column: the id
`num_rows + gpu` of the GPU that computes the token's shared expert (its own GPU except
under `load+shared`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.dispatch import has_shared_replicas
from rebalancer.wire.layout import check_phy2log
from worker_hooks import works
from worker_hooks.agent import AgentConfig, WorkerAgent
from worker_hooks.agree import CommitAgreement
from worker_hooks.config import (
    ClusterShape,
    CommitConfig,
    DispatchConfig,
    HookConfig,
    Link,
    MigrationConfig,
    PoolConfig,
    WindowConfig,
)
from worker_hooks.counts import add_window, count_arrays, write_count_file
from worker_hooks.devices import resolve_device
from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.migration import MigrationExecutor
from worker_hooks.plans import PlanDriver, dispatch_map
from worker_hooks.record import ExpertRecorder
from worker_hooks.rows import RowMap
from worker_hooks.serving import HookStats, ServedPlacement
from worker_hooks.session.windows import WindowPipeline, window_due
from worker_hooks.warm import await_offer, group_holds
from worker_hooks.weights import check_weights

__all__ = [
    "ClusterShape",
    "CommitConfig",
    "DispatchConfig",
    "HookConfig",
    "HookStats",
    "Link",
    "MigrationConfig",
    "PlanDriver",
    "PoolConfig",
    "RebalanceHook",
    "WindowConfig",
]

log = logging.getLogger("worker_hooks.hook")


def _checked_placement(phy2log: object, config: HookConfig) -> np.ndarray:
    """phy2log as int64 `[L, P]` of the config's sizes, every expert held in every layer
    (InputError, a ValueError, naming what is wrong)."""
    if isinstance(phy2log, torch.Tensor):
        phy2log = phy2log.detach().cpu().numpy()
    placement = check_phy2log(phy2log, config.shape.num_logical)
    if placement.shape != (config.shape.num_layers, config.shape.num_slots):
        raise InputError(
            f"phy2log has shape {list(placement.shape)}, the config says "
            f"[num_layers={config.shape.num_layers}, num_slots={config.shape.num_slots}]"
        )
    return placement


def _check_groups(**groups: dist.ProcessGroup | None) -> None:
    for name, group in groups.items():
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"{name} must be a torch.distributed group (dist.new_group(...)) or None, "
                f"got {type(group).__name__}"
            )


def agent_config(config: HookConfig) -> AgentConfig:
    """The agent's settings from the hook's: the link, and the shape told at Register."""
    return AgentConfig(config.link, config.rank, config.registered_shape)


def _recorder(config: HookConfig, device: torch.device) -> ExpertRecorder:
    """Counts by logical expert and, with `record_physical`, by row; with a shared expert
    its column E, and its G replicas at ids num_rows + g."""
    shared = 1 if config.shared_expert else 0
    return ExpertRecorder(
        config.shape.num_layers,
        config.shape.num_logical + shared,
        config.num_rows + shared * config.shape.num_gpus
        if config.windows.record_physical
        else None,
        device=device,
    )


def _dispatch(config: HookConfig, served: ServedPlacement, device: torch.device) -> ReplicaDispatch:
    d = config.dispatch
    return ReplicaDispatch(
        dispatch_map(config, served.phy2log, served.row_ids),
        config.shape.num_gpus,
        config.rank,
        max_replicas=config.shape.num_slots - config.shape.num_logical + 1,
        device=device,
        num_physical=config.num_rows,
        by_load=d.by_load,
        shared_expert=config.shared_expert,
        waterfill_passes=d.waterfill_passes,
        compiled=d.compile and d.by_load,
    )


class RebalanceHook:
    """The serving thread's side of rebalancing: `route` per MoE layer, `step_end` per
    step (module docstring); `start` / `finish` around serving."""

    def __init__(
        self,
        config: HookConfig,
        phy2log: np.ndarray,
        weights: dict[str, torch.Tensor],
        agree_group: dist.ProcessGroup | None,
        migrate_group: dist.ProcessGroup | None,
        device: torch.device | str = "cpu",
        dispatch_group: dist.ProcessGroup | None = None,
        counts_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
        plan_driver: type[PlanDriver] = PlanDriver,
        expert_source: Callable[[int, int], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """dispatch_group: the EP group the per-step counts are all-gathered on (dispatch
        by load; None: the default group). counts_gather: replaces that all-gather
        ([X] -> [G, X]; benchmarks on one GPU). plan_driver: the class that drives plans
        (a subclass checks or injects faults). expert_source: (layer, logical expert) ->
        that expert's weights by name (one row of each tensor of `weights`), what a warm
        start loads (a rank without it never installs one, and neither do its peers)."""
        if not isinstance(config, HookConfig):
            raise TypeError(f"config must be a HookConfig, got {type(config).__name__}")
        check_weights(
            weights
        )  # before anything starts: a clear TypeError, not one from deep inside
        _check_groups(
            agree_group=agree_group, migrate_group=migrate_group, dispatch_group=dispatch_group
        )
        self.config = config
        self.device = resolve_device(device)
        self.weights = weights
        rows = RowMap(
            config.shape.num_gpus,
            config.shape.num_layers,
            config.slots_per_rank,
            config.commit.spare_rows,
        )
        self.served = ServedPlacement(_checked_placement(phy2log, config), rows.row_ids())
        self.recorder = _recorder(config, self.device)
        self.dispatch = _dispatch(config, self.served, self.device)
        # Owns `rows` from here on: moves them at commit (worker_hooks/rows.py).
        self.executor = MigrationExecutor(
            config.rank,
            config.shape.num_gpus,
            weights,
            migrate_group,
            config.migration,
            row_map=rows,
        )
        self.agreement = CommitAgreement(agree_group, config.commit.agree_every)
        self.stats = HookStats()
        self.plans = plan_driver(config, self.executor, self.dispatch, self.served, self.stats)
        # The agent knows the plan driver and the served version, not the hook.
        self.agent = WorkerAgent(
            agent_config(config),
            self.plans,
            self.served.current_version,
            initial_phy2log=self.served.phy2log,
            served_map=self.served.current_map,
        )
        self.plans.report_to(self.agent.report)
        self._num_rows = config.num_rows
        self._by_load = config.dispatch.by_load
        self._shared_replicas = has_shared_replicas(config.dispatch.mode)
        self._record_physical = config.windows.record_physical
        self._dispatch_group = dispatch_group
        self._counts_gather = counts_gather
        self._agree_group = agree_group
        self._expert_source = expert_source
        self.step = 0
        # The session's window pipeline over the recorder's counters (one close rule and
        # copy for every engine and the hook).
        self.windows = WindowPipeline(self.agent, self.recorder.counts)

    @property
    def version(self) -> int:
        """The placement version this rank serves."""
        return self.served.version

    def survivor_map(self, lost_ranks: Collection[int]) -> np.ndarray | None:
        """The placement `[L, P']` the controller planned ahead for the survivors of losing
        `lost_ranks` (a rank, or a node's ranks), on the placement this rank serves; None
        when none was told for that loss, it was planned on another version, or no
        placement can serve every expert on the survivors. Works with the controller gone:
        an engine with its own elastic path (new rank i = the i-th surviving old rank)
        takes this map instead of improvising one."""
        return self.agent.survivor_map(lost_ranks, self.served.version)

    @property
    def phy2log(self) -> np.ndarray:
        """The placement served, `[L, P]`."""
        return self.served.phy2log

    @property
    def rows(self) -> RowMap:
        """The weight row of every rank's slots (read-only; the executor moves it)."""
        return self.executor.row_map

    def start(self) -> None:
        """Start the link; with a pool, install the pool's placement first if the
        controller offers one in time (`warm_start`). Call before the first step."""
        self.agent.start()
        if self.config.link.pool and self.step == 0 and self.served.version == 0:
            self.warm_start()

    def warm_start(self) -> bool:
        """Install the pool placement offered at Register (RegisterResponse.warm_start)
        before the first step, on every rank of the group or on none: the ranks agree on
        the offered version (worker_hooks/warm.py), load the experts they gain from
        `expert_source`, agree that every rank loaded them, then switch maps and weights
        and report the version committed (step 0), which the controller adopts. No
        offer within `pool.warm_start_seconds`, no controller, a rank without it: every
        rank starts on its start placement. Collective (`start` calls it on every rank).
        True if installed."""
        cfg = self.config
        offered, new = 0, None
        source = self._expert_source
        if source is not None and cfg.pool.warm_start_seconds > 0:
            offered, new = await_offer(
                self.agent,
                cfg.pool.warm_start_seconds,
                cfg.shape.num_layers,
                cfg.shape.num_slots,
                cfg.shape.num_logical,
                cfg.rank,
            )
        if not self._all_hold(offered) or new is None or source is None:
            log.info(
                "rank %d: no warm start (offered v%d); starting on the start placement",
                cfg.rank,
                offered,
            )
            return False
        gained: list[tuple[int, int, dict[str, torch.Tensor]]] = []
        try:
            S = cfg.slots_per_rank
            rows = self.rows.rows
            for layer in range(cfg.shape.num_layers):
                for s in range(S):
                    slot = cfg.rank * S + s
                    if new[layer, slot] != self.served.phy2log[layer, slot]:
                        gained.append(
                            (
                                layer,
                                int(rows[cfg.rank, layer, s]),
                                source(layer, int(new[layer, slot])),
                            )
                        )
            self.dispatch.stage(dispatch_map(cfg, new, self.served.row_ids))
            loaded = offered
        except Exception as exc:  # its peers must not switch alone
            log.error("rank %d: warm start v%d not loaded: %s", cfg.rank, offered, exc)
            loaded = 0
        if not self._all_hold(loaded):
            log.warning(
                "rank %d: warm start v%d not installed: a rank could not load it", cfg.rank, offered
            )
            return False
        for layer, row, expert in gained:
            for name, tensor in expert.items():
                self.weights[name][layer, row].copy_(tensor)
        self.dispatch.commit()
        self.served.switch(offered, new, self.rows.row_ids())
        self.stats.commits.append((self.step, offered))
        self.agent.report(offered, pb.PLAN_PHASE_COMMITTED, step=self.step)
        log.info(
            "rank %d: warm start: serving the pool placement v%d (%d experts loaded)",
            cfg.rank,
            offered,
            len(gained),
        )
        return True

    def _all_hold(self, version: int) -> bool:
        """Whether every rank of the group holds `version` (> 0)."""
        return group_holds(version, self._agree_group, self.config.shape.num_gpus, self.config.rank)

    def stop(self) -> None:
        self.agent.stop()

    def finish(self, timeout: float = 5.0, transfer_timeout: float = 30.0) -> bool:
        """At shutdown (not on the hot path): send the last partial window, give the
        agent up to `timeout` seconds to deliver what it holds, stop it, settle the
        last commit agreement and wait up to `transfer_timeout` for a plan being
        prepared. A plan arriving from now on still runs its transfers (peers wait for
        them) but is reported failed, so it aborts everywhere.

        Returns False when a transfer or a collective is still running (a peer left or
        froze mid-plan; worker_hooks/works.py): the process must then exit without
        tearing down its process groups."""
        deadline = time.monotonic() + timeout
        self.plans.close()
        self._close_window()
        while self.windows.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)
            self.windows.poll()
        self.agent.drain(max(0.0, deadline - time.monotonic()))
        done = self.plans.join(transfer_timeout)
        self.stop()
        done = self.agreement.close() and done and works.none_running()
        if done:
            # Drop the mappings of the peers' weights ("ipc"/"outbox"). A peer still
            # reading ours after we exit reads freed memory into staging, but that plan
            # cannot commit: the commit agreement needs every rank, us included.
            self.executor.close()
        return done

    def write_counts(self, path: str | Path) -> None:
        """Write what this rank recorded so far to a count file (`.json`, `.npz` or `.pt`;
        keys: worker_hooks/counts.py's `count_arrays`, read by rebalancer.formats.read_counts).

        Not on the hot path: call it from the serving thread, at the end of a run (after
        `finish`, which closes the last window) or on demand (the windows closed so far,
        every `windows.steps` steps; a window not yet closed is not in it). It holds this
        rank's picks: the files of all ranks sum to the deployment's."""
        write_count_file(path, count_arrays(self.config, self.stats), self.config.rank)

    # ------------------------------------------------------------ hot path

    def route(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Record `layer`'s routing and map logical ids `[T, K]` to physical slots.

        With `shared_expert` the result has K + 1 columns, the last one the id
        `num_rows + gpu` of the GPU computing each token's shared expert."""
        cfg = self.config
        ids = topk_ids
        if cfg.shared_expert:
            shared = torch.full_like(topk_ids[:, :1], cfg.shape.num_logical)
            ids = torch.cat([topk_ids, shared], dim=1)
        if not self._by_load:
            self.recorder.record(layer, ids)
            phys = self.dispatch.dispatch(layer, topk_ids)
            if cfg.shared_expert:
                own = torch.full_like(phys[:, :1], self._num_rows + cfg.rank)
                phys = torch.cat([phys, own], dim=1)
        else:
            # The picks per expert the water-fill needs are what the recorder counts:
            # counted once (one scatter-add over the picks fewer per layer and step).
            local = self.dispatch.count_picks(ids)
            self.recorder.add_logical_counts(layer, local)
            counts = self._gather_counts(local)
            phys = self.dispatch.dispatch_by_load(layer, ids, counts, self._shared_replicas)
        if self._record_physical:
            self.recorder.record_physical(layer, phys)
        return phys

    def _gather_counts(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's per-expert picks of this layer and step: [X] -> [G, X] int64."""
        if self._counts_gather is not None:
            return self._counts_gather(local)
        if self.config.shape.num_gpus == 1:
            return local.unsqueeze(0)
        out = local.new_empty(self.config.shape.num_gpus * local.shape[0])  # flat: gloo's form
        dist.all_gather_into_tensor(out, local, group=self._dispatch_group)
        return out.view(self.config.shape.num_gpus, local.shape[0])

    def step_end(self) -> None:
        """Call once per forward step, after the step, on every rank."""
        self.step += 1
        self.stats.steps += 1
        self.windows.poll()
        agreed = self.agreement.on_step(
            self.step, self.plans.ready_version(), serving=self.served.version
        )
        if agreed is not None and agreed > self.served.version:
            self._close_window()  # a window never mixes two placements
            self._commit(agreed)
        elif window_due(self.step, self.windows.start, self.config.windows.steps):
            self._close_window()

    def _close_window(self) -> None:
        """Close the open window on the placement served (non-blocking on GPU): its
        counts by row are read as slots with that placement's rows."""
        row_ids = self.served.row_ids.copy()

        def read(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
            logical, physical = self.recorder.split(flat)
            add_window(self.stats, self.config, logical, physical)
            self.stats.windows += 1
            logical = logical[
                :, : self.config.shape.num_logical
            ]  # the controller counts routed experts
            if physical is not None:  # counted by row: back to the slots the controller knows
                physical = np.take_along_axis(physical[:, : self._num_rows], row_ids, axis=1)
            return logical, physical

        self.windows.close_as(self.step, self.served.version, read)

    def _commit(self, version: int) -> None:
        """Switch to plan `version` at this step, agreed by every rank."""
        start = time.perf_counter()
        new, copied = self.plans.take_commit(version)  # weights live, rows moved
        self.stats.copied_at_commit += copied
        self.dispatch.commit()
        self.served.switch(version, new, self.rows.row_ids())
        self.stats.swap_seconds.append(time.perf_counter() - start)
        self.stats.commits.append((self.step, version))
        self.agent.report(version, pb.PLAN_PHASE_COMMITTED, step=self.step)
        log.info("rank %d: committed v%d at step %d", self.config.rank, version, self.step)
