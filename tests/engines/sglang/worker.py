"""One SGLang EP rank on CPU for the adapter's tests: SGLang's real EPLB code, a tiny MoE.

Run by tests/engines/sglang/test_plugin.py as `python -m tests.engines.sglang.worker` (forked
from the session's zygote that has imported SGLang, tests/engines/zygote.py)
with SGLang's folder (and cpu_shims) on PYTHONPATH. Real parts: SGLang's ServerArgs and
runtime context, ExpertLocationMetadata, the expert distribution recorder (stat mode),
dispatch (`topk_ids_logical_to_physical`), EPLBManager, ExpertLocationUpdater, the
plugin loader (entry point discovery + HookRegistry), and torch.distributed gloo
moving the weights (the staged update: the adapter's own executor over gloo). Stood in: the model (a
dict of expert weight tensors, the `routed_experts_weights_of_layer` SGLang's updater moves) and the
model-class lookup `ModelConfigForExpertLocation.from_model_config` (it would import SGLang's
DeepSeek model code, which needs GPU kernels), the recorder's `get_device` (answers "cpu") and
`torch.cpu.empty_cache` (a no-op the updater calls once), set up by
bench/sglang_cpu.py (`sglang_cpu_rank`, shared with bench/sglang_staged.py);
triton and torchvision are stubs (bench/cpu_shims).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from bench.sglang_cpu import NUM_EXPERTS, NUM_LAYERS, TOP_K, sglang_cpu_rank

TOKENS = 16
SHAPES = ((4, 3), (3, 2))  # two weight tensors per expert, like w13 and w2


def reference_weights(layer: int, expert: int) -> list:
    import torch

    g = torch.Generator().manual_seed(1000 * layer + expert)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def _stand_in_model_runner() -> type:
    """SGLang's `ModelRunner` module does not import without a GPU stack: a stand-in class
    at its path whose `maybe_init_expert_location_metadata` is SGLang's own body (the
    real `compute_initial_expert_location_metadata` and recorder), so SGLang's
    HookRegistry wraps it (the plugin's warm start) as it wraps the real one."""
    import sys
    import types

    from sglang.srt.eplb.expert_distribution import (
        ExpertDistributionRecorder,
        set_global_expert_distribution_recorder,
    )
    from sglang.srt.eplb.expert_location import (
        compute_initial_expert_location_metadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.runtime_context import get_parallel

    class ModelRunner:
        is_draft_worker = False

        def __init__(self, model_config: object) -> None:
            self.model_config = model_config

        def maybe_init_expert_location_metadata(self) -> None:
            expert_rank = get_parallel().moe_ep_rank
            set_global_expert_location_metadata(
                compute_initial_expert_location_metadata(
                    model_config=self.model_config, moe_ep_rank=expert_rank
                )
            )
            set_global_expert_distribution_recorder(
                ExpertDistributionRecorder.init_new(
                    get_global_expert_location_metadata(), rank=expert_rank
                )
            )

    module = types.ModuleType("sglang.srt.model_executor.model_runner")
    module.ModelRunner = ModelRunner  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    return ModelRunner


def lp_solvers_match() -> bool:
    """SGLang's lp solvers (one per layer) were built from the expert location metadata
    served now: each solver's replica table and replicated slots are the map's."""
    import torch
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.eplb.lplb_solver import get_global_lplb_solver

    metadata = get_global_expert_location_metadata()
    for layer in range(metadata.num_layers):
        solver = get_global_lplb_solver(layer)
        phy2log = metadata.physical_to_logical_map_cpu[layer]
        logcnt = torch.bincount(phy2log, minlength=metadata.num_logical_experts)
        replicated = torch.nonzero(logcnt[phy2log] > 1).flatten()
        if (
            solver is None
            or not torch.equal(solver.log2phy, metadata.logical_to_all_physical_map_cpu[layer])
            or not torch.equal(solver.phy_replicated, replicated)
        ):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-sleep", type=float, default=0.01)
    parser.add_argument(
        "--die-at-layer",
        type=int,
        default=None,
        help="exit inside SGLang's updater at this layer of the first plan",
    )
    parser.add_argument(
        "--adapter-error-at-pass",
        type=int,
        default=None,
        help="the adapter raises on this pass's counts (1-based): an adapter bug",
    )
    parser.add_argument(
        "--die-in-staging",
        action="store_true",
        help="exit inside the staged update's weight transfer of the first plan",
    )
    parser.add_argument(
        "--dispatch",
        default=None,
        help="SGLang's --ep-dispatch-algorithm (lp: see bench.sglang_cpu._lp_stand_ins)",
    )
    parser.add_argument(
        "--recorder-mode", default=None, help="SGLang's --expert-distribution-recorder-mode"
    )
    parser.add_argument(
        "--lag-staging",
        type=float,
        default=0.0,
        help="this rank's staging of every layer group after a plan's first ends this long "
        "after its transfers (the others wait for it at the agreement)",
    )
    parser.add_argument(
        "--no-finish",
        action="store_true",
        help="never call the adapter's finish(), as SGLang does not: the plugin's exit hook must",
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
        timeout=timedelta(seconds=15),
    )
    from sglang.srt.eplb import expert_location_updater
    from sglang.srt.eplb.eplb_manager import EPLBManager
    from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
    from sglang.srt.eplb.expert_location import (
        get_global_expert_location_metadata,
    )
    from sglang.srt.eplb.expert_location_dispatch import (
        ExpertLocationDispatchInfo,
        topk_ids_logical_to_physical,
    )
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    from sglang.srt.plugins import load_plugins

    # In the test's own folder (beside --out), which the test removes: a folder of our own
    # in /tmp outlived every run.
    model_config = sglang_cpu_rank(
        rank,
        args.world,
        Path(args.out).parent,
        dispatch=args.dispatch,
        recorder_mode=args.recorder_mode,
    )
    runner_class = _stand_in_model_runner()
    load_plugins()  # SGLang's own loader: finds worker_hooks.engines.sglang:register by entry point

    # SGLang's start step, through the plugin's hook when it wraps it (a pool's warm start).
    # The ranks enter the step together (SGLang's own init holds them in step). A rank
    # that imported SGLang late on a loaded machine is waited for up to 2 minutes, not
    # the group's 15 s (which still bounds every later collective).
    dist.monitored_barrier(timeout=timedelta(seconds=120))
    began = time.monotonic()
    runner_class(model_config).maybe_init_expert_location_metadata()
    started_seconds = time.monotonic() - began
    if args.dispatch == "lp":  # after load_model, as ModelRunner.maybe_init_lplb_solvers
        from sglang.srt.model_executor.model_runner_components.moe_ep_setup import init_lplb_solvers

        init_lplb_solvers(model_config=model_config)
    metadata = get_global_expert_location_metadata()
    recorder = get_global_expert_distribution_recorder()
    slots = metadata.num_local_physical_experts
    phy2log = metadata.physical_to_logical_map_cpu.clone()

    class TinyModel:
        routed_experts_weights_of_layer = {
            layer: [
                torch.stack(
                    [
                        reference_weights(layer, int(phy2log[layer, rank * slots + s]))[i]
                        for s in range(slots)
                    ]
                )
                for i in range(len(SHAPES))
            ]
            for layer in range(1, NUM_LAYERS)
        }

    model = TinyModel()

    def weights_match(layers: range) -> bool:
        final = get_global_expert_location_metadata().physical_to_logical_map_cpu
        return all(
            torch.equal(
                model.routed_experts_weights_of_layer[layer][i][s],
                reference_weights(layer, int(final[layer, rank * slots + s]))[i],
            )
            for layer in layers
            for s in range(slots)
            for i in range(len(SHAPES))
        )

    updater = ExpertLocationUpdater()
    manager = EPLBManager(
        model_config=model_config,
        get_model=lambda: model,
        get_expert_location_updater=lambda: updater,
        get_expert_backup_client=lambda: None,
        get_weight_updater=lambda: None,
    )

    if args.die_at_layer is not None:  # die inside SGLang's updater, mid-transfer
        original = expert_location_updater.update_expert_weights_single_layer
        calls = {"n": 0}

        def dying(*a, **kw):
            calls["n"] += 1
            if calls["n"] == args.die_at_layer:
                os._exit(3)
            return original(*a, **kw)

        expert_location_updater.update_expert_weights_single_layer = dying

    if args.die_in_staging:  # die inside the transfer, after every rank took the plan
        from worker_hooks.transports import p2p

        def dying_receive(self, plan):
            os._exit(3)

        p2p.P2PTransport.receive = dying_receive

    from worker_hooks.engines.sglang import plugin, warm_start
    from worker_hooks.engines.sglang.plugin import current_adapter

    if args.adapter_error_at_pass is not None:  # a bug in the adapter, on every rank at once
        from worker_hooks.engines.sglang.adapter import SGLangRebalanceAdapter

        counted = SGLangRebalanceAdapter.add_pass_counts
        passes = {"n": 0}

        def failing(self, counts):
            passes["n"] += 1
            if passes["n"] == args.adapter_error_at_pass:
                raise RuntimeError("injected adapter error")
            return counted(self, counts)

        SGLangRebalanceAdapter.add_pass_counts = failing

    if args.lag_staging > 0:  # the groups staged after the commit, beside serving, end late here
        from worker_hooks.session.staging import ticket_parts
        from worker_hooks.transports import p2p

        exchange = p2p.P2PTransport.receive

        def lagging(self, plan):  # noqa: ANN001, ANN202
            got = exchange(self, plan)  # the transfers with the peers, on time
            if ticket_parts(plan.version)[1] > 1:  # a group after the first: its staging ends late
                time.sleep(args.lag_staging)
            return got

        p2p.P2PTransport.receive = lagging

    # What the adapter hands its agent, summed per (layer, expert): the windows as they go
    # to the controller (the agent itself is the real one).
    from worker_hooks.agent import WorkerAgent

    sent: dict[str, Any] = {
        "logical": np.zeros((NUM_LAYERS, NUM_EXPERTS), dtype=np.int64),
        "windows": [],
    }
    submit = WorkerAgent.submit_window

    def tee(self, first_step, num_steps, version, logical, physical):  # noqa: ANN001, ANN202
        sent["logical"] += np.asarray(logical, dtype=np.int64)
        sent["windows"].append([int(first_step), int(num_steps), int(version), physical is None])
        return submit(self, first_step, num_steps, version, logical, physical)

    WorkerAgent.submit_window = tee

    from sglang.srt.eplb.lplb_solver import get_global_lplb_solver

    # The per_token recorder reads the batch's tokens (SGLang's ForwardBatch): a stand-in
    # with the fields it reads; the other modes read none (None, as before).
    forward_batch = None
    if args.recorder_mode == "per_token":
        import types

        forward_batch = types.SimpleNamespace(
            input_ids=torch.zeros(TOKENS, dtype=torch.int64),
            positions=torch.arange(TOKENS),
            extend_seq_lens_cpu=[TOKENS],
            forward_mode=types.SimpleNamespace(value=1),
        )
    # Skewed routing: experts 0 and 1 (both on rank 0 at first) take most tokens.
    popularity = np.array([8, 6, 1, 1, 1, 1, 1, 1], dtype=np.float64)
    rng = np.random.default_rng(rank)
    mismatches = 0
    served = 0
    weight_mismatch_passes = 0  # passes after which a layer's weights differ from its map
    routed = np.zeros((NUM_LAYERS, NUM_EXPERTS), dtype=np.int64)  # picks per (layer, expert)
    tickets: list[list[int]] = []  # (pass, ticket) at each swap: what the ranks agreed on
    for step in range(args.steps):
        with recorder.with_forward_pass(step, forward_batch):
            for layer in range(1, NUM_LAYERS):
                with recorder.with_current_layer(layer):
                    p = np.roll(popularity, layer) / popularity.sum()
                    ids = np.stack(
                        [rng.choice(NUM_EXPERTS, TOP_K, replace=False, p=p) for _ in range(TOKENS)]
                    )
                    np.add.at(routed[layer], ids.ravel(), 1)
                    topk = torch.from_numpy(ids).to(torch.int32)
                    info = ExpertLocationDispatchInfo.init_new(layer_id=layer)
                    if (
                        args.dispatch == "lp"
                    ):  # SGLang's select_experts: the layer's solver, then dispatch
                        physical = topk_ids_logical_to_physical(
                            topk, info, get_global_lplb_solver(layer).solve(topk)
                        )
                    else:
                        physical = topk_ids_logical_to_physical(topk, info)
                    recorder.on_select_experts(topk_ids=physical)
                    # Same math: every slot a token goes to holds the expert it chose.
                    current = get_global_expert_location_metadata().physical_to_logical_map_cpu
                    mismatches += int((physical < 0).sum())
                    mismatches += int(
                        (current[layer][physical.long()] != topk.long())[physical >= 0].sum()
                    )
        manager.on_forward_pass_end()
        served += 1
        live = current_adapter()
        if live is not None and (not tickets or tickets[-1][1] != live._ticket):
            tickets.append([live.step, live._ticket])
        weight_mismatch_passes += 0 if weights_match(range(1, NUM_LAYERS)) else 1
        time.sleep(args.step_sleep)

    adapter = current_adapter()
    final = get_global_expert_location_metadata().physical_to_logical_map_cpu
    weights_ok = weights_match(range(1, NUM_LAYERS))
    if adapter is None:  # refused at the first pass: SGLang served on its own
        Path(args.out).write_text(
            json.dumps(
                {
                    "rank": rank,
                    "adapter": False,
                    "served": served,
                    "disabled": plugin.disabled_reason(),
                    "dispatch_mismatches": mismatches,
                    "weights_match_map": weights_ok,
                    "phy2log": final.tolist(),
                    "initial_phy2log": phy2log.tolist(),
                }
            )
        )
        dist.destroy_process_group()
        return
    agent_running = adapter.agent._thread.is_alive()
    if not args.no_finish:
        adapter.finish()
    result = {
        "rank": rank,
        "version": adapter.version,
        "commits": adapter.stats.commits,
        "windows": adapter.windows.sent,
        "steps": adapter.stats.steps,
        "phy2log": final.tolist(),
        "initial_phy2log": phy2log.tolist(),
        "adapter_phy2log": adapter.phy2log.tolist(),
        "weights_match_map": weights_ok,
        "dispatch_mismatches": mismatches,
        "broken": adapter.broken,
        "update_seconds": adapter.stats.update_seconds,
        "served": served,
        "disabled": plugin.disabled_reason(),
        "agent_running": agent_running,
        "weight_mismatch_passes": weight_mismatch_passes,
        "groups": adapter.stats.groups,
        "swap_seconds": adapter.stats.swap_seconds,
        "aborted": adapter.stats.aborted,
        "warm_start": (warm_start.taken() or (0, None))[0],
        "started_seconds": started_seconds,
        "updater": adapter.updater,
        "routed_logical": routed.tolist(),
        "sent_logical": sent["logical"].tolist(),
        "sent_windows": sent["windows"],
        "tickets": tickets,
        "lp_solvers_match": lp_solvers_match() if args.dispatch == "lp" else None,
    }
    Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
