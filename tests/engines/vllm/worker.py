"""One vLLM EP rank on CPU for the adapter's tests: vLLM's real EPLB code, a tiny MoE.

Run by tests/engines/vllm/test_adapter.py as `python -m tests.engines.vllm.worker` (forked from the
session's zygote that has imported vLLM, tests/engines/zygote.py) with
vLLM's folder on PYTHONPATH and VLLM_TARGET_DEVICE=cpu. Real parts: vLLM's plugin loader
(`load_general_plugins` finds worker_hooks.engines.vllm:register by entry point), its
`EPLB_POLICIES`, `ParallelConfig`/`EPLBConfig`, `EplbState` (`add_model`, `step`,
the load window and its cursor, `rearrange`, `_commit_eplb_maps`), the policy call,
`rearrange_expert_weights_inplace` and `TorchDistGlooStagedEplbCommunicator` moving the
weights between the gloo ranks, and in async mode the async worker's own per-layer
`run_rebalance_experts`/`transfer_layer` plus `EplbState.step`'s `_move_to_workspace`.
The extension class is resolved by name as vLLM does (`resolve_obj_by_qualname`) and
attached before the model loads, as vLLM does (after `init_device`). With `--runner v2`
(Model Runner V2, vLLM 0.33.0's default) the EPLB step is V2's real code in
`vllm/v1/worker/gpu/eplb_utils.py`: an `EPLBController` built with the runner, its
`prepare_load`, `maybe_register_speculator` (with `--drafter`, first, as V2 loads it),
`maybe_register_model` and `step`, reached through the real `step_eplb_after()`
decorator on the runner's forward method. With `--drafter` an MTP-like MoE drafter (one
layer) is registered with the same `EplbState`; vLLM rearranges its weights too.

Stand-ins, and why they do not hollow the claim (none touches the adapter's path):
  * `torch.accelerator.current_stream` (the gloo communicator waits on it for the
    device-to-host copies; there is no device) and `torch.Event` (vLLM times the
    rearrangement with it on rank 0): CPU no-ops; the tensors are CPU tensors already.
  * the EP/EPLB group coordinators (`parallel_state._EP`, `_EPLB`): an object with
    `device_group`/`cpu_group`, the two attributes vLLM's EPLB code reads: one gloo group
    over the 4 ranks for all, `_NODE_COUNT` = 1; with `--nodes 2`, as vLLM builds them, EP's
    device group, EP's CPU group and EPLB's group each a gloo group of its own over the 4
    ranks (2 fake nodes of 2: one host, so no transport crosses a node), `_NODE_COUNT` = 2.
    vLLM's real getters return them.
  * the model: `TinyMoE` implements vLLM's `MixtureOfExperts` attributes EPLB reads
    (expert_weights per layer, counts, `set_eplb_state`); routing is done here: token
    ids go to a physical slot through vLLM's `logical_to_physical_map` and are counted
    into vLLM's `expert_load_view`, as vLLM's router does on the device.
  * `ParallelConfig` is built without `enable_eplb` (its validation refuses EPLB off
    CUDA/ROCm/XPU) and, for V2's `EPLBController` (which reads it), gets it set after
    validation; the `EPLBConfig` EplbState reads is validated as in vLLM.
  * the model runner (vLLM's builds CUDA buffers, CUDA graphs, attention backends):
    V1, an object whose `eplb_step` calls `EplbState.step` as vLLM's
    `GPUModelRunner.eplb_step` does; V2, an object holding the real `EPLBController`
    as `self.eplb` (V2's `GPUModelRunner.__init__` does the same) whose forward method
    carries the real `step_eplb_after()` and whose `load_model` makes V2's EPLB calls
    in V2's order; V2's async loop start (`maybe_start_async_loop`) is not called
    (see async mode). `ModelConfig` / the drafter's config: objects with
    `compute_hash()` (and `model`); the speculator: an object with the drafter as
    `model` and a no-op `set_eplb_state`; the speculative config: `method="mtp"` and
    the drafter's config.
  * async mode: vLLM's async thread (`transfer_run_periodically`) needs an accelerator
    stream; its per-layer path (the policy call, `transfer_layer`, the pending result
    consumed by `step`) is driven here by hand, layer by layer, between steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import types
from datetime import timedelta
from pathlib import Path

import numpy as np

NUM_LAYERS = 3
NUM_EXPERTS = 8
REDUNDANT = 4  # 12 slots over 4 ranks
TOP_K = 2
TOKENS = 16
SHAPES = ((4, 3), (3,))  # two weight tensors per expert, like w13 and w2
DRAFT_LAYERS = 1  # an MTP-like drafter: one MoE layer, the main model's expert shape
DRAFT_LAYER_BASE = 100  # the drafter's weights: reference_weights(100 + layer, expert)


def reference_weights(layer: int, expert: int) -> list:
    import torch

    g = torch.Generator().manual_seed(1000 * layer + expert)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def coordinator(device_group, cpu_group):  # noqa: ANN001, ANN201
    """Stand-in for vLLM's GroupCoordinator: the attributes its EPLB code reads."""
    return types.SimpleNamespace(
        device_group=device_group,
        cpu_group=cpu_group,
        rank_in_group=device_group.rank(),
        world_size=device_group.size(),
    )


def install_stand_ins(torch, group, nodes: int = 1) -> None:  # noqa: ANN001
    from vllm.distributed import parallel_state

    class CpuStream:
        def synchronize(self) -> None:
            pass

    class CpuEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at = 0.0

        def record(self, stream=None) -> None:  # noqa: ANN001
            self.at = time.perf_counter()

        def synchronize(self) -> None:
            pass

        def wait(self, stream=None) -> None:  # noqa: ANN001
            pass

        def elapsed_time(self, other: CpuEvent) -> float:
            return (other.at - self.at) * 1000.0

    torch.accelerator.current_stream = lambda *a, **k: CpuStream()
    torch.Event = CpuEvent
    if nodes == 1:
        parallel_state._EP = parallel_state._EPLB = coordinator(group, group)
    else:  # as vLLM builds them: EP's device and CPU groups, and EPLB's own group, each apart
        import torch.distributed as dist

        parallel_state._EP = coordinator(group, dist.new_group(backend="gloo"))
        eplb = dist.new_group(backend="gloo")
        parallel_state._EPLB = coordinator(eplb, eplb)
    parallel_state._NODE_COUNT = nodes


def shrink(args, adapter, state, model, model_state, weights_match, group, torch) -> dict:  # noqa: ANN001
    """Elastic EP's scale-down of the last rank through vLLM's real
    `EplbState.rearrange(rank_mapping=...)`: its policy call, `rearrange_expert_weights_inplace`
    moving the survivors' weights over gloo with the rank mapping, `_commit_eplb_maps` of
    the smaller map. Stand-in: vLLM's resize runs on a `StatelessGroupCoordinator` (TCP
    store group); here an instance of that class, not initialised by its constructor,
    holding the gloo group as `device_group`, `cpu_group` and `tcp_store_group`."""
    from vllm.distributed import parallel_state
    from vllm.distributed.stateless_coordinator import StatelessGroupCoordinator

    lost = args.world - 1
    planned = None
    if args.wait_plan > 0:
        deadline = time.monotonic() + args.wait_plan
        while time.monotonic() < deadline and planned is None:
            planned = adapter.agent.survivor_map([lost], adapter.version) if adapter else None
            time.sleep(0.1)
        Path(args.out + ".planned").write_text("1" if planned is not None else "0")
        go = Path(args.out + ".go")
        while time.monotonic() < deadline + 60 and not go.exists():
            time.sleep(0.1)

    class Resizing(StatelessGroupCoordinator):
        def __init__(self) -> None:  # the fields vLLM's resize reads, without a TCP store
            self.device_group = self.cpu_group = self.tcp_store_group = group
            self.rank_in_group, self.world_size = group.rank(), group.size()

    parallel_state._EP = Resizing()
    mapping = {r: (r if r != lost else -1) for r in range(args.world)}
    state.rearrange(rank_mapping=mapping)
    new_map = model_state.physical_to_logical_map.cpu()
    survivor_ok = bool(weights_match(model, model_state)) if args.rank != lost else None
    rejoined = rejoin(args, state, lost) if args.rejoin else None
    return {
        "lost": lost,
        "planned": planned.tolist() if planned is not None else None,
        "map": new_map.tolist(),
        "survivor_weights_match_map": survivor_ok,
        "other_world": adapter.stats.other_world if adapter else [],
        "rejoined": rejoined,
    }


def rejoin(args, state, lost: int) -> dict | None:  # noqa: ANN001
    """After the scale-down, the survivors step on the new world as vLLM goes on serving:
    the EP/EPLB group is a gloo group of the survivors (stand-in for the resized
    StatelessGroupCoordinator), and two dummy EPLB steps through vLLM's `EplbState.step`
    (the plugin builds the new world's adapter at the first; the second is a pass after
    its Register was answered). Returns the new adapter's version and world."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    from worker_hooks.engines.vllm import plugin

    survivors = dist.new_group(
        ranks=[r for r in range(args.world) if r != lost], backend="gloo"
    )  # every rank
    if args.rank == lost:
        return None
    parallel_state._EP = parallel_state._EPLB = coordinator(survivors, survivors)
    state.step(is_dummy=True)
    adapter = plugin.current_adapter()
    if adapter is None:
        return {"version": None}
    deadline = time.monotonic() + 60
    while adapter.agent.committed_version == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    state.step(is_dummy=True)
    out = {
        "version": adapter.version,
        "num_gpus": adapter.num_gpus,
        "rank": adapter.rank,
        "phy2log": adapter.phy2log.tolist(),
        "committed_version": adapter.agent.committed_version,
    }
    return out  # the worker extension's destroy stops the adapter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=20, help="vLLM's step_interval")
    parser.add_argument(
        "--window", type=int, default=0, help="vLLM's window_size (0: the interval)"
    )
    parser.add_argument("--step-sleep", type=float, default=0.01)
    parser.add_argument("--async-mode", action="store_true")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        choices=(1, 2),
        help="fake nodes: 2 gives EP and EPLB groups of their own, as vLLM builds them",
    )
    parser.add_argument(
        "--runner",
        choices=("v1", "v2"),
        default="v1",
        help="the model runner's EPLB entry: v1 eplb_step, v2 eplb.step (eplb_utils)",
    )
    parser.add_argument(
        "--drafter", action="store_true", help="an MTP-like MoE drafter beside the model"
    )
    parser.add_argument(
        "--drift", type=int, default=0, help="popularity rolls by one expert every N steps"
    )
    parser.add_argument(
        "--policy-probe",
        action="store_true",
        help="after the run, ask the policy for world - 1 ranks as elastic EP does",
    )
    parser.add_argument(
        "--scale-down",
        action="store_true",
        help="after the run, elastic EP's scale-down: EplbState.rearrange(rank_mapping=...) "
        "drops the last rank",
    )
    parser.add_argument(
        "--rejoin",
        action="store_true",
        help="after the scale-down, the survivors step on the new world (a new adapter)",
    )
    parser.add_argument(
        "--wait-plan",
        type=float,
        default=0.0,
        help="before the scale-down, wait up to this long for the controller's survivor "
        "placement of that loss, then write <out>.planned and wait for <out>.go",
    )
    parser.add_argument(
        "--late-commit",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="this rank takes every Commit this much later than it arrives",
    )
    parser.add_argument(
        "--stale-plan",
        action="store_true",
        help="this rank stages a different map for the first plan",
    )
    args = parser.parse_args()
    rank = args.rank

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=args.world,
        timeout=timedelta(seconds=60),
    )
    group = dist.new_group(backend="gloo")
    install_stand_ins(torch, group, args.nodes)

    from vllm.config import ParallelConfig
    from vllm.config.parallel import EPLBConfig
    from vllm.distributed.eplb import async_worker, eplb_state, rebalance_execute
    from vllm.distributed.eplb.eplb_state import EplbLayerState, EplbState
    from vllm.plugins import load_general_plugins
    from vllm.utils.import_utils import resolve_obj_by_qualname

    load_general_plugins()  # vLLM's own loader: finds the rebalancer's entry point
    from vllm.distributed.eplb.policy import EPLB_POLICIES

    policy_name = EPLB_POLICIES["default"].__name__
    slots = (NUM_EXPERTS + REDUNDANT) // args.world

    class TinyLayer:
        def __init__(self, layer: int, phy2log: list[int]) -> None:
            local = phy2log[rank * slots : (rank + 1) * slots]
            self.weights = [
                torch.stack([reference_weights(layer, e)[i] for e in local])
                for i in range(len(SHAPES))
            ]
            self.load_view = self.l2p = self.count = None
            # vLLM's per-layer state: EplbState hands it its `should_record_tensor`.
            self.eplb_state = EplbLayerState()

        def get_expert_weights(self) -> list:
            return self.weights

        def set_eplb_state(
            self,
            moe_layer_idx,
            expert_load_view,
            logical_to_physical_map,  # noqa: ANN001
            logical_replica_count,
        ) -> None:
            self.load_view = expert_load_view[moe_layer_idx]
            self.l2p = logical_to_physical_map[moe_layer_idx]
            self.count = logical_replica_count[moe_layer_idx]
            self.eplb_state.set_layer_state(
                moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count
            )

    initial = EplbState.build_initial_global_physical_to_logical_map(NUM_EXPERTS, REDUNDANT)

    class TinyMoE:
        """vLLM's `MixtureOfExperts` as EPLB reads it; a drafter's layers count from
        DRAFT_LAYER_BASE (weights unlike the main model's)."""

        num_moe_layers = NUM_LAYERS
        num_expert_groups = 1
        num_logical_experts = NUM_EXPERTS
        num_physical_experts = NUM_EXPERTS + REDUNDANT
        num_local_physical_experts = slots
        num_routed_experts = NUM_EXPERTS
        num_shared_experts = 0
        num_redundant_experts = REDUNDANT

        def __init__(self, num_layers: int = NUM_LAYERS, base: int = 0) -> None:
            self.num_moe_layers = num_layers
            self.base = base
            self.moe_layers = [
                TinyLayer(base + layer, list(initial)) for layer in range(num_layers)
            ]
            self.expert_weights: list = []

        def update_physical_experts_metadata(
            self,
            num_physical_experts: int,  # vLLM's protocol: elastic EP
            num_local_physical_experts: int,
        ) -> None:
            raise NotImplementedError

        def set_eplb_state(
            self, expert_load_view, logical_to_physical_map, logical_replica_count
        ) -> None:  # noqa: ANN001
            self.expert_weights = [layer.get_expert_weights() for layer in self.moe_layers]
            for i, layer in enumerate(self.moe_layers):
                layer.set_eplb_state(
                    i, expert_load_view, logical_to_physical_map, logical_replica_count
                )

    # vLLM's validation refuses enable_eplb off CUDA/ROCm/XPU; EplbState reads only
    # eplb_config (and num_ubatches), validated as usual; the redundant count is the
    # model's (TinyMoE), as EplbState reads it.
    parallel_config = ParallelConfig(
        enable_expert_parallel=True,
        eplb_config=EPLBConfig(
            window_size=args.window or args.interval,
            step_interval=args.interval,
            use_async=args.async_mode,
            communicator="torch_gloo",
        ),
    )
    model = TinyMoE()
    model_config = types.SimpleNamespace(model="tiny-moe", compute_hash=lambda: "tiny-moe")
    drafter = TinyMoE(DRAFT_LAYERS, DRAFT_LAYER_BASE) if args.drafter else None
    draft_config = types.SimpleNamespace(model="tiny-moe-mtp", compute_hash=lambda: "tiny-moe-mtp")

    if args.runner == "v2":
        # vLLM's Model Runner V2 as far as EPLB goes: a real EPLBController
        # (v1/worker/gpu/eplb_utils.py) built in the runner's constructor, its
        # prepare_load / maybe_register_speculator (drafter first, as V2's load_model) /
        # maybe_register_model at model load, and the forward method under the real
        # `step_eplb_after()` decorator, which calls `self.eplb.step` after it.
        from vllm.v1.worker.gpu.eplb_utils import EPLBController, step_eplb_after

        parallel_config.enable_eplb = True  # after validation: see above

        class RunnerV2:
            def __init__(self) -> None:
                self.eplb = EPLBController(parallel_config, torch.device("cpu"))

            def load_model(self) -> None:
                self.eplb.prepare_load()
                added = False
                if drafter is not None:
                    speculator = types.SimpleNamespace(
                        model=drafter, set_eplb_state=lambda state: None
                    )
                    spec = types.SimpleNamespace(method="mtp", draft_model_config=draft_config)
                    added = self.eplb.maybe_register_speculator(speculator, spec, False)
                    assert added
                added |= self.eplb.maybe_register_model(model, model_config)  # type: ignore[arg-type]
                assert added

            @step_eplb_after()
            def execute_model(self, forward) -> None:  # noqa: ANN001
                forward()

        runner_obj: object = RunnerV2()
    else:
        state_v1 = EplbState(parallel_config, torch.device("cpu"))
        if drafter is not None:  # V1's load_model registers the drafter first, too
            state_v1.add_model(drafter, draft_config, model_name="tiny-moe-mtp (draft)")  # type: ignore[arg-type]
        state_v1.add_model(model, model_config)  # type: ignore[arg-type]

        class Runner:
            eplb_state = state_v1

            def load_model(self) -> None:
                pass

            def eplb_step(self, is_dummy: bool = False, is_profile: bool = False) -> None:
                self.eplb_state.step(is_dummy, is_profile, log_stats=False)

            def execute_model(self, forward) -> None:  # noqa: ANN001
                forward()
                self.eplb_step()

        runner_obj = Runner()

    extension = resolve_obj_by_qualname("worker_hooks.engines.vllm.RebalancerWorkerExtension")
    worker_cls = type("TinyWorker", (extension,), {})
    worker = worker_cls()
    worker.model_runner = runner_obj
    worker.init_worker_extension()  # vLLM: after init_device, before load_model
    runner = worker.model_runner
    runner.load_model()
    state = runner.eplb.state if args.runner == "v2" else runner.eplb_state
    model_state = state.model_states["tiny-moe"]
    draft_state = state.model_states.get("tiny-moe-mtp")

    from worker_hooks.engines.vllm import plugin

    if args.stale_plan:  # the first plan staged here differs from the controller's
        original_prepare = None

        def stale_prepare(prepare) -> None:  # noqa: ANN001
            adapter = plugin.current_adapter()
            original_prepare(prepare)
            plan = adapter.plans.get(prepare.version)  # the staged array itself
            if plan is not None and prepare.version == 1:
                plan[:, [0, 1]] = plan[:, [1, 0]]

    # Async mode, by hand: what vLLM's async thread does per rearrangement (see above).
    def drive_async() -> None:
        if not model_state.rebalanced or model_state.pending_result is not None:
            return
        if not hasattr(drive_async, "plan"):
            state.rearrange_event.wait()  # what the thread waits on: rearrange() recorded it
            old = model_state.physical_to_logical_map.cpu()
            new = async_worker.run_rebalance_experts(model_state, state, old, None)
            drive_async.plan = (old, new, 0)  # type: ignore[attr-defined]
        old, new, layer = drive_async.plan  # type: ignore[attr-defined]
        metadata = rebalance_execute.transfer_layer(
            old_layer_indices=old[layer],
            new_layer_indices=new[layer],
            expert_weights=model.expert_weights[layer],
            expert_weights_buffer=model_state.expert_buffer,
            communicator=model_state.communicator,
            ep_group=group,
            is_profile=False,
            stream=None,
            layer_idx=layer,
        )
        model_state.pending_result = rebalance_execute.AsyncEplbLayerResult(
            layer_idx=layer,
            new_physical_to_logical_map=new[layer],
            transfer_metadata=metadata,
            consumed_event=eplb_state.CpuGpuEvent(),
        )
        if layer + 1 == NUM_LAYERS:
            del drive_async.plan  # type: ignore[attr-defined]
        else:
            drive_async.plan = (old, new, layer + 1)  # type: ignore[attr-defined]

    popularity = np.array([8, 6, 1, 1, 1, 1, 1, 1], dtype=np.float64)
    rng = np.random.default_rng(rank)
    routed = np.zeros((NUM_LAYERS, NUM_EXPERTS), dtype=np.int64)
    # Routed while vLLM records, per row of the deployment's layer set: the main model's
    # layers, then the drafter's (worker_hooks/engines/vllm/layer_set.py).
    recorded = np.zeros(
        (NUM_LAYERS + (DRAFT_LAYERS if drafter is not None else 0), NUM_EXPERTS), dtype=np.int64
    )
    # What the adapter hands its agent, summed per (layer, expert) and per slot: the
    # windows as they go to the controller (the agent itself is the real one).
    from worker_hooks.agent import WorkerAgent

    sent = {"logical": np.zeros_like(recorded), "windows": []}
    submit = WorkerAgent.submit_window

    def tee(self, first_step, num_steps, version, logical, physical):  # noqa: ANN001, ANN202
        sent["logical"] += np.asarray(logical, dtype=np.int64)
        sent["windows"].append([int(first_step), int(num_steps), int(version)])
        return submit(self, first_step, num_steps, version, logical, physical)

    WorkerAgent.submit_window = tee
    mismatches = 0
    step_seconds: list[float] = []
    stale_hooked = late_hooked = False

    def route(moe, moe_state, shift: int) -> int:  # noqa: ANN001
        """One forward of `moe`'s layers: vLLM's router's part (logical -> physical through
        vLLM's maps, counted into vLLM's load view); the dispatch mismatches."""
        wrong = 0
        for layer_index, layer in enumerate(moe.moe_layers):
            p = np.roll(popularity, layer_index + shift) / popularity.sum()
            ids = np.stack(
                [rng.choice(NUM_EXPERTS, TOP_K, replace=False, p=p) for _ in range(TOKENS)]
            )
            if moe is model:
                np.add.at(routed[layer_index], ids.ravel(), 1)
            logical = torch.from_numpy(ids).long()
            replicas = layer.count[logical]
            pick = torch.arange(logical.numel()).reshape(logical.shape) % replicas
            physical = layer.l2p[logical, pick]
            # vLLM's router records only while EplbState's should_record_tensor is set.
            flag = layer.eplb_state.should_record_tensor
            if flag is None or bool(flag):
                layer.load_view.scatter_add_(
                    0, physical.ravel(), torch.ones(physical.numel(), dtype=torch.int32)
                )
                np.add.at(
                    recorded[layer_index + (0 if moe is model else NUM_LAYERS)], ids.ravel(), 1
                )
            current = moe_state.physical_to_logical_map[layer_index]
            wrong += int((current[physical] != logical).sum())
        return wrong

    def weights_match(moe, moe_state) -> bool:  # noqa: ANN001
        final = moe_state.physical_to_logical_map.cpu()
        return all(
            torch.equal(
                moe.expert_weights[layer][i][s],
                reference_weights(moe.base + layer, int(final[layer, rank * slots + s]))[i],
            )
            for layer in range(moe.num_moe_layers)
            for s in range(slots)
            for i in range(len(SHAPES))
        )

    # vLLM's workers leave start-up together (its profile run and KV-cache set-up are
    # collectives); without this the first rearrangement would time our import skew.
    dist.barrier(group)
    for _step in range(args.steps):
        started = time.perf_counter()
        shift = _step // args.drift if args.drift else 0

        def forward(shift: int = shift) -> None:
            nonlocal mismatches
            if drafter is not None:
                mismatches += route(drafter, draft_state, shift)
            mismatches += route(model, model_state, shift)

        if args.async_mode:
            drive_async()
        runner.execute_model(forward)
        step_seconds.append(time.perf_counter() - started)
        adapter = plugin.current_adapter()
        if args.late_commit and adapter is not None and not late_hooked:
            original_commit = adapter.on_commit

            def late_commit(version: int, original=original_commit) -> None:  # noqa: ANN001
                time.sleep(args.late_commit)  # the agent thread: every later message waits too
                original(version)

            adapter.on_commit = late_commit
            late_hooked = True
        if args.stale_plan and adapter is not None and not stale_hooked:
            original_prepare = adapter.on_prepare
            adapter.on_prepare = stale_prepare
            stale_hooked = True
        time.sleep(args.step_sleep)
        if _step % 20 == 0:
            print(f"rank {rank}: step {_step}", flush=True)

    adapter = plugin.current_adapter()
    final = model_state.physical_to_logical_map.cpu()
    weights_ok = weights_match(model, model_state)
    probe = None
    if args.policy_probe:
        # What EplbState.rearrange(rank_mapping=...) asks when elastic EP scales down to
        # world - 1 ranks (num_replicas shrinks with the ranks): through vLLM's policy
        # interface, with vLLM's own load window and map; vLLM's default policy alongside.
        from vllm.distributed.eplb.policy import DefaultEplbPolicy

        load = model_state.expert_load_window.sum(dim=0).to(torch.int64)
        weight = torch.zeros(NUM_LAYERS, NUM_EXPERTS, dtype=torch.int64)
        weight.scatter_add_(1, final.long(), load)
        dist.all_reduce(weight, group=group)
        ranks = args.world - 1
        replicas = (NUM_EXPERTS + REDUNDANT) // args.world * ranks
        asked = state.policy.rebalance_experts(weight, replicas, 1, 1, ranks, final.clone())
        vllm_default = DefaultEplbPolicy.rebalance_experts(
            weight, replicas, 1, 1, ranks, final.clone()
        )
        probe = {
            "num_replicas": replicas,
            "num_ranks": ranks,
            "answer": asked.tolist(),
            "default": vllm_default.tolist(),
        }
    scale_down = None
    if args.scale_down:
        scale_down = shrink(args, adapter, state, model, model_state, weights_match, group, torch)
    worker.destroy_worker_extension()
    result = {
        "rank": rank,
        "policy": policy_name,
        "version": adapter.version if adapter else None,
        "commits": adapter.stats.commits if adapter else [],
        "rearrangements": adapter.stats.rearrangements if adapter else [],
        "windows": adapter.windows.sent if adapter else 0,
        "tokens_sent": adapter.windows.tokens_sent if adapter else 0,
        "routed": int(routed.sum()),
        "recorded_logical": recorded.tolist(),
        "sent_logical": sent["logical"].tolist(),
        "sent_windows": sent["windows"],
        "phy2log": final.tolist(),
        "initial_phy2log": [list(initial)] * NUM_LAYERS,
        "weights_match_map": weights_ok,
        "dispatch_mismatches": mismatches,
        # The first step builds the adapter (imports gRPC and the protocol, starts the
        # agent thread): a one-time start cost, reported apart from the steps after it.
        "first_step_seconds": step_seconds[0],
        "max_step_seconds": max(step_seconds[1:]),
        "steps": len(step_seconds),
        "slowest_steps": sorted(range(len(step_seconds)), key=lambda i: -step_seconds[i])[:3],
        "step_seconds": [round(x, 4) for x in step_seconds],
        "pid": os.getpid(),
        # getattr: the same worker runs against older adapters (a test must fail there,
        # on its assertions, not on a missing name).
        "attach": plugin.attach_status() if hasattr(plugin, "attach_status") else None,
        "drafter_calls": getattr(adapter.stats, "drafter_calls", 0) if adapter else 0,
        "other_world": getattr(adapter.stats, "other_world", []) if adapter else [],
        "policy_probe": probe,
        "scale_down": scale_down,
        "drafter": None
        if drafter is None
        else {
            "phy2log": draft_state.physical_to_logical_map.cpu().tolist(),
            "weights_match_map": weights_match(drafter, draft_state),
        },
    }
    Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
