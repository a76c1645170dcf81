"""Expert migration between two GPUs while serving: `python -m bench.gpu_migration`.

One process per GPU, NCCL. In one run it measures:
1. the ceiling: a plain GPU0 -> GPU1 `copy_` (one process, both GPUs), and NCCL
   send/recv at a few message sizes, one way and both ways at once;
2. a real plan: DeepSeek-V3-sized experts (bf16, w13 + w2 = 84 MiB each) placed
   trivially, rebalanced for DeepSeek-V3 routing from rebalancer/data with the
   migration-aware `rebalancer.placement.compute_placement(previous=...)`, moved by
   `MigrationExecutor.prepare` with each configured mover (a `MigrationConfig` per
   spec, so one of worker_hooks.transports: NCCL point-to-point on its own
   process group and side stream, rounds pipelined or not; peers' live weights or
   outboxes mapped through CUDA IPC and read by the copy engines; any of them paced to
   a GB/s cap): GB/s per direction;
3. the MoE block's graph replay time on each GPU while that migration runs beside it,
   against idle replays before and after (the throughput dip);
4. the commit pause (staged weights into live slots, maps swapped in place; with
   spare rows, worker_hooks/rows.py, the experts already sit in free rows and only
   the maps are swapped: `--spare-rows 0 32` runs both, the first as the baseline) and
   invariant 1: the 2-GPU block output for the same input is bit-identical before
   and after the rebalance (per-pick exact reduction), and moved slots hold exactly
   the weights of their new expert;
5. the balance effect: step time (slowest GPU) of the block under replayed
   DeepSeek-V3 routing with the trivial placement vs the rebalanced one.
Prints one line per figure on rank 0 and a JSON object last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.gpu_hooks import capture
from bench.p2p_exchange import packed_exchange
from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3
from rebalancer.placement.engine import compute_placement
from rebalancer.placement.metrics import balancedness_per_layer, trivial_placement
from rebalancer.placement.transfers import transfers
from worker_hooks.config import MigrationConfig
from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.examples.moe_gpu import MoEBlockConfig, ReferenceMoEBlock, expert_weights
from worker_hooks.migration import MigrationExecutor
from worker_hooks.record import ExpertRecorder
from worker_hooks.rows import RowMap, replica_rows
from worker_hooks.transports import transport_class

WORLD = 2


@dataclass
class MigrationBenchConfig:
    workload: str = "prefill_in4096"
    num_layers: int = 4
    num_redundant: int = 32
    tokens: int = 16384
    overlap_tokens: int = 4096
    exact_tokens: int = 256
    layers_per_chunk: int = 1
    replays: int = 10
    rounds: int = 5
    migration_repeats: int = 5
    port: int = 29517
    cta_caps: tuple[int, ...] = ()
    chunk_experts: int = 32
    # Movers (see parse_mover): "p2p:<layers per round>:<rounds in flight>[:<GB/s cap>]",
    # "ipc[:<copy streams>[:<GB/s cap>]]", "outbox:<MiB per outbox>[:<GB/s cap>]",
    # "packed" (the hand-packed NCCL harness).
    movers: tuple[str, ...] = ("p2p:4:1", "p2p:1:2", "ipc:1", "ipc:2", "ipc:4", "ipc:2:150")
    # The mover whose plan is committed for the invariant-1 check.
    commit_mover: str = "ipc:2"
    beside_repeats: int = 8
    # One full run per value: spare weight rows per layer and GPU (0: copy at commit).
    spare_rows: tuple[int, ...] = (0,)
    # sys.setswitchinterval for the worker processes; 0 keeps Python's default (5 ms).
    switch_interval: float = 0.0


def parse_mover(spec: str) -> MigrationConfig | None:
    """The MigrationExecutor settings of a mover spec (module docstring of the config);
    None for the packed harness."""
    kind, *args = spec.split(":")
    try:
        if kind == "p2p" and len(args) in (2, 3):
            return MigrationConfig(
                "p2p",
                layers_per_chunk=int(args[0]),
                rounds_in_flight=int(args[1]),
                max_gbps=float(args[2]) if len(args) == 3 else 0.0,
            )
        if kind == "outbox" and len(args) in (1, 2):
            return MigrationConfig(
                "outbox",
                outbox_bytes=int(args[0]) << 20,
                max_gbps=float(args[1]) if len(args) == 2 else 0.0,
            )
        if kind == "ipc" and len(args) in (0, 1, 2):
            return MigrationConfig(
                "ipc",
                copy_streams=int(args[0]) if args else 2,
                max_gbps=float(args[1]) if len(args) == 2 else 0.0,
            )
        if kind == "packed" and not args:
            return None
    except ValueError:  # also a setting MigrationConfig refuses
        pass
    raise SystemExit(
        f"bad mover {spec!r}: p2p:LAYERS:ROUNDS[:GBPS], ipc[:STREAMS[:GBPS]], outbox:MIB[:GBPS] "
        "or packed"
    )


def pick_layers(counts: np.ndarray, cfg: MigrationBenchConfig, num_slots: int) -> np.ndarray:
    """The layers the trivial placement balances worst on 2 GPUs (stated rule)."""
    per_layer = balancedness_per_layer(
        trivial_placement(len(counts), 256, num_slots, WORLD), counts, WORLD
    )
    return np.sort(np.argsort(per_layer)[: cfg.num_layers])


def sample_routing(
    counts: np.ndarray, tokens: int, top_k: int, dev: torch.device, seed: int
) -> torch.Tensor:
    """[L, T, K] expert ids drawn without replacement from each layer's real counts."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    prob = torch.as_tensor(counts, dtype=torch.float32, device=dev) + 1e-3
    ids = [torch.multinomial(p.expand(tokens, -1).contiguous(), top_k, generator=gen) for p in prob]
    return torch.stack(ids)


def replay_ms(graph: torch.cuda.CUDAGraph, n: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def max_over_ranks(value: float, dev: torch.device) -> float:
    t = torch.tensor([value], device=dev, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def nccl_p2p(rank: int, group: dist.ProcessGroup, dev: torch.device) -> dict[str, float]:
    """GB/s per direction of NCCL send/recv at several message sizes."""
    out: dict[str, float] = {}
    peer = 1 - rank
    for mib in (44, 84, 336, 1344):
        send = torch.empty(mib << 20, dtype=torch.uint8, device=dev).random_()
        recv = torch.empty_like(send)
        for both in (False, True):
            reps = max(3, 4096 // mib)

            def once(send=send, recv=recv, both=both) -> None:  # type: ignore[no-untyped-def]
                ops = []
                if both or rank == 0:
                    ops.append(dist.P2POp(dist.isend, send, peer, group))
                if both or rank == 1:
                    ops.append(dist.P2POp(dist.irecv, recv, peer, group))
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

            once()
            torch.cuda.synchronize()
            dist.barrier(group)
            t0 = time.perf_counter()
            for _ in range(reps):
                once()
            torch.cuda.synchronize()
            dt = max_over_ranks(time.perf_counter() - t0, dev)
            out[f"nccl_{'bidir' if both else 'oneway'}_{mib}MiB_GBps"] = (
                reps * send.numel() / dt / 1e9
            )
        del send, recv
    return out


def worker(rank: int, cfg: MigrationBenchConfig, result_path: str, spare: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(cfg.port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    if cfg.switch_interval > 0:
        sys.setswitchinterval(cfg.switch_interval)
    dist.init_process_group(
        "nccl", rank=rank, world_size=WORLD, device_id=dev, timeout=datetime.timedelta(seconds=90)
    )
    migrate_group = dist.new_group([0, 1])  # transfers stay off serving's communicator
    log: dict[str, object] = {}

    def say(key: str, value: float) -> None:
        log[key] = value
        if rank == 0:
            print(f"{key:40s} {value:14.4f}", flush=True)

    for k, v in nccl_p2p(rank, migrate_group, dev).items():
        say(k, v)

    # -- the plan: trivial -> rebalanced for the real workload ---------------------
    path = next(p for p in deepseek_v3_files() if p.stem == cfg.workload)
    all_counts = load_deepseek_v3(path)
    num_experts = all_counts.shape[1]
    num_slots = num_experts + cfg.num_redundant
    layers = pick_layers(all_counts, cfg, num_slots)
    counts = all_counts[layers]
    old = trivial_placement(cfg.num_layers, num_experts, num_slots, WORLD)
    # Migration-aware: the rebalanced placement keeps what it can where it is.
    placed = compute_placement(counts, num_slots, WORLD, previous=old)
    new = placed.phy2log
    plan = transfers(old, new, WORLD)
    old_bal = balancedness_per_layer(old, counts, WORLD)
    new_bal = balancedness_per_layer(new, counts, WORLD)
    say("plan_moved_slots", float(len(plan)))
    say("plan_moved_fraction", placed.moved_fraction)
    say("plan_cross_gpu_moves", float((plan[:, 1] != plan[:, 3]).sum()))
    say("balancedness_trivial", float(old_bal.mean()))
    say("balancedness_rebalanced", float(new_bal.mean()))
    if rank == 0:
        log["layers"] = layers.tolist()

    mcfg = MoEBlockConfig(
        num_layers=cfg.num_layers,
        num_gpus=WORLD,
        rank=rank,
        num_redundant=cfg.num_redundant,
        spare_rows=spare,
    )
    say("expert_MiB", mcfg.expert_bytes() / 2**20)
    say("spare_rows", float(spare))
    width = int(
        max(np.bincount(row, minlength=num_experts).max() for row in np.concatenate([old, new]))
    )
    rows = RowMap(WORLD, cfg.num_layers, mcfg.slots_per_gpu, spare)
    num_rows = WORLD * mcfg.rows_per_gpu  # dispatch hands out row ids
    disps = [
        ReplicaDispatch(
            replica_rows(old, rows.row_ids(), num_experts, width),
            WORLD,
            r,
            device=dev,
            num_physical=num_rows,
        )
        for r in range(WORLD)
    ]
    rec = ExpertRecorder(cfg.num_layers, num_experts, num_physical=num_rows, device=dev)
    t0 = time.perf_counter()
    block = ReferenceMoEBlock(
        mcfg, torch.from_numpy(old), dev, dispatch=disps, recorder=rec, seed=0
    )
    say("fill_seconds", time.perf_counter() - t0)

    # -- graphs: local expert work only (no collective), one for the balance figure --
    x_big = torch.randn(cfg.tokens, mcfg.hidden, device=dev, dtype=mcfg.dtype)
    routed_big = sample_routing(counts, cfg.tokens, mcfg.top_k, dev, seed=1)
    out_big = torch.empty_like(x_big)

    def local_step(x: torch.Tensor, routed: torch.Tensor, out: torch.Tensor) -> None:
        y = x
        for layer in range(cfg.num_layers):
            ids, weight = block.route(layer, y, routed[layer])
            phys = block.dispatch(layer, ids)
            rec.record(layer, block.own_chunk(ids))
            rec.record_physical(layer, block.own_chunk(phys))
            per_pick = block.experts(layer, y, phys)
            y = (y.float() + (per_pick.float() * weight[..., None]).sum(1)).to(y.dtype)
        out.copy_(y)

    g_big = capture(lambda: local_step(x_big, routed_big, out_big))
    x_ov = x_big[: cfg.overlap_tokens]
    routed_ov = routed_big[:, : cfg.overlap_tokens].contiguous()
    out_ov = torch.empty_like(x_ov)
    g_ov = capture(lambda: local_step(x_ov, routed_ov, out_ov))

    def step_times() -> tuple[float, float]:
        local = statistics.median(replay_ms(g_big, cfg.replays) for _ in range(cfg.rounds))
        dist.barrier()
        return local, max_over_ranks(local, dev)

    local_trivial, step_trivial = step_times()
    say("step_ms_trivial_slowest_gpu", step_trivial)
    log["step_ms_trivial_this_gpu"] = local_trivial

    # -- invariant 1 reference: exact 2-GPU block output before the move -----------
    x_small = torch.randn(
        cfg.exact_tokens,
        mcfg.hidden,
        device=dev,
        dtype=mcfg.dtype,
        generator=torch.Generator(device=dev).manual_seed(7),
    )
    routed_small = sample_routing(counts, cfg.exact_tokens, mcfg.top_k, dev, seed=2)
    block.group = dist.group.WORLD
    before = block.forward(x_small, routed_small, exact=True)
    block.group = None
    torch.cuda.synchronize()

    # -- migration: alone, then beside serving -------------------------------------
    # Movers: the project's MigrationExecutor and the packed harness, each on a default
    # NCCL group and on one whose kernels are capped to a few CTAs (SMs) while serving
    # replays on a high-priority stream. Serving is timed two ways: one host sync per
    # step (what a Python serving loop sees, GIL included) and a queue of replays kept
    # ahead of the GPU (the GPU-side interference alone).
    hi_prio = torch.cuda.Stream(priority=-1)
    groups: dict[str, tuple[dist.ProcessGroup, torch.cuda.Stream | None]] = {
        "default": (migrate_group, None)
    }
    for ctas in cfg.cta_caps:
        try:
            opts = dist.ProcessGroupNCCL.Options()
            opts.config.max_ctas = ctas
            opts.config.min_ctas = 1
        except AttributeError as exc:  # an older torch without NCCL config
            print(f"rank {rank}: no CTA cap ({exc})", flush=True)
            break
        groups[f"ctas{ctas}"] = (dist.new_group([0, 1], pg_options=opts), hi_prio)
    version = 0
    gloo_group = dist.new_group([0, 1], backend="gloo")  # the outbox transport's control
    executors: dict[tuple[str, str], MigrationExecutor] = {}
    for spec in cfg.movers:
        settings = parse_mover(spec)
        if settings is None:
            continue
        nccl = transport_class(settings.transport).group_backend(dev) == "nccl"
        for name, (g, _) in groups.items():
            if not nccl and name != "default":
                continue  # no NCCL kernels to cap
            control = g if nccl else gloo_group
            executors[(spec, name)] = MigrationExecutor(
                rank, WORLD, block.weights, control, settings, row_map=rows
            )
    last_staged: tuple[MigrationExecutor, int] | None = None
    mover_stream = torch.cuda.Stream(dev)

    def run_mover(kind: str, name: str, moves: np.ndarray | None = None) -> tuple[float, int, int]:
        """One prepare of the plan (or `moves`): (seconds, bytes sent, bytes received)."""
        nonlocal version, last_staged
        group = groups[name][0]
        moves = plan if moves is None else moves
        if kind == "packed":
            st = packed_exchange(
                rank, WORLD, block.weights, moves, group, cfg.chunk_experts, mover_stream
            )
            return st.seconds, st.bytes_sent, st.bytes_received
        version += 1
        executor = executors[(kind, name)]
        stats = executor.prepare(version, moves)
        if last_staged is not None:
            last_staged[0].abort(last_staged[1])  # one staged plan in memory at a time
        last_staged = (executor, version)
        return stats.seconds, stats.bytes_sent, stats.bytes_received

    def serve(stream, until, queued: bool) -> list[float]:  # type: ignore[no-untyped-def]
        """Replay times while `until()` is true (or cfg.replays * rounds if None)."""
        out: list[float] = []
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            n = 0
            while until() if until else n < cfg.replays * cfg.rounds // 2:
                if not queued:
                    out.append(replay_ms(g_ov, 2))
                    n += 2
                    continue
                events = [torch.cuda.Event(enable_timing=True) for _ in range(11)]
                events[0].record()
                for i in range(10):
                    g_ov.replay()
                    events[i + 1].record()
                events[-1].synchronize()
                out.extend(events[i].elapsed_time(events[i + 1]) for i in range(10))
                n += 10
        return out

    def beside(kind: str, name: str, queued: bool) -> None:
        stream = groups[name][1]
        tag = f"{kind}_{name}_{'queued' if queued else 'sync'}"
        idle_a = statistics.median(serve(stream, None, queued))
        results: list[tuple[float, int, int]] = []
        errors: list[BaseException] = []

        def work() -> None:
            torch.cuda.set_device(rank)  # the current device is per thread
            try:
                for _ in range(cfg.beside_repeats):  # a fixed count: both ranks agree
                    results.append(run_mover(kind, name))
            except BaseException as exc:  # re-raised below
                errors.append(exc)

        dist.barrier()
        torch.cuda.synchronize()
        thread = threading.Thread(target=work)
        thread.start()
        busy = serve(stream, thread.is_alive, queued)
        thread.join()
        if errors:
            raise errors[0]
        idle_b = statistics.median(serve(stream, None, queued))
        idle = (idle_a + idle_b) / 2
        during = statistics.median(busy[1:-1] if len(busy) > 3 else busy)
        secs = statistics.median(r[0] for r in results)
        say(f"{tag}_replay_ms_idle", idle)
        say(f"{tag}_replay_ms_during", during)
        say(f"{tag}_dip_pct", max_over_ranks(100 * (during - idle) / idle, dev))
        say(f"{tag}_moves_during", float(len(results)))
        say(f"{tag}_GBps_busiest_dir", -max_over_ranks(-max(results[-1][1:]) / secs / 1e9, dev))

    for kind in cfg.movers:
        dist.barrier()
        alone = [run_mover(kind, "default") for _ in range(cfg.migration_repeats)]
        secs = statistics.median(r[0] for r in alone)
        say(f"{kind}_alone_seconds", max_over_ranks(secs, dev))
        say(
            f"{kind}_alone_GBps_busiest_dir", -max_over_ranks(-max(alone[-1][1:]) / secs / 1e9, dev)
        )
        say(
            f"{kind}_alone_GBps_both_dirs",
            -max_over_ranks(-(alone[-1][1] + alone[-1][2]) / secs / 1e9, dev),
        )
        # The same experts of GPU0 -> GPU1 only: the shape of the copy_ baseline.
        one_way = plan[(plan[:, 3] == 0) & (plan[:, 1] == 1)]
        dist.barrier()
        runs = [run_mover(kind, "default", one_way) for _ in range(cfg.migration_repeats)]
        secs = max_over_ranks(statistics.median(r[0] for r in runs), dev)
        say(f"{kind}_oneway_GBps", len(one_way) * mcfg.expert_bytes() / secs / 1e9)
        for name in groups:
            if kind != "packed" and (kind, name) not in executors:
                continue
            for queued in (False, True):
                beside(kind, name, queued)
    say("migration_bytes_sent_per_gpu", float(alone[-1][1]))
    say("migration_bytes_received_per_gpu", float(alone[-1][2]))
    # The plan committed below is the executor's: prepare it once more, alone.
    run_mover(cfg.commit_mover, "default")
    assert last_staged is not None
    last_executor = last_staged[0]

    # -- commit between replays: weights, then maps, in place ------------------------
    torch.cuda.synchronize()
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    tables = [d.table.data_ptr() for d in disps]
    w_ptr = block.weights["w13"].data_ptr()
    assert last_executor.staged_rows is not None
    new_map = replica_rows(new, rows.row_ids(last_executor.staged_rows), num_experts, width)
    for d in disps:
        d.stage(new_map)
    torch.cuda.synchronize()
    start.record()
    written = last_executor.commit(version)
    mid.record()
    for d in disps:
        d.commit()
    end.record()
    g_big.replay()
    end.synchronize()
    say("commit_experts_written", float(written))
    say("commit_weights_us", 1e3 * start.elapsed_time(mid))
    say("commit_maps_us", 1e3 * mid.elapsed_time(end))
    same_storage = [d.table.data_ptr() for d in disps] == tables and block.weights[
        "w13"
    ].data_ptr() == w_ptr
    say("commit_same_storage", float(same_storage))

    # -- invariant 1 after the move ---------------------------------------------------
    block.group = dist.group.WORLD
    after = block.forward(x_small, routed_small, exact=True)
    block.group = None
    torch.cuda.synchronize()
    say(
        "invariant1_max_abs_diff",
        max_over_ranks(float((after.float() - before.float()).abs().max()), dev),
    )
    say("invariant1_bit_identical", -max_over_ranks(-float(torch.equal(after, before)), dev))
    mine = plan[plan[:, 1] == rank]
    bad = 0
    for row in mine[:: max(1, len(mine) // 16)]:
        layer, slot = int(row[0]), int(row[2])
        w13, w2 = expert_weights(
            mcfg, layer, int(new[layer, rank * mcfg.slots_per_gpu + slot]), dev
        )
        row = int(rows.rows[rank, layer, slot])
        bad += int(not torch.equal(block.weights["w13"][layer, row], w13))
        bad += int(not torch.equal(block.weights["w2"][layer, row], w2))
    say("moved_slots_wrong_weights", max_over_ranks(float(bad), dev))

    # -- balance effect: same graph, rebalanced placement -----------------------------
    local_new, step_new = step_times()
    say("step_ms_rebalanced_slowest_gpu", step_new)
    say("step_speedup", step_trivial / step_new)
    log["step_ms_rebalanced_this_gpu"] = local_new
    window, phys = rec.take_window()
    say("recorded_tokens_this_gpu", float(window.sum()))

    gathered: list[object] = [None] * WORLD
    dist.all_gather_object(gathered, log)
    if rank == 0:
        with open(result_path, "w") as fh:
            json.dump(gathered, fh)
    # Unmap the peers' weights before anyone frees its own.
    for executor in executors.values():
        executor.close()
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def copy_baseline() -> dict[str, float]:
    """Plain GPU0 -> GPU1 copy_ (peer copy through the driver), GB/s; and both ways at
    once (GPU0 -> GPU1 and GPU1 -> GPU0 on a stream of each source), GB/s per direction."""
    out = {}
    mib = 1344
    a = torch.empty(mib << 20, dtype=torch.uint8, device="cuda:0").random_()
    b = torch.empty(mib << 20, dtype=torch.uint8, device="cuda:1").random_()
    a_in, b_in = torch.empty_like(a), torch.empty_like(b)
    streams = (torch.cuda.Stream("cuda:0"), torch.cuda.Stream("cuda:1"))
    for rep in range(4):
        if rep == 1:
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            b_in.copy_(a, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            a_in.copy_(b, non_blocking=True)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    out["copy_both_ways_1344MiB_GBps_per_direction"] = (
        3 * a.numel() / (time.perf_counter() - t0) / 1e9
    )
    del a, b, a_in, b_in
    for mib in (84, 1344):
        src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda:0").random_()
        dst = torch.empty(mib << 20, dtype=torch.uint8, device="cuda:1")
        dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        reps = max(3, 8192 // mib)
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        out[f"copy_gpu0_to_gpu1_{mib}MiB_GBps"] = (
            reps * src.numel() / (time.perf_counter() - t0) / 1e9
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f, v in asdict(MigrationBenchConfig()).items():
        if isinstance(v, tuple):
            item_type: type = str if f == "movers" else int
            parser.add_argument(f"--{f.replace('_', '-')}", type=item_type, nargs="*", default=v)
        else:
            parser.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    parser.add_argument("--out", default="migration_result.json")
    args = vars(parser.parse_args())
    out_path = args.pop("out")
    args["cta_caps"] = tuple(args["cta_caps"])
    args["movers"] = tuple(args["movers"])
    args["spare_rows"] = tuple(args["spare_rows"])
    for spec in args["movers"]:
        parse_mover(spec)  # a bad spec fails before any GPU work
    cfg = MigrationBenchConfig(**args)
    if not cfg.spare_rows or min(cfg.spare_rows) < 0:
        raise SystemExit("--spare-rows needs values >= 0")
    if cfg.commit_mover not in cfg.movers:
        raise SystemExit(f"--commit-mover {cfg.commit_mover} must be one of --movers")
    if "packed" in cfg.movers and max(cfg.spare_rows) > 0:
        raise SystemExit("the packed harness moves slots, not rows: run it with --spare-rows 0")
    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    base = copy_baseline()
    for k, v in base.items():
        print(f"{k:40s} {v:14.4f}", flush=True)
    runs = {}
    for spare in cfg.spare_rows:
        mp.spawn(worker, args=(cfg, out_path, spare), nprocs=WORLD, join=True)
        with open(out_path) as fh:
            runs[spare] = json.load(fh)
    per_rank = runs[cfg.spare_rows[0]]
    commit_keys = (
        "commit_experts_written",
        "commit_weights_us",
        "commit_maps_us",
        "invariant1_bit_identical",
        "moved_slots_wrong_weights",
    )
    commits = {
        spare: {k: max(r[k] for r in ranks) for k in commit_keys} for spare, ranks in runs.items()
    }
    for spare, figures in commits.items():
        pause = figures["commit_weights_us"] + figures["commit_maps_us"]
        figures["commit_pause_us"] = pause
        print(f"{f'commit_pause_us_spare{spare}':40s} {pause:14.4f}")
    summary = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "date": time.strftime("%Y-%m-%d"),
        "config": asdict(cfg),
        "copy": base,
        "ranks": per_rank,
        "commit_by_spare_rows": commits,
    }
    first = commits[cfg.spare_rows[0]]["commit_pause_us"]
    for spare, figures in commits.items():
        ratio = figures["commit_pause_us"] / first if first else float("nan")
        summary[f"commit_pause_spare{spare}_vs_spare{cfg.spare_rows[0]}"] = ratio
        print(f"{f'commit_pause_spare{spare}_vs_first':40s} {ratio:14.4f}")
    peak = base["copy_gpu0_to_gpu1_1344MiB_GBps"]
    for spec in cfg.movers:
        pct = 100 * per_rank[0][f"{spec}_alone_GBps_busiest_dir"] / peak
        summary[f"{spec}_vs_copy_pct"] = pct
        print(f"{spec + '_vs_copy_pct':40s} {pct:14.4f}")
        pct = 100 * per_rank[0][f"{spec}_oneway_GBps"] / peak
        summary[f"{spec}_oneway_vs_copy_pct"] = pct
        print(f"{spec + '_oneway_vs_copy_pct':40s} {pct:14.4f}")
        pct = (
            100
            * per_rank[0][f"{spec}_alone_GBps_busiest_dir"]
            / base["copy_both_ways_1344MiB_GBps_per_direction"]
        )
        summary[f"{spec}_vs_copy_both_ways_pct"] = pct
        print(f"{spec + '_vs_copy_both_ways_pct':40s} {pct:14.4f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
