"""One SGLang EP rank on CPU through SGLang's elastic-EP fault path, for
tests/engines/sglang/test_fault.py.

Run as `python -m tests.engines.sglang.fault_worker` with SGLang's folder (and cpu_shims)
on PYTHONPATH. The rank is worker.py's (SGLang's real ServerArgs with
`--eplb-algorithm elasticity_aware`, runtime context, ExpertLocationMetadata, recorder,
dispatch, EPLBManager, ExpertLocationUpdater over gloo, the plugin through SGLang's own
loader and HookRegistry; worker.py's module docstring names its stand-ins). It serves some
passes, then rank `--lost` is lost and every rank runs SGLang's real
`elastic_ep.maybe_rebalance_after_rank_fault(eplb_manager=...)`, the function
`ModelRunner._maybe_rebalance_after_rank_fault` calls each pass (ModelRunner does not
import without a GPU stack), then serves some more passes.

Stood in, beyond worker.py's:
  * the elastic EP state: SGLang's own `ElasticEPState` (`ElasticEPStateManager._build_state`
    on CPU) installed as the manager's instance, since `ElasticEPStateManager.init` wants
    an elastic backend (mooncake) that does not run here; the fault is marked the way
    that backend marks it, `active_ranks[lost] = 0`, on every rank;
  * the lost rank: gloo cannot run a collective without a member, so the lost rank's
    process stays for the fault path's collectives on the default group (the recorder's
    all-reduce, the plugin's agreement), which SGLang's elastic backend runs over the
    active ranks only; its own weight update is a no-op (it is dead: nothing it holds is
    read) and it exits right after the fault path, writing nothing more, a second later (its
    adapter, alive until then, must report no placement: the map it holds is not what the
    survivors serve);
  * storage: the experts no survivor holds are read by SGLang's "update weights from
    disk" callable; a stand-in writes the tiny model's reference weights for the slots
    of this rank (what a reload of the checkpoint gives).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from bench.sglang_cpu import NUM_EXPERTS, NUM_LAYERS, TOP_K, sglang_cpu_rank
from tests.engines.sglang.worker import SHAPES, TOKENS, _stand_in_model_runner, reference_weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lost", type=int, default=3, help="the rank lost")
    parser.add_argument("--before", type=int, default=2, help="passes before the fault (at least)")
    parser.add_argument("--after", type=int, default=8, help="passes after the fault")
    parser.add_argument(
        "--wait-plan",
        type=float,
        default=0.0,
        help="serve until every rank holds a planned survivor placement for the loss (at most "
        "this long), write <out>.planned and wait for <out>.go before the fault",
    )
    parser.add_argument(
        "--wait-joined",
        type=float,
        default=0.0,
        help="after --after passes, serve until the adapter serves the version the controller "
        "gave the resized world (at most this long)",
    )
    parser.add_argument("--step-sleep", type=float, default=0.02)
    args = parser.parse_args()
    rank, world, lost = args.rank, args.world, args.lost

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    import sglang.srt.server_args as server_args_module
    from sglang.srt.elastic_ep import elastic_ep
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
    from sglang.srt.eplb.eplb_algorithms import elasticity_aware
    from sglang.srt.eplb.eplb_manager import EPLBManager
    from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.eplb.expert_location_dispatch import (
        ExpertLocationDispatchInfo,
        topk_ids_logical_to_physical,
    )
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    from sglang.srt.plugins import load_plugins

    # SGLang's elastic EP runs the elasticity-aware algorithm (its ServerArgs insist).
    real_server_args = server_args_module.ServerArgs
    server_args_module.ServerArgs = functools.partial(
        real_server_args, eplb_algorithm="elasticity_aware"
    )
    try:
        model_config = sglang_cpu_rank(rank, world, Path(args.out).parent)
    finally:
        server_args_module.ServerArgs = real_server_args
    runner_class = _stand_in_model_runner()
    load_plugins()
    dist.barrier()
    runner_class(model_config).maybe_init_expert_location_metadata()

    state = ElasticEPStateManager._build_state(ep_size=world, device=torch.device("cpu"))
    state.effective_ep_size = state.original_ep_size = world
    ElasticEPStateManager._instance = state

    metadata = get_global_expert_location_metadata()
    recorder = get_global_expert_distribution_recorder()
    slots = metadata.num_local_physical_experts
    initial = metadata.physical_to_logical_map_cpu.clone()

    class TinyModel:
        routed_experts_weights_of_layer = {
            layer: [
                torch.stack(
                    [
                        reference_weights(layer, int(initial[layer, rank * slots + s]))[i]
                        for s in range(slots)
                    ]
                )
                for i in range(len(SHAPES))
            ]
            for layer in range(1, NUM_LAYERS)
        }

    model = TinyModel()
    weights = model.routed_experts_weights_of_layer

    def reload_from_storage(*_args: Any, **_kwargs: Any) -> None:
        served = get_global_expert_location_metadata().physical_to_logical_map_cpu
        for layer, tensors in weights.items():
            for s in range(slots):
                for i, tensor in enumerate(tensors):
                    tensor[s].copy_(
                        reference_weights(layer, int(served[layer, rank * slots + s]))[i]
                    )
        loaded["calls"] += 1

    loaded = {"calls": 0}

    class DeadRankUpdater:  # the lost rank moves nothing: it is dead (module docstring)
        def update(self, *_args: Any, **_kwargs: Any) -> list:
            return []

    updater: Any = DeadRankUpdater() if rank == lost else ExpertLocationUpdater()
    storage = type("Storage", (), {"update_weights_from_disk": staticmethod(reload_from_storage)})()
    manager = EPLBManager(
        model_config=model_config,
        get_model=lambda: model,
        get_expert_location_updater=lambda: updater,
        get_expert_backup_client=lambda: None,
        get_weight_updater=lambda: storage,
    )

    # The counts SGLang's fault path hands its algorithm: kept, to run SGLang's own
    # algorithm on them afterwards (what it installs when no plan answers).
    dumped: dict[str, Any] = {}
    dump = recorder.dump_record

    def tee_dump(*a: Any, **kw: Any) -> Any:
        out = dump(*a, **kw)
        if isinstance(out, dict):
            dumped["logical_count"] = out["logical_count"].clone()
        return out

    recorder.dump_record = tee_dump

    from worker_hooks.engines.sglang.plugin import current_adapter

    popularity = np.array([8, 6, 1, 1, 1, 1, 1, 1], dtype=np.float64)
    rng = np.random.default_rng(rank)
    counters = {"mismatches": 0, "to_lost": 0, "passes": 0}

    def serve_pass() -> None:
        step = counters["passes"]
        served = get_global_expert_location_metadata().physical_to_logical_map_cpu
        with recorder.with_forward_pass(step, None):
            for layer in range(1, NUM_LAYERS):
                with recorder.with_current_layer(layer):
                    p = np.roll(popularity, layer) / popularity.sum()
                    ids = np.stack(
                        [rng.choice(NUM_EXPERTS, TOP_K, replace=False, p=p) for _ in range(TOKENS)]
                    )
                    topk = torch.from_numpy(ids).to(torch.int32)
                    physical = topk_ids_logical_to_physical(
                        topk, ExpertLocationDispatchInfo.init_new(layer_id=layer)
                    )
                    recorder.on_select_experts(topk_ids=physical)
                    counters["mismatches"] += int((physical < 0).sum())
                    valid = physical >= 0
                    counters["mismatches"] += int(
                        (served[layer][physical.long()] != topk.long())[valid].sum()
                    )
                    counters["to_lost"] += int((physical[valid] // slots == lost).sum())
        manager.on_forward_pass_end()
        counters["passes"] += 1
        time.sleep(args.step_sleep)

    def every_rank(flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def holds_plan() -> bool:
        adapter = current_adapter()
        return (
            adapter is not None and adapter.agent.survivor_map([lost], adapter.version) is not None
        )

    for _ in range(args.before):
        serve_pass()
    planned = None
    if args.wait_plan > 0:
        deadline = time.monotonic() + args.wait_plan
        while not every_rank(holds_plan() or time.monotonic() > deadline):
            serve_pass()
        adapter = current_adapter()
        planned = adapter.agent.survivor_map([lost], adapter.version)
        Path(args.out + ".planned").write_text("")
        while not Path(args.out + ".go").exists():  # the test stops the controller meanwhile
            time.sleep(0.05)
        dist.barrier()
    before = get_global_expert_location_metadata().physical_to_logical_map_cpu.clone()
    counters["mismatches"] = counters["to_lost"] = 0

    # The fault: SGLang's elastic backend marks the rank inactive; the next pass runs the fault
    # path.
    state.active_ranks[lost] = 0
    rebalanced = elastic_ep.maybe_rebalance_after_rank_fault(eplb_manager=manager)
    after = get_global_expert_location_metadata()
    if rank == lost:
        # Dead from here (module docstring). It lingers a moment first, so that a placement
        # its adapter wrongly reported would reach the controller.
        time.sleep(1.0)
        os._exit(0)

    # SGLang's own algorithm on the same counts and active ranks (unhooked: the module's function).
    own_phy2log, own_log2phy, _ = elasticity_aware.rebalance_experts(
        weight=dumped["logical_count"].sum(dim=0)
        if dumped["logical_count"].dim() == 3
        else dumped["logical_count"],
        num_replicas=metadata.num_physical_experts,
        num_groups=1,
        num_nodes=1,
        num_gpus=world,
        enable_hierarchical=False,
        active_ranks=state.active_ranks,
    )
    installed = {
        "phy2log": after.physical_to_logical_map_cpu.tolist(),
        "log2phy": after.logical_to_all_physical_map_cpu.tolist(),
        "num_valid": after.logical_to_all_physical_map_num_valid.tolist(),
    }
    for _ in range(args.after):
        serve_pass()
    joined_by = time.monotonic() + args.wait_joined
    while (
        current_adapter() is not None
        and current_adapter().version == 0
        and time.monotonic() < joined_by
    ):
        serve_pass()
    final = get_global_expert_location_metadata().physical_to_logical_map_cpu

    def weights_match() -> bool:
        return all(
            torch.equal(
                weights[layer][i][s],
                reference_weights(layer, int(final[layer, rank * slots + s]))[i],
            )
            for layer in weights
            for s in range(slots)
            for i in range(len(SHAPES))
        )

    adapter = current_adapter()
    result = {
        "rank": rank,
        "rebalanced": bool(rebalanced),
        "before": before.tolist(),
        "installed": installed,
        "own_phy2log": own_phy2log.tolist(),
        "own_log2phy": own_log2phy.tolist(),
        "planned": None if planned is None else np.asarray(planned).tolist(),
        "final": final.tolist(),
        "weights_match_map": weights_match(),
        "storage_loads": loaded["calls"],
        "dispatch_mismatches": counters["mismatches"],
        "tokens_to_lost": counters["to_lost"],
        "adapter_phy2log": None if adapter is None else adapter.phy2log.tolist(),
        "adapter_version": None if adapter is None else adapter.version,
        "adapter_rank": None if adapter is None else adapter.rank,
        "windows_sent": None if adapter is None else adapter.windows.sent,
        "rank_faults": None if adapter is None else getattr(adapter.stats, "rank_faults", None),
    }
    if adapter is not None:
        adapter.finish(3.0)
    Path(args.out).write_text(json.dumps(result))
    os._exit(0)  # a peer is gone: no process-group teardown (SGLang's elastic backend has its own)


if __name__ == "__main__":
    main()
