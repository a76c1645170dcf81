"""One SGLang rank's side of the rebalancer: windows up, plans in through SGLang's updater.

Created by the plugin (worker_hooks/engines/sglang/plugin.py) at the first forward pass that
SGLang's `EPLBManager` sees, once SGLang has loaded the model, set the global
`ExpertLocationMetadata` and initialised torch.distributed. The guarantees, and the one
SGLang's updater cannot give, are in the package docstring (worker_hooks/engines/sglang/__init__.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.layout import logical_counts
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent
from worker_hooks.agree import CommitAgreement
from worker_hooks.engines import require_engine
from worker_hooks.engines.sglang.config import SGLangAdapterConfig

log = logging.getLogger("worker_hooks.engines.sglang")


@dataclass
class AdapterStats:
    steps: int = 0
    windows: int = 0
    commits: list[tuple[int, int]] = field(default_factory=list)  # (pass, version)
    prepared: int = 0
    aborted: int = 0
    update_seconds: list[float] = field(default_factory=list)


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
        self._finished = False
        self._window_start = 0
        self._counts: torch.Tensor | None = None  # [L, P] int64 on the pass's device
        self._snapshot: tuple[int, int, int, np.ndarray, torch.Tensor, torch.cuda.Event | None] | None = None
        self._staged: dict[int, np.ndarray] = {}
        self._commit_ready = 0
        self._lock = threading.Lock()
        # Groups of the adapter's own, so its collectives never interleave with SGLang's.
        # Every rank builds them at the same (first) forward pass.
        timeout = timedelta(seconds=config.agree_timeout_seconds)
        self._agree_group = dist.new_group(backend="gloo", timeout=timeout)
        self._layer_group = dist.new_group(backend="gloo", timeout=timeout)
        self.agreement = CommitAgreement(self._agree_group, config.agree_every)
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
        )
        self.agent.start()
        log.info("rank %d: rebalancer adapter on (%s, deployment %s, %d layers, %d slots)",
                 self.rank, config.address, config.deployment, self.num_layers, self.num_slots)

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
        with self._lock:
            ready = self._commit_ready if self._commit_ready in self._staged else self.version
        agreed = self.agreement.on_step(self.step, ready)
        if self.broken is None and agreed is not None and agreed > self.version:
            self._flush_window(wait=True)  # a window never straddles two placements
            self._apply(agreed)
        elif self.step - self._window_start >= self.config.window_steps:
            self._flush_window()

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
        self.agreement.on_step(self.step, self.version)

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
        self._snapshot = (self._window_start, self.step - self._window_start, self.version,
                          self.phy2log.copy(), host, event)
        self._window_start = self.step
        self._poll_window(wait=wait)

    def _poll_window(self, wait: bool = False) -> None:
        """Hand a finished copy to the agent; waits for the device only when `wait`."""
        if self._snapshot is None:
            return
        first, steps, version, phy2log, host, event = self._snapshot
        if event is not None:
            if wait:
                event.synchronize()
            elif not event.query():
                return
        self._snapshot = None
        physical = host.numpy().astype(np.int64)
        logical = logical_counts(physical, phy2log, self.num_logical)
        self.agent.submit_window(first, steps, version, logical, physical)
        self.stats.windows += 1

    def _apply(self, version: int) -> None:
        """Install committed plan `version` with SGLang's updater, one layer at a time,
        every layer confirmed by every rank (see the package docstring)."""
        import time

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

        def init_lplb_solvers() -> None:
            from sglang.srt.model_executor.model_runner_components.moe_ep_setup import (
                init_lplb_solvers as init,
            )
            init(model_config=manager._model_config)

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
                    init_lplb_solvers_callable=init_lplb_solvers,
                )
                moved = True
            except Exception as exc:  # a peer lost mid-transfer: this layer is untouched
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            all_moved = self._layer_done(moved)
            if all_moved:
                self.phy2log[layer] = new[layer]
                continue
            if moved:  # this rank's copy of the layer moved, a peer's did not: undo it
                if saved is not None:
                    for tensor, copy in zip(weights[layer], saved, strict=True):
                        tensor.copy_(copy)
                get_global_expert_location_metadata().update(before, update_layer_ids=[layer])
            self._fail(version, layer, error or "a peer did not finish the layer")
            return
        # Layers without routed weights (dense ones) have a map row but nothing to move.
        weightless = [layer for layer in range(self.num_layers) if layer not in weights]
        if weightless:
            get_global_expert_location_metadata().update(target, update_layer_ids=weightless)
            self.phy2log[weightless] = new[weightless]
        self.version = version
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

    # ------------------------------------------------------------ agent thread

    def on_prepare(self, prepare: pb.Prepare) -> None:
        """Check and stage the placement: weights move only at the agreed pass, after the
        commit, in SGLang's updater (what SGLang's updater cannot do is in the docstring)."""
        version = prepare.version
        try:
            if self.broken is not None:
                raise InputError(f"rank stopped taking plans ({self.broken})")
            if prepare.base_version != self.version:
                raise InputError(f"plan is based on v{prepare.base_version}, rank serves v{self.version}")
            new = codec.decode_phy2log(
                prepare.placement.phy2log, self.num_layers, self.num_slots, self.num_logical)
        except InputError as exc:
            log.error("rank %d: plan v%d refused: %s", self.rank, version, exc)
            self.agent.report(version, pb.PLAN_PHASE_FAILED, error=str(exc)[:500])
            return
        with self._lock:
            self._staged = {version: np.array(new, dtype=np.int64)}
        self.stats.prepared += 1
        self.agent.report(version, pb.PLAN_PHASE_PREPARED)

    def on_commit(self, version: int) -> None:
        with self._lock:
            self._commit_ready = max(self._commit_ready, version)

    def on_abort(self, version: int, reason: str) -> None:
        with self._lock:
            self._staged.pop(version, None)
        self.stats.aborted += 1
        log.warning("rank %d: plan v%d aborted: %s", self.rank, version, reason)
        self.agent.report(version, pb.PLAN_PHASE_ABORTED)
