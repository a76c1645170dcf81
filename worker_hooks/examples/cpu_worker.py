"""An expert-parallel MoE worker on CPU: the demo's and the tests' inference process.

An example of an engine integration built on `worker_hooks`, not part of the product:
it shows where `RebalanceHook` goes in a forward loop. The model is
worker_hooks/examples/moe_cpu.py's (`ExpertParallelMoE`, checked against `ReferenceMoE`).
`main` is the integration, step by step: join the process groups, build the model's
weights, build the hook around them, serve, shut down.

Each process is one EP rank of a gloo group. Every step it samples routing for
its own tokens from a routing profile (real per-layer expert loads, drifting
between workloads), maps them to physical slots through the hook, exchanges
tokens with the other ranks, runs the experts it holds on its live weights,
and combines. It checks its outputs against the unbalanced reference model
(invariant 1) and logs the placement version of every step (invariant 2).

With `--device cuda` the hook (recorder, dispatch, expert weights, migration) lives on
GPU `rank % device_count`, weights move between GPUs (NCCL p2p, or the copy engines
with `--transport ipc`); the small expert math and the token exchange stay on CPU, so
outputs are still compared bit for bit with the CPU reference.

    python -m worker_hooks.examples.cpu_worker --rank 0 --world 4 --port 29500 \
        --controller 127.0.0.1:50051 --profile routing.npz --out rank0.json
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, get_args

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.dispatch import DISPATCH_MODES
from rebalancer.wire.layout import trivial_placement
from rebalancer.wire.shape import ClusterShape
from worker_hooks.config import TRANSPORTS
from worker_hooks.devices import DEVICE_KINDS
from worker_hooks.examples.moe_cpu import (
    ExpertParallelMoE,
    MoEConfig,
    ReferenceMoE,
    expert_weights,
    shared_weights,
    slot_weights,
)
from worker_hooks.hook import (
    CommitConfig,
    DispatchConfig,
    HookConfig,
    Link,
    MigrationConfig,
    PlanDriver,
    PoolConfig,
    RebalanceHook,
    WindowConfig,
)
from worker_hooks.transports import transport_class
from worker_hooks.transports.shared_memory import in_shared_memory, unlink_quietly

log = logging.getLogger("worker_hooks.examples.cpu_worker")

# Fault injection for the tests of invariant 5 (FaultyPlans).
Fault = Literal["", "fail", "die"]
FAULTS: tuple[Fault, ...] = get_args(Fault)


def sample_routing(
    profile: np.ndarray, top_k: int, tokens: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k distinct experts per token drawn from `profile` [E] (Gumbel top-k), and gates."""
    logp = torch.from_numpy(np.log(np.maximum(profile, 1e-12))).float()
    u = torch.rand(tokens, logp.numel(), generator=gen).clamp_(1e-9, 1 - 1e-9)
    keys = logp - torch.log(-torch.log(u))
    topk = keys.topk(top_k, dim=1).indices
    gates = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
    return topk, gates


class FaultyPlans(PlanDriver):
    """Fault injection for the tests of invariant 5.

    fault "fail": every prepare fails after its transfers (peers finish theirs).
    fault "die": the process is killed with SIGKILL as soon as a plan arrives,
    while its peers are exchanging weights with it."""

    fault: Fault = ""

    def on_prepare(self, prepare: pb.Prepare) -> None:
        if self.fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        super().on_prepare(prepare)

    def after_transfers(self, version: int) -> None:
        if self.fault == "fail":
            raise RuntimeError("injected failure after transfers")


class FaultyHook(RebalanceHook):
    """The worker's hook: plans driven by `FaultyPlans` (looked up when built, so a test
    harness can put its own subclass there), with `fault` set on them."""

    def __init__(self, *args: Any, fault: Fault = "", **kwargs: Any) -> None:
        kwargs["plan_driver"] = FaultyPlans
        super().__init__(*args, **kwargs)
        assert isinstance(self.plans, FaultyPlans)
        self.plans.fault = fault


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="rendezvous port of the gloo group")
    p.add_argument("--controller", required=True)
    p.add_argument("--deployment", default="demo")
    p.add_argument("--profile", required=True, help="npz: profiles [phases, L, E], steps_per_phase")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank per step")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--slots", type=int, default=40)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--window-steps", type=int, default=16)
    p.add_argument("--agree-every", type=int, default=4)
    p.add_argument(
        "--check-every", type=int, default=1, help="compare with the reference every N steps"
    )
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--local", action="store_true", help="no token exchange (peers may die)")
    p.add_argument("--fault", choices=FAULTS, default="", help="fault injection (tests)")
    p.add_argument(
        "--wait-version",
        type=int,
        default=0,
        help="after --steps, keep stepping until this version is committed",
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="p2p",
        help="weight transfers: gloo point-to-point, or reads from the peers' shared memory",
    )
    p.add_argument(
        "--spare-rows",
        type=int,
        default=0,
        help="spare weight rows per layer: commits then copy no weights",
    )
    p.add_argument(
        "--device",
        choices=DEVICE_KINDS,
        default="cpu",
        help="where the hook and the expert weights live (cuda: GPU rank %% count)",
    )
    p.add_argument(
        "--dispatch",
        choices=DISPATCH_MODES,
        default="split",
        help="how an expert's tokens are divided among its replicas each step",
    )
    p.add_argument(
        "--shared-expert",
        action="store_true",
        help="the model has a shared expert (needed by --dispatch load+shared)",
    )
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument(
        "--stop-file",
        default="",
        help="stop at the step written in this file, once it appears (every rank "
        "stops at the same step; for harnesses that run an open-ended group). "
        "Each rank writes the step it is at to <stop-file>.rank<r> every 8 "
        "steps, so that a harness can pick a step ahead of every rank",
    )
    p.add_argument(
        "--token", default=os.environ.get("REBALANCER_WORKER_TOKEN"), help="deployment token"
    )
    p.add_argument(
        "--pool",
        default=os.environ.get("REBALANCER_POOL", ""),
        help="the deployment's replica pool (a fresh group starts on the pool's placement)",
    )
    p.add_argument(
        "--warm-start-seconds",
        type=float,
        default=PoolConfig.warm_start_seconds,
        help="longest wait at start for the pool's placement",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.dispatch != "split" and args.local:
        p.error("--dispatch by load exchanges counts every step: not with --local")
    if args.dispatch == "load+shared" and not args.shared_expert:
        p.error("--dispatch load+shared needs --shared-expert")
    return args


@dataclass
class Groups:
    """The rank's process groups: serving's default group, and one each for the commit
    agreement and the weight transfers (kept apart from serving's collectives)."""

    device: torch.device
    agree: dist.ProcessGroup
    migrate: dist.ProcessGroup


def join_groups(args: argparse.Namespace) -> Groups:
    """Step 1: join the EP group (gloo) and make the hook's groups; pick the device."""
    timeout = timedelta(seconds=30)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=timeout,
    )
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", args.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    agree = dist.new_group(backend="gloo", timeout=timeout)
    # NCCL carries GPU weights for p2p; the shared-memory transports talk over gloo.
    migrate = dist.new_group(
        backend=transport_class(args.transport).group_backend(device), timeout=timeout
    )
    return Groups(device, agree, migrate)


@dataclass
class RankModel:
    """This rank's share of the model: the initial placement and its slots' weights,
    and the unbalanced reference model its outputs are checked against."""

    config: MoEConfig
    reference: ReferenceMoE
    phy2log: np.ndarray  # [L, P], the same on every rank
    weights: dict[str, torch.Tensor]  # name -> [L, S (+ spare rows), ...] this rank's slots
    shared_files: list[str] = field(default_factory=list)  # shared memory backing the weights


def build_model(args: argparse.Namespace, device: torch.device) -> RankModel:
    """Step 2: the model's weights for this rank's slots of the trivial placement, with
    room for the spare rows, where the transport needs them (GPU, or shared memory for
    peers that map them)."""
    cfg = MoEConfig(
        num_layers=args.layers,
        num_experts=args.experts,
        top_k=args.top_k,
        shared_expert=args.shared_expert,
    )
    phy2log = trivial_placement(cfg.num_layers, cfg.num_experts, args.slots, args.world)
    S = args.slots // args.world
    weights = slot_weights(cfg, phy2log, range(args.rank * S, (args.rank + 1) * S))
    if args.spare_rows:  # rows S .. S + R - 1 start free
        weights = {
            name: torch.cat([w, w.new_zeros((w.shape[0], args.spare_rows) + w.shape[2:])], dim=1)
            for name, w in weights.items()
        }
    shared_files: list[str] = []
    if device.type == "cuda":
        weights = {name: w.to(device) for name, w in weights.items()}
    elif transport_class(args.transport).maps_live_weights:  # peers map CPU weights by file name
        weights, shared_files = in_shared_memory(weights, f"rank{args.rank}")
        for path in shared_files:
            atexit.register(unlink_quietly, path)
    return RankModel(cfg, ReferenceMoE(cfg), phy2log, weights, shared_files)


def hook_config(args: argparse.Namespace, cfg: MoEConfig) -> HookConfig:
    """The hook's settings: who this rank is, the model's shape, and a section per job."""
    return HookConfig(
        link=Link(
            args.controller,
            token=args.token,
            deployment=args.deployment,
            worker_id=f"cpu-worker-{os.getpid()}",
            pool=args.pool,
        ),
        rank=args.rank,
        shape=ClusterShape(
            num_layers=cfg.num_layers,
            num_logical=cfg.num_experts,
            num_slots=args.slots,
            num_gpus=args.world,
            expert_bytes=cfg.expert_bytes,
            top_k=cfg.top_k,
        ),
        shared_expert=args.shared_expert,
        windows=WindowConfig(steps=args.window_steps),
        dispatch=DispatchConfig(mode=args.dispatch),
        commit=CommitConfig(agree_every=args.agree_every, spare_rows=args.spare_rows),
        migration=MigrationConfig(transport=args.transport),
        pool=PoolConfig(warm_start_seconds=args.warm_start_seconds),
    )


def build_hook(args: argparse.Namespace, model: RankModel, groups: Groups) -> RebalanceHook:
    """Step 3: the hook around the live weights, started (it serves on whether or not the
    controller answers)."""
    hook = FaultyHook(
        hook_config(args, model.config),
        model.phy2log,
        model.weights,
        groups.agree,
        groups.migrate,
        device=groups.device,
        fault=args.fault,
        # What a warm start loads: this model's weights of any expert, made on the spot.
        expert_source=lambda layer, expert: dict(
            zip(("w1", "w2"), expert_weights(model.config, layer, expert), strict=True)
        ),
    )
    hook.executor.connect()  # map the peers now (ipc, outbox): then the file names can go
    for path in model.shared_files:
        unlink_quietly(path)
    hook.start()
    hook.agent.connected.wait(timeout=10)  # serve anyway if the controller is not there
    return hook


@dataclass
class Served:
    """What the serving loop saw."""

    steps: int = 0
    versions: list[list[int]] = field(default_factory=list)  # [first_step, version] runs
    step_seconds: list[float] = field(default_factory=list)
    max_diff: float = 0.0  # largest output difference against the reference model
    computed: np.ndarray | None = None  # [L, 2] routed picks and shared tokens computed here


class StopFile:
    """`--stop-file`: the step every rank stops at, once a harness writes it; this rank's
    progress goes to `<stop-file>.rank<r>` every 8 steps."""

    def __init__(self, path: str, rank: int) -> None:
        self.path, self.rank = path, rank
        self.stop_at: int | None = None

    def reached(self, step: int) -> bool:
        if self.path and step % 8 == 0:
            if self.stop_at is None and os.path.exists(self.path):
                with open(self.path) as f:
                    self.stop_at = int(f.read().strip() or 0)
            write_progress(f"{self.path}.rank{self.rank}", step)
        return self.stop_at is not None and step >= self.stop_at


def serve(args: argparse.Namespace, hook: RebalanceHook, model: RankModel) -> Served:
    """Step 4: the serving loop. Each step, each layer routes its tokens through
    `hook.route` and computes on the live weights; `hook.step_end` after the step."""
    cfg, reference = model.config, model.reference
    data = np.load(args.profile)
    profiles, steps_per_phase = data["profiles"], int(data["steps_per_phase"])
    moe = ExpertParallelMoE(
        hook.route,
        hook.weights,
        hook.config.rows_per_rank,
        args.rank,
        args.world,
        hook.device,
        exchange=not args.local,
        shared=shared_weights(cfg),
    )
    served = Served(computed=np.zeros((cfg.num_layers, 2), dtype=np.int64))
    assert served.computed is not None
    stop = StopFile(args.stop_file, args.rank)
    deadline = time.monotonic() + args.max_seconds
    step = 0
    while step < args.steps or (hook.version < args.wait_version and time.monotonic() < deadline):
        if stop.reached(step):
            break
        t0 = time.perf_counter()
        phase = (step // steps_per_phase) % len(profiles)
        if not served.versions or served.versions[-1][1] != hook.version:
            served.versions.append([step, hook.version])
        for layer in range(cfg.num_layers):
            gen = torch.Generator().manual_seed(
                hash((cfg.seed, step, args.rank, layer)) & 0x7FFFFFFF
            )
            x = torch.randn(args.tokens, cfg.hidden, generator=gen)
            topk, gates = sample_routing(profiles[phase, layer], cfg.top_k, args.tokens, gen)
            out = moe.forward(layer, x, topk, gates)
            served.computed[layer] += moe.computed[layer]
            if not args.local and step % args.check_every == 0:
                ref = reference.forward(layer, x, topk, gates)
                served.max_diff = max(served.max_diff, float((out - ref).abs().max()))
        hook.step_end()
        step += 1
        served.step_seconds.append(time.perf_counter() - t0)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if time.monotonic() > deadline + 30:
            break
    served.steps = step
    return served


def weights_match_map(hook: RebalanceHook, model: RankModel) -> bool:
    """Whether the rank holds, slot by slot, the expert its map says (read through its rows)."""
    reference, cfg = model.reference, model.config
    rank, S = hook.config.rank, hook.config.slots_per_rank
    return all(
        torch.equal(
            hook.weights["w1"][layer, int(hook.rows.rows[rank, layer, s])].cpu(),
            reference.w1[layer, int(hook.phy2log[layer, rank * S + s])],
        )
        for layer in range(cfg.num_layers)
        for s in range(S)
    )


def result_of(
    args: argparse.Namespace, hook: RebalanceHook, model: RankModel, served: Served
) -> dict[str, Any]:
    """What the tests and the demo read from a rank (the JSON of `--out`)."""
    stats = hook.stats
    return {
        "rank": args.rank,
        "steps": served.steps,
        "version": hook.version,
        "versions": served.versions,
        "commits": stats.commits,
        "prepared": stats.prepared,
        "failed": stats.failed,
        "aborted": stats.aborted,
        "bytes_received": stats.bytes_received,
        "swap_seconds_max": max(stats.swap_seconds, default=0.0),
        "copied_at_commit": stats.copied_at_commit,
        "max_output_diff": served.max_diff,
        "step_seconds_median": float(np.median(served.step_seconds))
        if served.step_seconds
        else 0.0,
        "agreement_broken": hook.agreement.broken,
        "dispatch": args.dispatch,
        "computed": None if served.computed is None else served.computed.tolist(),
        # What the recorder counted: picks sent to each GPU [L, G (+ G shared)].
        "recorded_per_gpu": None if stats.gpu_total is None else stats.gpu_total.tolist(),
        "recorded_logical": None if stats.logical_total is None else stats.logical_total.tolist(),
        "phy2log": hook.phy2log.tolist(),
        # What the rank holds, expert by expert: the test checks it against the map.
        "weights_match_map": weights_match_map(hook, model),
    }


def shut_down(args: argparse.Namespace, settled: bool) -> None:
    """Step 5: leave the group. `settled`: `hook.finish` saw every transfer and
    collective of ours end."""
    if not settled:
        # A transfer or an agreement is blocked on a peer that left or froze: a gloo call cannot be
        # interrupted, and tearing the groups down under it aborts the process. Leave as is (saying
        # so, so that no peer waits for this rank's goodbye).
        if not args.local:
            with contextlib.suppress(RuntimeError):
                dist.distributed_c10d._get_default_store().add(LEFT, 1)
        os._exit(0)
    if not args.local:  # with peers possibly dead, leave without a collective goodbye
        leave_group(args.rank, args.world)
    # Then the interpreter's own shutdown, as an engine's: `hook.finish` kept every
    # collective of ours where no gloo thread can free it at exit (worker_hooks/works.py).


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("REBALANCER_LOG", "WARNING"),
        format=f"%(asctime)s rank{args.rank} %(name)s %(levelname)s %(message)s",
    )
    torch.set_num_threads(1)
    groups = join_groups(args)  # 1. the process groups
    model = build_model(args, groups.device)  # 2. this rank's weights
    hook = build_hook(args, model, groups)  # 3. the hook around them, started
    try:
        served = serve(args, hook, model)  # 4. route / step_end in the forward loop
    except RuntimeError as exc:
        if "gloo" not in str(
            exc
        ):  # gloo's errors name its source file: anything else is a bug here
            raise
        # A peer rank ended (killed, failed) and this rank's collective with it failed: the
        # group cannot serve any more. One line, not gloo's traceback, and exit 1 at once:
        # the interpreter's exit would tear the groups down under gloo threads still on the
        # dead peer, which aborts the process (as in shut_down).
        print(
            f"rank {args.rank}: error: the expert-parallel group lost a peer: {gloo_reason(exc)}",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(1)
    settled = hook.finish(timeout=5.0, transfer_timeout=15.0)  # last window, reports, transfers
    with open(args.out, "w") as f:
        json.dump(result_of(args, hook, model, served), f)
    shut_down(args, settled)  # 5. leave the group
    return 0


def gloo_reason(exc: RuntimeError) -> str:
    """The first sentence of a gloo error, without its "[source file:line]" prefix and the
    advice after it."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0]


# The goodbye's counters in the group's store (leave_group): ranks done, ranks gone after
# it, ranks that left without it.
DONE, GONE, LEFT = "cpu_worker/done", "cpu_worker/gone", "cpu_worker/left"


def write_progress(path: str, step: int) -> None:
    """The step this rank is at, in `path` (replaced whole: a reader never sees half)."""
    with open(f"{path}.tmp", "w") as f:
        f.write(str(step))
    os.replace(f"{path}.tmp", path)


def leave_group(rank: int, world: int, timeout: float = 60.0) -> None:
    """Tear the process group down once every rank is done with it.

    The goodbye goes through the group's store, not a gloo barrier: a rank that leaves
    the moment its barrier completes can close its pairs while a starved peer has not yet
    seen its own barrier complete, and that peer's barrier then fails ("Connection closed
    by peer": a rank that served every step exits 1). With no collective in flight, a
    peer closing its pairs is harmless. Rank 0 holds the store, so it leaves last."""
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + timeout
    try:
        store.add(DONE, 1)
        while store.add(DONE, 0) + store.add(LEFT, 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
        if rank != 0:
            store.add(GONE, 1)
        else:
            while (
                store.add(GONE, 0) + store.add(LEFT, 0) < world - 1 and time.monotonic() < deadline
            ):
                time.sleep(0.01)
    except RuntimeError:  # rank 0 left without its goodbye (a transfer of its was blocked)
        log.warning("rank %d: the group's store is gone; leaving without a goodbye", rank)
        return
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
