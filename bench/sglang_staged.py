"""SGLang's updater vs the staged update, the same plans in one run, on SGLang's real code.

4 CPU ranks (gloo), each with SGLang's ExpertLocationMetadata, dispatch, EPLBManager and
ExpertLocationUpdater and the rebalancer's SGLang plugin (set up by bench/sglang_cpu.py, as
the SGLang tests' ranks are; no controller: a driver thread per rank hands the adapter the
plans, and all ranks confirm PREPARED on a gloo group of the driver's own before the commit).
Model: 1 dense + 8 MoE layers, 8 experts + 4 redundant slots over 4 ranks (3 slots per rank), each
expert 3 x (512 x 1024) float32 = 6 MiB. A forward pass is SGLang's dispatch of 16
tokens x top-2 per MoE layer, one small matmul on each layer's first live expert, a
10 ms sleep standing for the device's work (the CPU is free meanwhile, as a host thread
is while a GPU runs), and one all-reduce on SGLang's group (ranks in lockstep, as SGLang's
EP collectives make them).

Plans: A moves every rank's experts one rank on in every MoE layer (all 12 slots of all
8 MoE layers: 96 experts, 576 MiB per plan, 144 MiB into each rank), B moves them back. Rounds
alternate which update goes first; each update applies A then B; between rounds a window of passes
with no plan is the baseline. Per plan: the longest gap between two pass ends from the Prepare until
the plan is live on every rank, and passes per second over that window; the no-rebalance passes per
second come from the baseline windows of the same run.

    .venv/bin/python -m bench.sglang_staged [--rounds 3] [--json]

SGLang must be provisioned (.ci/run --tools, or scripts/sglang_env.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

from rebalancer.launch.processes import bound_to_this_process, free_port, reap

WORLD = 4
NUM_LAYERS = 9  # layer 0 dense, 1..8 MoE
NUM_EXPERTS = 8
REDUNDANT = 4
SLOTS = (NUM_EXPERTS + REDUNDANT) // WORLD
TOP_K = 2
TOKENS = 16
SHAPES = ((512, 1024), (512, 1024), (512, 1024))  # float32: 6 MiB per expert
PASS_SLEEP = 0.010
BASELINE_PASSES = 60
GAP_PASSES = 20  # passes after a plan is live before the next one


def reference_weights(layer: int, expert: int) -> list:
    import torch

    return [torch.full(shape, float(1000 * layer + expert)) for shape in SHAPES]


def worker(args: argparse.Namespace) -> None:
    rank = args.rank
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    from sglang.srt.eplb.eplb_manager import EPLBManager
    from sglang.srt.eplb.expert_distribution import (
        ExpertDistributionRecorder,
        set_global_expert_distribution_recorder,
    )
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.eplb.expert_location_dispatch import (
        ExpertLocationDispatchInfo,
        topk_ids_logical_to_physical,
    )
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    from sglang.srt.plugins import load_plugins

    from bench.sglang_cpu import sglang_cpu_rank
    from rebalancer.placement.transfers import transfers as transfer_list
    from rebalancer.v1 import rebalancer_pb2 as pb
    from rebalancer.wire import codec

    model_config = sglang_cpu_rank(
        rank, WORLD, Path(args.out).parent, NUM_LAYERS, rebalance_iterations=10**6
    )
    load_plugins()
    metadata = ExpertLocationMetadata.init_trivial(model_config, moe_ep_rank=rank)
    set_global_expert_location_metadata(metadata)
    recorder = ExpertDistributionRecorder.init_new(metadata, rank)
    set_global_expert_distribution_recorder(recorder)
    initial = metadata.physical_to_logical_map_cpu.numpy().astype(np.int64).copy()

    class Model:
        routed_experts_weights_of_layer = {
            layer: [
                torch.stack(
                    [
                        reference_weights(layer, int(initial[layer, rank * SLOTS + s]))[i]
                        for s in range(SLOTS)
                    ]
                )
                for i in range(len(SHAPES))
            ]
            for layer in range(1, NUM_LAYERS)
        }

    model = Model()
    updater = ExpertLocationUpdater()
    manager = EPLBManager(
        model_config=model_config,
        get_model=lambda: model,
        get_expert_location_updater=lambda: updater,
        get_expert_backup_client=lambda: None,
        get_weight_updater=lambda: None,
    )
    from worker_hooks.engines.sglang.plugin import current_adapter

    # Plan A: every slot's expert moves one rank on (MoE layers); plan B: back.
    moved = initial.copy()
    moved[1:] = np.roll(initial[1:], SLOTS, axis=1)
    driver_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    pass_ends: list[float] = []
    plans: list[dict] = []
    started = threading.Event()
    # The pass at which every rank stops: agreed by the drivers, so that no rank leaves
    # while its peers still wait in the per-pass all-reduce.
    stop_at = [2**62]

    def drive() -> None:
        started.wait()
        adapter = current_adapter()
        version, current = 0, initial
        schedule = []
        for r in range(args.rounds):
            modes = ["sglang", "staged"] if r % 2 == 0 else ["staged", "sglang"]
            schedule.append(("baseline", None))
            for mode in modes:
                schedule += [(mode, moved), (mode, initial)]
        schedule.append(("baseline", None))
        for mode, target in schedule:
            if mode == "baseline":
                t0 = time.perf_counter()
                n0 = len(pass_ends)
                while len(pass_ends) < n0 + BASELINE_PASSES:
                    time.sleep(0.002)
                plans.append({"mode": mode, "start": t0, "end": time.perf_counter()})
                continue
            version += 1
            adapter.updater = mode
            moves = transfer_list(current, target, WORLD)
            prepare = pb.Prepare(
                version=version,
                base_version=version - 1,
                placement=pb.Placement(phy2log=codec.encode(target.astype(np.int32))),
                transfers=codec.encode(moves.astype(np.int32)),
            )
            prepared = adapter.stats.prepared
            dist.barrier(group=driver_group)
            t0 = time.perf_counter()
            adapter.on_prepare(prepare)
            while adapter.stats.prepared == prepared:
                time.sleep(0.001)
            dist.barrier(group=driver_group)  # every rank PREPARED: the controller's Commit
            adapter.on_commit(version)
            while adapter.version != version:
                time.sleep(0.001)
            t1 = time.perf_counter()
            dist.barrier(group=driver_group)
            plans.append(
                {
                    "mode": mode,
                    "version": version,
                    "start": t0,
                    "end": t1,
                    "bytes_in": int((moves[:, 1] == rank).sum()) * expert_bytes,
                }
            )
            current = target
            n0 = len(pass_ends)
            while len(pass_ends) < n0 + GAP_PASSES:
                time.sleep(0.002)
        last = torch.tensor([len(pass_ends) + GAP_PASSES])
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=driver_group)
        stop_at[0] = int(last.item())

    expert_bytes = sum(int(np.prod(s)) for s in SHAPES) * 4
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    lockstep = torch.zeros(1)
    rng = np.random.default_rng(rank)
    tokens = torch.randn(TOKENS, 512)
    step = 0
    weights_ok = True
    while step < stop_at[0]:
        with recorder.with_forward_pass(step, None):
            for layer in range(1, NUM_LAYERS):
                with recorder.with_current_layer(layer):
                    ids = np.stack(
                        [rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(TOKENS)]
                    )
                    topk = torch.from_numpy(ids).to(torch.int32)
                    physical = topk_ids_logical_to_physical(
                        topk, ExpertLocationDispatchInfo.init_new(layer_id=layer)
                    )
                    recorder.on_select_experts(topk_ids=physical)
                    _ = tokens @ model.routed_experts_weights_of_layer[layer][0][0]
        time.sleep(PASS_SLEEP)
        dist.all_reduce(lockstep)  # SGLang's ranks run their passes in lockstep
        manager.on_forward_pass_end()
        pass_ends.append(time.perf_counter())
        if step == 0:
            started.set()
        step += 1
    driver.join()
    final = get_global_expert_location_metadata().physical_to_logical_map_cpu
    for layer in range(1, NUM_LAYERS):
        for s in range(SLOTS):
            expect = float(1000 * layer + int(final[layer, rank * SLOTS + s]))
            weights_ok &= all(
                bool((w[s] == expect).all()) for w in model.routed_experts_weights_of_layer[layer]
            )
    adapter = current_adapter()
    Path(args.out).write_text(
        json.dumps(
            {
                "rank": rank,
                "pass_ends": pass_ends,
                "plans": plans,
                "weights_match_map": weights_ok,
                "swap_seconds": adapter.stats.swap_seconds,
                "update_seconds": adapter.stats.update_seconds,
                "groups": adapter.stats.groups,
            }
        )
    )
    adapter.finish(timeout=0.5)
    dist.destroy_process_group()


def window_stats(pass_ends: np.ndarray, start: float, end: float) -> tuple[float, float]:
    """Longest gap between pass ends touching [start, end] (ms) and passes per second."""
    inside = pass_ends[(pass_ends >= start) & (pass_ends <= end)]
    before = pass_ends[pass_ends < start][-1:]
    after = pass_ends[pass_ends > end][:1]
    ends = np.concatenate([before, inside, after])
    gap = float(np.diff(ends).max() * 1e3) if len(ends) > 1 else float("nan")
    span = float(ends[-1] - ends[0]) if len(ends) > 1 else float("nan")
    return gap, (len(ends) - 1) / span


def summarise(results: list[dict]) -> dict:
    r0 = results[0]  # ranks are in lockstep: rank 0's passes are the group's
    ends = np.asarray(r0["pass_ends"])
    rows: dict[str, list[tuple[float, float, float]]] = {"baseline": [], "sglang": [], "staged": []}
    for plan in r0["plans"]:
        gap, rate = window_stats(ends, plan["start"], plan["end"])
        rows[plan["mode"]].append((gap, rate, plan["end"] - plan["start"]))
    base_rate = float(np.median([r for _, r, _ in rows["baseline"]]))
    base_gap = float(np.median([g for g, _, _ in rows["baseline"]]))

    def spread(values: list[float]) -> list[float]:
        return [round(min(values), 2), round(float(np.median(values)), 2), round(max(values), 2)]

    updater_gap = max(g for g, _, _ in rows["sglang"])
    staged_gap = max(g for g, _, _ in rows["staged"])
    staged_rate = float(np.median([r for _, r, _ in rows["staged"]]))
    updater_rate = float(np.median([r for _, r, _ in rows["sglang"]]))
    return {
        "expert_mib": sum(int(np.prod(s)) for s in SHAPES) * 4 / 2**20,
        "plans_per_update": len(rows["staged"]),
        "mib_in_per_rank_per_plan": r0["plans"][1]["bytes_in"] / 2**20,
        "baseline_pass_ms": round(1e3 / base_rate, 2),
        "baseline_max_gap_ms": round(base_gap, 2),
        "updater_max_gap_ms": round(updater_gap, 2),
        "staged_max_gap_ms": round(staged_gap, 2),
        "gap_ratio": round(updater_gap / staged_gap, 1),
        "updater_gap_ms_min_median_max": spread([g for g, _, _ in rows["sglang"]]),
        "staged_gap_ms_min_median_max": spread([g for g, _, _ in rows["staged"]]),
        "updater_window_s_median": round(float(np.median([w for _, _, w in rows["sglang"]])), 3),
        "staged_window_s_median": round(float(np.median([w for _, _, w in rows["staged"]])), 3),
        "updater_throughput_ratio": round(updater_rate / base_rate, 3),
        "staged_throughput_ratio": round(staged_rate / base_rate, 3),
        "staged_throughput_ratio_min": round(min(r for _, r, _ in rows["staged"]) / base_rate, 3),
        "staged_swap_ms_max": round(max(max(r["swap_seconds"]) for r in results) * 1e3, 2),
        "updater_update_ms_max": round(max(max(r["update_seconds"]) for r in results) * 1e3, 2),
        "staged_groups": r0["groups"],
        "weights_match_map": all(r["weights_match_map"] for r in results),
        "load_1min": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--staging-budget-bytes",
        type=int,
        default=None,
        help="REBALANCER_STAGING_BUDGET_BYTES (default: the adapter's)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from bench import sglang_cpu

    if not sglang_cpu.available():
        sys.exit(sglang_cpu.MISSING)
    with tempfile.TemporaryDirectory() as tmp:
        settings = {
            "REBALANCER_ADDRESS": f"unix:{tmp}/no-controller.sock",
            "REBALANCER_AGREE_EVERY": "2",
            "REBALANCER_WINDOW_STEPS": "16",
            "TMPDIR": tmp,
        }
        if args.staging_budget_bytes is not None:
            settings["REBALANCER_STAGING_BUDGET_BYTES"] = str(args.staging_budget_bytes)
        env = sglang_cpu.environment(**settings)
        port = free_port()
        procs = []
        try:
            for rank in range(WORLD):
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.sglang_staged",
                    "--worker",
                    "--rank",
                    str(rank),
                    "--port",
                    str(port),
                    "--out",
                    f"{tmp}/rank{rank}.json",
                    "--rounds",
                    str(args.rounds),
                ]
                log = open(f"{tmp}/rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
                procs.append(
                    (
                        subprocess.Popen(
                            bound_to_this_process(cmd),
                            cwd=sglang_cpu.ROOT,
                            env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        ),
                        log,
                    )
                )
            codes = [p.wait(timeout=900) for p, _ in procs]
        finally:
            reap([p for p, _ in procs], terminate=False)
            for _, log in procs:
                log.close()
        if codes != [0] * WORLD:
            tails = "\n".join(Path(f"{tmp}/rank{r}.log").read_text()[-2000:] for r in range(WORLD))
            sys.exit(f"ranks exited with {codes}:\n{tails}")
        results = [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(WORLD)]
    summary = summarise(results)
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:34s} {value}")


if __name__ == "__main__":
    main()
