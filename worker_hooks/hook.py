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
(`spare_rows`, worker_hooks/rows.py: with enough of them a commit copies no
weight). Preparing a plan (receiving weights) runs on a migration thread;
talking to the controller on the agent thread.

With spare rows the weights are `[L, S + R, ...]` and `route` returns row ids
(`rank * (S + R) + row`, see `rows_per_rank`), which the expert compute indexes
exactly as it would slot ids; physical counts still reach the controller by slot.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent
from worker_hooks.agree import CommitAgreement
from worker_hooks.devices import resolve_device
from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.migrate import MigrationAborted, MigrationConfig, MigrationExecutor, Transport
from worker_hooks.record import ExpertRecorder
from worker_hooks.rows import RowMap, replica_rows

log = logging.getLogger("worker_hooks.hook")


@dataclass(frozen=True)
class HookConfig:
    controller: str  # host:port of the controller
    deployment: str
    rank: int
    num_layers: int
    num_logical: int
    num_slots: int
    num_gpus: int
    num_nodes: int = 1
    expert_bytes: int = 0
    window_steps: int = 16  # steps per counts window
    agree_every: int = 4  # steps between commit agreements
    layers_per_chunk: int = 4
    # Weight transfers (worker_hooks/migrate.py): "p2p" (NCCL/gloo, any hosts), "ipc" or
    # "outbox" (copy engines between the GPUs of one host; migrate_group must be gloo).
    migrate_transport: Transport = "p2p"
    rounds_in_flight: int = 1
    outbox_bytes: int = 1 << 30
    max_migration_gbps: float = 0.0  # 0: unpaced
    # Spare weight rows per layer on each rank: incoming experts land there during
    # prepare and commit only swaps maps (worker_hooks/rows.py). 0: copy at commit.
    spare_rows: int = 0
    record_physical: bool = True
    worker_id: str = ""
    token: str | None = None        # bearer token of the deployment (controller's worker_tokens)
    ca_file: str | None = None      # TLS to the controller
    cert_file: str | None = None    # mutual TLS
    key_file: str | None = None

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or not 0 <= self.rank < self.num_gpus:
            raise ValueError(f"need 0 <= rank < num_gpus, got rank={self.rank}, num_gpus={self.num_gpus}")
        if self.num_slots % self.num_gpus:
            raise ValueError(f"num_slots={self.num_slots} is not a multiple of num_gpus={self.num_gpus}")
        _ = self.migration  # a bad transport or setting fails here, with its name

    @property
    def migration(self) -> MigrationConfig:
        """The migration settings (checked: a bad transport name raises ValueError)."""
        return MigrationConfig(
            transport=self.migrate_transport, layers_per_chunk=self.layers_per_chunk,
            rounds_in_flight=self.rounds_in_flight, outbox_bytes=self.outbox_bytes,
            max_gbps=self.max_migration_gbps,
        )

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_gpus

    @property
    def rows_per_rank(self) -> int:
        """Weight rows per layer on a rank: its slots plus the spare rows."""
        return self.slots_per_rank + self.spare_rows


@dataclass
class HookStats:
    steps: int = 0
    windows: int = 0
    commits: list[tuple[int, int]] = field(default_factory=list)  # (step, version)
    prepared: int = 0
    failed: int = 0
    aborted: int = 0
    bytes_received: int = 0
    swap_seconds: list[float] = field(default_factory=list)
    copied_at_commit: int = 0  # experts copied in commit pauses (none with enough spare rows)


class RebalanceHook(PlanHandlers):
    def __init__(
        self,
        config: HookConfig,
        phy2log: np.ndarray,
        weights: dict[str, torch.Tensor],
        agree_group: dist.ProcessGroup | None,
        migrate_group: dist.ProcessGroup | None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.device = resolve_device(device)
        self.version = 0
        self.phy2log = np.asarray(phy2log, dtype=np.int64)
        self.rows = RowMap(config.num_gpus, config.num_layers, config.slots_per_rank, config.spare_rows)
        self._row_ids = self.rows.row_ids()  # [L, P] row id of each slot, current version
        num_rows = config.num_gpus * config.rows_per_rank
        self.recorder = ExpertRecorder(
            config.num_layers,
            config.num_logical,
            num_rows if config.record_physical else None,
            device=self.device,
        )
        self.dispatch = ReplicaDispatch(
            self._row_map_of(self.phy2log, self._row_ids),
            config.num_gpus,
            config.rank,
            max_replicas=self._max_replicas,
            device=self.device,
            num_physical=num_rows,
        )
        self.weights = weights
        self.executor = MigrationExecutor(
            config.rank, config.num_gpus, weights, migrate_group, config.migration, row_map=self.rows
        )
        self.agreement = CommitAgreement(agree_group, config.agree_every)
        self.stats = HookStats()
        self.step = 0
        self._window_start = 0
        # (first step, steps, version, row ids of that version) of the window in flight
        self._snapshot: tuple[int, int, int, np.ndarray] | None = None
        self._migration: threading.Thread | None = None
        self._closing = False
        # Newest version the controller said to commit; read by the serving thread.
        self._commit_ready = 0
        self._staged_phy2log: dict[int, np.ndarray] = {}
        shape = pb.ModelShape(
            num_layers=config.num_layers,
            num_logical_experts=config.num_logical,
            num_physical_slots=config.num_slots,
            num_gpus=config.num_gpus,
            num_nodes=config.num_nodes,
            expert_bytes=config.expert_bytes,
        )
        self.agent = WorkerAgent(
            AgentConfig(
                config.controller, config.deployment, config.rank, shape, config.worker_id,
                token=config.token, ca_file=config.ca_file, cert_file=config.cert_file, key_file=config.key_file,
            ),
            self,
            lambda: self.version,
            initial_phy2log=self.phy2log,
        )

    @property
    def _max_replicas(self) -> int:
        return self.config.num_slots - self.config.num_logical + 1

    def _row_map_of(self, phy2log: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
        """Dispatch's map `[L, E, R]`: each expert's replicas as row ids, -1 padded."""
        return replica_rows(phy2log, row_ids, self.config.num_logical, self._max_replicas)

    def start(self) -> None:
        self.agent.start()

    def stop(self) -> None:
        self.agent.stop()

    def finish(self, timeout: float = 5.0, transfer_timeout: float = 30.0) -> bool:
        """At shutdown (not on the hot path): send the last partial window, give the
        agent up to `timeout` seconds to deliver what it holds, stop it, settle the
        last commit agreement and wait up to `transfer_timeout` for a plan being
        prepared. A plan arriving from now on still runs its transfers (peers wait for
        them) but is reported failed, so it aborts everywhere.

        Returns False when a transfer is still blocked (a peer left mid-plan): the
        process must then exit without tearing down its process groups."""
        deadline = time.monotonic() + timeout
        self._closing = True
        self._flush_window()
        while self._snapshot is not None and time.monotonic() < deadline:
            time.sleep(0.005)
            self._poll_window()
        self.agent.drain(max(0.0, deadline - time.monotonic()))
        migration = self._migration
        if migration is not None:
            migration.join(transfer_timeout)
        self.stop()
        self.agreement.close()
        done = migration is None or not migration.is_alive()
        if done:
            # Drop the mappings of the peers' weights ("ipc"/"outbox"). A peer still
            # reading ours after we exit reads freed memory into staging, but that plan
            # cannot commit: the commit agreement needs every rank, us included.
            self.executor.close()
        return done

    # ------------------------------------------------------------ hot path

    def route(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Record `layer`'s routing and map logical ids to physical slots."""
        self.recorder.record(layer, topk_ids)
        phys = self.dispatch.dispatch(layer, topk_ids)
        if self.config.record_physical:
            self.recorder.record_physical(layer, phys)
        return phys

    def step_end(self) -> None:
        """Call once per forward step, after the step, on every rank."""
        self.step += 1
        self.stats.steps += 1
        self._poll_window()
        ready = self._commit_ready if self._commit_ready in self._staged_phy2log else self.version
        agreed = self.agreement.on_step(self.step, ready)
        if agreed is not None and agreed > self.version:
            self._flush_window()  # a window never mixes two placements
            self._commit(agreed)
        elif self.step - self._window_start >= self.config.window_steps:
            self._flush_window()

    def _flush_window(self) -> None:
        """Close the current window: start its snapshot (non-blocking on GPU).

        If the previous snapshot is still in flight, the counts simply keep
        accumulating into the next window (merged, never queued)."""
        if self.step == self._window_start:
            return
        if self.recorder.begin_window():
            self._snapshot = (
                self._window_start, self.step - self._window_start, self.version, self._row_ids
            )
            self._window_start = self.step
        self._poll_window()

    def _poll_window(self) -> None:
        """Hand a finished snapshot to the agent; never waits for the device."""
        if self._snapshot is None:
            return
        window = self.recorder.poll_window()
        if window is None:
            return
        first_step, num_steps, version, row_ids = self._snapshot
        self._snapshot = None
        logical, physical = window
        if physical is not None:  # counted by row: back to the slots the controller knows
            physical = np.take_along_axis(physical, row_ids, axis=1)
        self.agent.submit_window(first_step, num_steps, version, logical, physical)
        self.stats.windows += 1

    def _commit(self, version: int) -> None:
        start = time.perf_counter()
        # Also moves self.rows to the plan's rows.
        self.stats.copied_at_commit += self.executor.commit(version)
        new = self._staged_phy2log.pop(version)
        self.dispatch.commit()
        self.version, self.phy2log = version, new
        self._row_ids = self.rows.row_ids()
        self.stats.swap_seconds.append(time.perf_counter() - start)
        self.stats.commits.append((self.step, version))
        self.agent.report(version, pb.PLAN_PHASE_COMMITTED, step=self.step)
        log.info("rank %d: committed v%d at step %d", self.config.rank, version, self.step)

    # ------------------------------------------------------------ agent thread

    def on_prepare(self, prepare: pb.Prepare) -> None:
        self._migration = threading.Thread(
            target=self._prepare, args=(prepare,), daemon=True, name=f"migrate-v{prepare.version}"
        )
        self._migration.start()

    def _prepare(self, prepare: pb.Prepare) -> None:
        version = prepare.version
        try:
            if prepare.base_version != self.version:
                raise RuntimeError(
                    f"plan is based on v{prepare.base_version}, rank serves v{self.version}"
                )
            cfg = self.config
            new = codec.decode_phy2log(
                prepare.placement.phy2log, cfg.num_layers, cfg.num_slots, cfg.num_logical
            )
            transfers = codec.decode(prepare.transfers, "transfers")
            stats = self.executor.prepare(version, transfers)
            if self._closing:
                raise RuntimeError("rank is shutting down")
            self.after_transfers(version)
            rows = self.executor.staged_rows
            assert rows is not None
            self.dispatch.stage(self._row_map_of(new, self.rows.row_ids(rows)))
            self._staged_phy2log = {version: new}
        except MigrationAborted:
            return
        except Exception as exc:  # any failure aborts the plan everywhere (invariant 5)
            self.stats.failed += 1
            self.executor.abort(version)
            log.error("rank %d: preparing v%d failed: %s", self.config.rank, version, exc)
            self.agent.report(version, pb.PLAN_PHASE_FAILED, error=str(exc)[:500])
            return
        self.stats.prepared += 1
        self.stats.bytes_received += stats.bytes_received
        self.agent.report(
            version,
            pb.PLAN_PHASE_PREPARED,
            bytes_received=stats.bytes_received,
            seconds=stats.seconds,
        )

    def after_transfers(self, version: int) -> None:
        """Called on the migration thread once a plan's weights are staged; raising
        here fails the plan. A seam for checks (and for fault injection in tests)."""

    def on_commit(self, version: int) -> None:
        self._commit_ready = max(self._commit_ready, version)

    def on_abort(self, version: int, reason: str) -> None:
        self.executor.abort(version)
        self._staged_phy2log.pop(version, None)
        self.stats.aborted += 1
        log.warning("rank %d: plan v%d aborted: %s", self.config.rank, version, reason)
        self.agent.report(version, pb.PLAN_PHASE_ABORTED)
