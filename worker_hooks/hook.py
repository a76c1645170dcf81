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

`HookConfig.dispatch_mode` picks how an expert's tokens are divided among its replicas
(rebalancer.wire.dispatch): `split` (the hash split, default), `load` or `load+shared`
(by this step's load: one all-gather of `[G, X]` counts per layer on `dispatch_group`,
worker_hooks/waterfill.py). With `shared_expert` the model's shared expert is counted as
expert E of every layer, and `route` returns one more column: the id
`num_rows + gpu` of the GPU that computes the token's shared expert (its own GPU except
under `load+shared`).
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.countfile import (
    COUNT_SUFFIXES_WRITTEN,
    GPU_COUNT,
    GPU_SHARED_COUNT,
    LOGICAL_COUNT,
    SHARED_COUNT,
    save_count_arrays,
)
from rebalancer.wire.dispatch import (
    WATERFILL_PASSES,
    DispatchMode,
    check_dispatch_mode,
    check_waterfill_passes,
    has_shared_replicas,
)
from rebalancer.wire.layout import check_phy2log
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent
from worker_hooks.agree import CommitAgreement
from worker_hooks.devices import resolve_device
from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.migrate import (
    MigrationAborted,
    MigrationConfig,
    MigrationExecutor,
    Transport,
    check_weights,
)
from worker_hooks.record import ExpertRecorder
from worker_hooks.rows import RowMap, replica_rows
from worker_hooks.warm import (
    DEFAULT_WARM_START_SECONDS,
    await_offer,
    check_warm_start_seconds,
    group_holds,
)

log = logging.getLogger("worker_hooks.hook")

# HookConfig's integer fields: a str or float there fails at construction, by name.
_INT_FIELDS = ("rank", "num_layers", "num_logical", "num_slots", "num_gpus", "num_nodes", "expert_bytes",
               "window_steps", "agree_every", "layers_per_chunk", "rounds_in_flight", "outbox_bytes",
               "spare_rows", "top_k", "waterfill_passes")


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
    # How an expert's tokens are divided among its replicas (rebalancer.wire.dispatch).
    dispatch_mode: DispatchMode = "split"
    # The model has a shared expert (DeepSeek-V3/V4): counted as expert E, and under
    # "load+shared" dispatched like a routed expert with a replica on every GPU.
    shared_expert: bool = False
    top_k: int = 0  # routed experts per token, told to the controller (0: unknown)
    # Water-filling passes per layer and step under "load"/"load+shared" (more: closer to
    # even, 14 kernels each; rebalancer.wire.dispatch.WATERFILL_PASSES says what each buys).
    waterfill_passes: int = WATERFILL_PASSES
    # Fuse each layer's water-fill with torch.compile (CUDA; compiled at the first step,
    # so run a step eagerly before capturing graphs). Off: ~140 small kernels per layer.
    compile_dispatch: bool = False
    worker_id: str = ""
    # The deployment's replica pool ("" = none; RegisterRequest.pool): a fresh group is
    # offered the pool's placement and installs it at `start`, before its first step,
    # waiting at most `warm_start_seconds` for the offer (0: never wait, start as without
    # a pool). Every rank of the group names the same pool.
    pool: str = ""
    warm_start_seconds: float = DEFAULT_WARM_START_SECONDS
    token: str | None = None        # bearer token of the deployment (controller's worker_tokens)
    ca_file: str | None = None      # TLS to the controller
    cert_file: str | None = None    # mutual TLS
    key_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("controller", "deployment"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise TypeError(f"HookConfig.{name} must be a non-empty str, got {getattr(self, name)!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise TypeError(f"HookConfig.{name} must be an int, got {type(value).__name__} {value!r}")
        if self.num_gpus < 1 or not 0 <= self.rank < self.num_gpus:
            raise ValueError(f"need 0 <= rank < num_gpus, got rank={self.rank}, num_gpus={self.num_gpus}")
        if self.num_slots % self.num_gpus:
            raise ValueError(f"num_slots={self.num_slots} is not a multiple of num_gpus={self.num_gpus}")
        _ = self.migration  # a bad transport or setting fails here, with its name
        check_dispatch_mode(self.dispatch_mode)  # InputError: a ValueError naming the choices
        check_waterfill_passes(self.waterfill_passes)
        if has_shared_replicas(self.dispatch_mode) and not self.shared_expert:
            raise ValueError('dispatch_mode "load+shared" needs shared_expert=True')
        if not isinstance(self.pool, str):
            raise TypeError(f"HookConfig.pool must be a str, got {type(self.pool).__name__}")
        check_warm_start_seconds(self.warm_start_seconds, "HookConfig.warm_start_seconds")

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
    # Everything recorded so far (windows handed to the agent, summed): logical [L, X]
    # (X = E, +1 with the shared expert) and per GPU [L, G (+ G shared)] picks sent.
    logical_total: np.ndarray | None = None
    gpu_total: np.ndarray | None = None


def _checked_placement(phy2log: object, config: HookConfig) -> np.ndarray:
    """phy2log as int64 `[L, P]` of the config's sizes, every expert held in every layer
    (InputError, a ValueError, naming what is wrong)."""
    if isinstance(phy2log, torch.Tensor):
        phy2log = phy2log.detach().cpu().numpy()
    placement = check_phy2log(phy2log, config.num_logical)
    if placement.shape != (config.num_layers, config.num_slots):
        raise InputError(f"phy2log has shape {list(placement.shape)}, the config says "
                         f"[num_layers={config.num_layers}, num_slots={config.num_slots}]")
    return placement


class RebalanceHook(PlanHandlers):
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
        expert_source: Callable[[int, int], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """dispatch_group: the EP group the per-step counts are all-gathered on (dispatch
        by load; None: the default group). counts_gather: replaces that all-gather
        ([X] -> [G, X]; benchmarks on one GPU). expert_source: (layer, logical expert) ->
        that expert's weights by name (one row of each tensor of `weights`), what a warm
        start loads (a rank without it never installs one, and neither do its peers)."""
        if not isinstance(config, HookConfig):
            raise TypeError(f"config must be a HookConfig, got {type(config).__name__}")
        check_weights(weights)  # before anything starts: a clear TypeError, not one from deep inside
        for name, group in (("agree_group", agree_group), ("migrate_group", migrate_group),
                            ("dispatch_group", dispatch_group)):
            if group is not None and not isinstance(group, dist.ProcessGroup):
                raise TypeError(f"{name} must be a torch.distributed group (dist.new_group(...)) or None, "
                                f"got {type(group).__name__}")
        self.config = config
        self.device = resolve_device(device)
        self.version = 0
        self.phy2log = _checked_placement(phy2log, config)
        self.rows = RowMap(config.num_gpus, config.num_layers, config.slots_per_rank, config.spare_rows)
        self._row_ids = self.rows.row_ids()  # [L, P] row id of each slot, current version
        num_rows = config.num_gpus * config.rows_per_rank
        self._num_rows = num_rows
        shared = 1 if config.shared_expert else 0
        # With a shared expert: its column E, and its G replicas at ids num_rows + g.
        self.recorder = ExpertRecorder(
            config.num_layers,
            config.num_logical + shared,
            num_rows + shared * config.num_gpus if config.record_physical else None,
            device=self.device,
        )
        self._by_load = config.dispatch_mode != "split"
        self._dispatch_group = dispatch_group
        self._counts_gather = counts_gather
        self.dispatch = ReplicaDispatch(
            self._row_map_of(self.phy2log, self._row_ids),
            config.num_gpus,
            config.rank,
            max_replicas=self._max_replicas,
            device=self.device,
            num_physical=num_rows,
            by_load=self._by_load,
            shared_expert=config.shared_expert,
            waterfill_passes=config.waterfill_passes,
            compiled=config.compile_dispatch and self._by_load,
        )
        self.weights = weights
        self.executor = MigrationExecutor(
            config.rank, config.num_gpus, weights, migrate_group, config.migration, row_map=self.rows
        )
        self.agreement = CommitAgreement(agree_group, config.agree_every)
        self._agree_group = agree_group
        self._expert_source = expert_source
        self.stats = HookStats()
        self.step = 0
        self._window_start = 0
        # (first step, steps, version, row ids of that version) of the window in flight
        self._snapshot: tuple[int, int, int, np.ndarray] | None = None
        self._migration: threading.Thread | None = None
        self._migrations: list[threading.Thread] = []  # those still running, newest last
        self._last_prepare = 0  # newest plan version whose Prepare came (agent thread)
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
                dispatch_mode=config.dispatch_mode, top_k=config.top_k, pool=config.pool,
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
        """Start the link; with a pool, install the pool's placement first if the
        controller offers one in time (`warm_start`). Call before the first step."""
        self.agent.start()
        if self.config.pool and self.step == 0 and self.version == 0:
            self.warm_start()

    def warm_start(self) -> bool:
        """Install the pool placement offered at Register (the proto's
        RegisterResponse.warm_start) before the first step, on every rank of the group or
        on none: the ranks agree on the offered version (all-reduce MIN and MAX on the
        agreement group: equal and above 0), load the experts they gain from
        `expert_source`, agree that every rank loaded them, then switch maps and weights
        and report the version committed (step 0), which the controller adopts. Waits
        for the offer at most `warm_start_seconds`; no offer, no controller, a rank
        without it: every rank starts on its start placement, as without a pool.
        Collective: every rank of the group calls it (`start` does). True if installed."""
        cfg = self.config
        offered, new = 0, None
        source = self._expert_source
        if source is not None and cfg.warm_start_seconds > 0:  # 0: start as without a pool
            offered, new = await_offer(self.agent, cfg.warm_start_seconds, cfg.num_layers,
                                       cfg.num_slots, cfg.num_logical, cfg.rank)
        if not self._all_agree(offered) or new is None or source is None:
            log.info("rank %d: no warm start (offered v%d); starting on the start placement", cfg.rank, offered)
            return False
        gained: list[tuple[int, int, dict[str, torch.Tensor]]] = []
        try:
            S = cfg.slots_per_rank
            for layer in range(cfg.num_layers):
                for s in range(S):
                    slot = cfg.rank * S + s
                    if new[layer, slot] != self.phy2log[layer, slot]:
                        expert = source(layer, int(new[layer, slot]))
                        gained.append((layer, int(self.rows.rows[cfg.rank, layer, s]), expert))
            self.dispatch.stage(self._row_map_of(new, self._row_ids))
            loaded = offered
        except Exception as exc:  # its peers must not switch alone
            log.error("rank %d: warm start v%d not loaded: %s", cfg.rank, offered, exc)
            loaded = 0
        if not self._all_agree(loaded):
            log.warning("rank %d: warm start v%d not installed: a rank could not load it", cfg.rank, offered)
            return False
        for layer, row, expert in gained:
            for name, tensor in expert.items():
                self.weights[name][layer, row].copy_(tensor)
        self.dispatch.commit()
        self.version, self.phy2log = offered, new
        self.stats.commits.append((self.step, offered))
        self.agent.report(offered, pb.PLAN_PHASE_COMMITTED, step=self.step)
        log.info("rank %d: warm start: serving the pool placement v%d (%d experts loaded)",
                 cfg.rank, offered, len(gained))
        return True

    def _all_agree(self, version: int) -> bool:
        """Whether every rank of the group holds `version` (> 0)."""
        return group_holds(version, self._agree_group, self.config.num_gpus, self.config.rank)

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
        # Every plan's thread, not only the newest: an older one may still wait for a peer
        # (a daemon thread inside a gloo wait at exit aborts the process).
        until = time.monotonic() + transfer_timeout
        for migration in self._migrations:
            migration.join(max(0.0, until - time.monotonic()))
        self.stop()
        self.agreement.close()
        done = not any(m.is_alive() for m in self._migrations)
        if done:
            # Drop the mappings of the peers' weights ("ipc"/"outbox"). A peer still
            # reading ours after we exit reads freed memory into staging, but that plan
            # cannot commit: the commit agreement needs every rank, us included.
            self.executor.close()
        return done

    def write_counts(self, path: str | Path) -> None:
        """Write what this rank recorded so far to a count file (`.json`, `.npz` or `.pt`).

        Not on the hot path: call it from the serving thread, at the end of a run (after
        `finish`, which closes the last window) or on demand (the windows closed so far,
        every `window_steps` steps; a window not yet closed is not in it). It holds this
        rank's picks: the files of all ranks sum to the deployment's.

        Keys (rebalancer.formats.read_counts reads them; SGLang's loaders read
        `logical_count` and ignore the rest): `logical_count` [L, E] routed picks per
        expert; with `shared_expert`, `shared_count` [L] tokens through the shared expert;
        with `record_physical`, `gpu_count` [L, G] routed picks this rank sent to each GPU
        and, with `shared_expert`, `gpu_shared_count` [L, G] its shared-expert tokens
        computed on each GPU. `.pt` is SGLang's dump layout: a dict of tensors with a
        leading steps axis of 1 (`logical_count` [1, L, E]) and `rank`. All counts int64.
        """
        cfg = self.config
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (*COUNT_SUFFIXES_WRITTEN, ".pt", ".pth"):
            raise InputError(f"{path}: cannot write counts as '{suffix}' (expected .json, .npz or .pt)")
        shared = 1 if cfg.shared_expert else 0
        G = cfg.num_gpus
        logical = self.stats.logical_total
        if logical is None:  # no window closed yet: nothing recorded so far
            logical = np.zeros((cfg.num_layers, cfg.num_logical + shared), dtype=np.int64)
        arrays = {LOGICAL_COUNT: logical[:, : cfg.num_logical]}
        if cfg.shared_expert:
            arrays[SHARED_COUNT] = logical[:, cfg.num_logical]
        if cfg.record_physical:
            # gpu_total: [L, G] routed, then [L, G] shared (see _add_totals)
            per_gpu = self.stats.gpu_total
            if per_gpu is None:
                per_gpu = np.zeros((cfg.num_layers, G * (1 + shared)), dtype=np.int64)
            arrays[GPU_COUNT] = per_gpu[:, :G]
            if cfg.shared_expert:
                arrays[GPU_SHARED_COUNT] = per_gpu[:, G:]
        ints = {key: np.ascontiguousarray(a, dtype=np.int64) for key, a in arrays.items()}
        if suffix in (".pt", ".pth"):
            dump: dict[str, object] = {"rank": cfg.rank}
            dump.update({key: torch.from_numpy(arr)[None] for key, arr in ints.items()})
            torch.save(dump, path)
        else:
            save_count_arrays(path, ints)

    # ------------------------------------------------------------ hot path

    def route(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Record `layer`'s routing and map logical ids `[T, K]` to physical slots.

        With `shared_expert` the result has K + 1 columns, the last one the id
        `num_rows + gpu` of the GPU computing each token's shared expert."""
        cfg = self.config
        ids = topk_ids
        if cfg.shared_expert:
            shared = torch.full_like(topk_ids[:, :1], cfg.num_logical)
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
            phys = self.dispatch.dispatch_by_load(
                layer, ids, counts, has_shared_replicas(cfg.dispatch_mode)
            )
        if cfg.record_physical:
            self.recorder.record_physical(layer, phys)
        return phys

    def _gather_counts(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's per-expert picks of this layer and step: [X] -> [G, X] int64."""
        if self._counts_gather is not None:
            return self._counts_gather(local)
        if self.config.num_gpus == 1:
            return local.unsqueeze(0)
        out = local.new_empty(self.config.num_gpus * local.shape[0])  # flat: gloo's form
        dist.all_gather_into_tensor(out, local, group=self._dispatch_group)
        return out.view(self.config.num_gpus, local.shape[0])

    def step_end(self) -> None:
        """Call once per forward step, after the step, on every rank."""
        self.step += 1
        self.stats.steps += 1
        self._poll_window()
        ready = self._commit_ready if self._commit_ready in self._staged_phy2log else self.version
        agreed = self.agreement.on_step(self.step, ready, serving=self.version)
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
        self._add_totals(logical, physical)
        cfg = self.config
        logical = logical[:, : cfg.num_logical]  # the controller counts routed experts
        if physical is not None:  # counted by row: back to the slots the controller knows
            physical = np.take_along_axis(physical[:, : self._num_rows], row_ids, axis=1)
        self.agent.submit_window(first_step, num_steps, version, logical, physical)
        self.stats.windows += 1

    def _add_totals(self, logical: np.ndarray, physical: np.ndarray | None) -> None:
        """Sum what was recorded: logical [L, X] and per GPU [L, G (+ G shared)]."""
        st = self.stats
        st.logical_total = logical.copy() if st.logical_total is None else st.logical_total + logical
        if physical is None:
            return
        cfg = self.config
        rows = physical[:, : self._num_rows].reshape(cfg.num_layers, cfg.num_gpus, cfg.rows_per_rank)
        per_gpu = np.concatenate([rows.sum(axis=2), physical[:, self._num_rows :]], axis=1)
        st.gpu_total = per_gpu if st.gpu_total is None else st.gpu_total + per_gpu

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
        # A Prepare can come twice (resent to a rank whose stream went down as it was
        # sent): its transfers run once, or the peers' messages would be taken twice.
        if prepare.version <= self._last_prepare:
            return
        self._last_prepare = prepare.version
        self._migration = threading.Thread(
            target=self._prepare, args=(prepare,), daemon=True, name=f"migrate-v{prepare.version}"
        )
        self._migration.start()
        self._migrations = [t for t in self._migrations if t.is_alive()] + [self._migration]

    def _prepare(self, prepare: pb.Prepare) -> None:
        version = prepare.version
        try:
            refusal = self._refusal(prepare)
            cfg = self.config
            new = codec.decode_phy2log(
                prepare.placement.phy2log, cfg.num_layers, cfg.num_slots, cfg.num_logical
            )
            transfers = codec.decode(prepare.transfers, "transfers")
            if refusal:
                # No rank moves this plan's weights: its peers stop waiting for this rank
                # at once (worker_hooks/fence.py) and the plan fails everywhere.
                self.executor.decline(version, refusal)
            stats = self.executor.prepare(version, transfers)
            if self._closing:
                raise RuntimeError("rank is shutting down")
            self.after_transfers(version)
            rows = self.executor.staged_rows
            if rows is None:  # an Abort dropped the staging after the transfers (on_abort reported it)
                raise MigrationAborted(f"plan v{version} aborted while its weights were staged")
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

    def _refusal(self, prepare: pb.Prepare) -> str:
        """Why this rank cannot prepare `prepare` ("" if it can). A rank told to commit a
        staged plan keeps that staging until it switched: a later plan (the controller
        gave up waiting for confirmations) must not replace it, or the agreed switch would
        install the other plan's map (invariant 2) or find no staging."""
        if prepare.base_version != self.version:
            return f"plan is based on v{prepare.base_version}, rank serves v{self.version}"
        ready = self._commit_ready
        if ready > self.version and ready in self._staged_phy2log:
            return f"rank is switching to v{ready}, plan v{prepare.version} must wait"
        return ""

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
