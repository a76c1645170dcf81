"""A DeepSeek-V3-shaped transformers model served through the adapter and rebalanced live:
`python -m bench.gpu_transformers` (CUDA), `--device cpu --small` as a smoke test.

The model is transformers' own `DeepseekV3ForCausalLM` (random weights, a few layers, every
one MoE; DeepSeek-V3's expert shapes on CUDA: hidden 7168, expert intermediate 2048, 256
experts, top-8, 8 groups). Each MoE block's router is wrapped so its top-k ids are real
DeepSeek-V3 routing: per step, ids drawn from a workload's per-layer expert loads
(rebalancer/data/deepseek-v3, Gumbel top-k), copied into a static buffer the router
returns (weights stay the router's own scores). On CUDA every MoE block is replayed from
a CUDA graph of its own (`graph_moe_blocks`), before and after the map swap, without
recapture.

Figures (medians of per-step wall time, the forward plus `step_end`):
- unwrapped: the stock model (transformers' grouped_mm experts), blocks graphed too;
- before / after: the adapter before and after a live rebalance: a real controller
  (embedded, on loopback) gets the windows, an operator-forced plan is prepared (weights
  moved into spare rows) and committed through the hook between two replays;
- hook overhead = before / unwrapped - 1; the swap pause (`HookStats.swap_seconds`);
- logits: wrapped vs unwrapped, and after vs before the rebalance, on one fixed input.
With `torchrun --nproc-per-node 2 -m bench.gpu_transformers` the ranks form one EP group
(NCCL token exchange, rank 0 runs the controller). Last line: one JSON object (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rebalancer.controller.config import ControllerConfig
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3
from rebalancer.demo import free_port
from worker_hooks.engines.transformers.adapter import (
    AdapterConfig,
    ExpertParallelModel,
    MoEBlock,
    attach,
    find_moe_blocks,
    graph_moe_blocks,
)

DeviceKind = Literal["cuda", "cpu"]


@dataclass
class BenchConfig:
    device: DeviceKind = "cuda"
    small: bool = False
    layers: int = 2
    tokens: int = 2048  # per rank per step (one sequence)
    redundant: int = 32  # P = 256 + 32 slots
    spare_rows: int = 16
    steps: int = 30  # timed steps per phase
    window_steps: int = 4
    agree_every: int = 2
    workload: str = "prefill_in4096"
    max_swap_steps: int = 400  # steps to wait for the forced plan to commit


def model_config(cfg: BenchConfig) -> Any:
    """DeepSeek-V3's MoE shapes (or a tiny one with --small); every layer MoE."""
    from transformers import DeepseekV3Config

    if cfg.small:
        shape = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=32,
                     num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, vocab_size=256)
    else:
        shape = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                     n_routed_experts=256, num_attention_heads=16, num_key_value_heads=16,
                     q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                     v_head_dim=128, vocab_size=4096)
    config = DeepseekV3Config(
        num_hidden_layers=cfg.layers, first_k_dense_replace=0, num_experts_per_tok=8, n_group=8,
        topk_group=4, n_shared_experts=1, max_position_embeddings=max(4096, cfg.tokens), rope_scaling=None,
        **shape,
    )
    config._attn_implementation = "sdpa"
    return config


def routing_profile(cfg: BenchConfig, num_layers: int, num_experts: int) -> np.ndarray:
    """Expert probabilities `[L, E]` of the workload's real layers (evenly spaced over
    DeepSeek-V3's 58 MoE layers); with fewer than 256 experts, a subset at evenly spaced
    load ranks (hottest included) keeps the skew."""
    path = next(p for p in deepseek_v3_files() if p.stem == cfg.workload)
    counts = load_deepseek_v3(path).astype(np.float64)
    picked = np.linspace(0, counts.shape[0] - 1, num_layers).round().astype(int)
    out = np.empty((num_layers, num_experts))
    for i, layer in enumerate(picked):
        row = counts[layer]
        if num_experts < row.size:
            order = np.argsort(-row)
            row = row[order[np.linspace(0, row.size - 1, num_experts).round().astype(int)]]
        out[i] = np.maximum(row, 1.0) / np.maximum(row, 1.0).sum()
    return out


def sample_ids(profile: np.ndarray, tokens: int, top_k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """`[L, T, K]` distinct experts per token drawn from `profile` `[L, E]` (Gumbel top-k)."""
    logp = torch.from_numpy(np.log(profile)).float()
    u = torch.rand((profile.shape[0], tokens, profile.shape[1]), generator=gen).clamp_(1e-9, 1 - 1e-9)
    return (logp[:, None, :] - torch.log(-torch.log(u))).topk(top_k, dim=-1).indices.to(device)


class ReplayRouter(nn.Module):
    """The stock router, its top-k ids replaced by a static buffer (graph-safe)."""

    def __init__(self, gate: nn.Module, tokens: int, top_k: int, device: torch.device) -> None:
        super().__init__()
        self.gate = gate
        self.ids = torch.zeros(tokens, top_k, dtype=torch.int64, device=device)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, weights, _ = self.gate(hidden_states)
        return logits, weights, self.ids


def timed_steps(step: Callable[[], None], n: int, device: torch.device) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def run(cfg: BenchConfig, emit: Callable[[str], None]) -> dict[str, Any]:
    import transformers

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(cfg.device, rank % max(torch.cuda.device_count(), 1)) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    graphs = device.type == "cuda"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(cfg)
    torch.manual_seed(0)  # every rank: the same weights
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="grouped_mm")
    model.eval()
    blocks = find_moe_blocks(model)
    num_experts, top_k = int(config.n_routed_experts), int(config.num_experts_per_tok)
    routers = []
    for b in blocks:
        router = ReplayRouter(b.block.gate, cfg.tokens, top_k, device)
        b.block.gate = router
        routers.append(router)
    profile = routing_profile(cfg, len(blocks), num_experts)
    gen = torch.Generator().manual_seed(1000 + rank)
    input_ids = torch.randint(0, int(config.vocab_size), (1, cfg.tokens), generator=gen).to(device)
    probe_ids = sample_ids(profile, cfg.tokens, top_k, torch.Generator().manual_seed(7 + rank), device)

    def set_routing(ids: torch.Tensor) -> None:
        for layer, router in enumerate(routers):
            router.ids.copy_(ids[layer])

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids, use_cache=False).logits

    def example(b: MoEBlock) -> tuple[torch.Tensor, dict[str, Any]]:
        return torch.randn(1, cfg.tokens, config.hidden_size, device=device, dtype=dtype), {}

    # 1. The stock model (its blocks graphed too): the baseline.
    set_routing(probe_ids)
    stock_logits = forward()
    parents = {b.name: b.block for b in blocks}
    if graphs:
        graph_moe_blocks(model, example)
    set_routing(probe_ids)
    stock_graphed_logits = forward()

    def serve_step(hook_step: Callable[[], None] | None) -> Callable[[], None]:
        def step() -> None:
            set_routing(sample_ids(profile, cfg.tokens, top_k, gen, device))
            forward()
            if hook_step is not None:
                hook_step()
        return step

    unwrapped = timed_steps(serve_step(None), cfg.steps, device)
    if graphs:  # back to the stock blocks (drops their graphs) before attaching
        names = dict(model.named_modules())
        for name, block in parents.items():
            parent_name, _, attr = name.rpartition(".")
            setattr(names[parent_name], attr, block)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()

    # 2. The adapter, talking to a real controller (rank 0 runs it).
    ctl: EmbeddedController | None = None
    address = [""]
    if rank == 0:
        folder = tempfile.mkdtemp(prefix="bench-tf-")
        ctl = EmbeddedController(ControllerConfig(
            port=0, db_path=os.path.join(folder, "c.sqlite"), drain_seconds=0.0,
            policy=PolicyConfig(min_windows=1, decision_period_seconds=0.2, prepare_timeout_seconds=60.0,
                                max_moved_fraction=1.0, paused=True),
        ))
        address[0] = ctl.start().address
    dist.broadcast_object_list(address, src=0)
    # The token exchange of G > 1 CUDA ranks runs on NCCL (captured in the graphs).
    ep_group = dist.new_group(backend="nccl") if world > 1 and device.type == "cuda" else None
    try:
        ep = attach(model, AdapterConfig(
            controller=address[0], deployment="bench-tf", redundant_slots=cfg.redundant,
            spare_rows=cfg.spare_rows, window_steps=cfg.window_steps, agree_every=cfg.agree_every,
        ), ep_group=ep_group)
        ep.start()
        ep.hook.agent.connected.wait(10)
        set_routing(probe_ids)
        wrapped_logits = forward()
        if graphs:
            graph_moe_blocks(model, example)
        set_routing(probe_ids)
        before_logits = forward()
        before = timed_steps(serve_step(ep.step_end), cfg.steps, device)
        result = _rebalance_live(cfg, ep, ctl, serve_step(ep.step_end), device)
        if world == 1:
            # One GPU has nothing to balance: the controller's plan moves no slot. Move
            # experts anyway through the hook's own prepare/commit path (spare rows, map
            # swap between replays) so the graphs are replayed across a real weight move.
            ep.hook.stop()  # the controller does not know this plan: nothing reported
            result.update(_hook_plan(ep, serve_step(ep.step_end), device))
        after = timed_steps(serve_step(ep.step_end), cfg.steps, device)
        set_routing(probe_ids)
        after_logits = forward()
        ep.finish()
    finally:
        if ctl is not None:
            ctl.stop()

    def ms(xs: list[float]) -> float:
        return round(1e3 * statistics.median(xs), 3)

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max())

    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world": world, "cuda_graphs": graphs, "torch": torch.__version__,
        "transformers": transformers.__version__, **asdict(cfg),
        "moe_layers": len(blocks), "experts": num_experts, "slots": num_experts + cfg.redundant,
        "step_ms_unwrapped": ms(unwrapped), "step_ms_before": ms(before), "step_ms_after": ms(after),
        "hook_overhead_pct": round(100 * (statistics.median(before) / statistics.median(unwrapped) - 1), 2),
        **result,
        "logit_diff_wrapped_vs_stock": diff(wrapped_logits, stock_logits),
        "logit_diff_graphed_vs_eager_stock": diff(stock_graphed_logits, stock_logits),
        "logit_diff_graphed_vs_eager_wrapped": diff(before_logits, wrapped_logits),
        "logit_diff_after_vs_before": diff(after_logits, before_logits),
        "logit_scale": float(stock_logits.float().abs().max()),
    }
    emit(f"unwrapped {out['step_ms_unwrapped']} ms/step; adapter before {out['step_ms_before']} ms, "
         f"after {out['step_ms_after']} ms (hook overhead {out['hook_overhead_pct']} %)")
    emit(f"rebalance v{out['version']}: {out['slots_moved']} slots moved, swap {out['swap_ms']} ms, "
         f"swap step {out['swap_step_ms']} ms; logits after vs before {out['logit_diff_after_vs_before']}")
    return out


def _force(ctl: EmbeddedController, deployment: str) -> int:
    """On the controller's loop: force a plan once windows arrived (0: not yet; -1: the
    placement would not change; else the plan's version)."""
    assert ctl.server is not None
    controller = ctl.server.controller
    dep = controller.deployments.get(deployment)
    if dep is None or dep.estimator.windows == 0 or dep.plan is not None:
        return 0
    _, plan = controller.force(deployment)
    return plan.version if plan is not None else -1


def _rebalance_live(
    cfg: BenchConfig, ep: ExpertParallelModel, ctl: EmbeddedController | None,
    step: Callable[[], None], device: torch.device,
) -> dict[str, Any]:
    """Serve until the controller has windows, force one plan (rank 0), serve until it
    commits; returns the swap figures."""
    old = ep.hook.phy2log.copy()
    forced = [0]
    times: list[float] = []
    for _ in range(cfg.max_swap_steps):
        times += timed_steps(step, 1, device)
        if ctl is not None and not forced[0]:
            forced[0] = int(ctl.call(lambda: _force(ctl, "bench-tf")))  # type: ignore[call-overload]
            if forced[0] < 0:
                raise RuntimeError("the controller found no placement change to force")
        if ep.version >= 1:
            break
    if ep.version < 1:
        raise RuntimeError(f"no plan committed within {cfg.max_swap_steps} steps")
    stats = ep.hook.stats
    commit_step = stats.commits[0][0]
    return {
        "version": ep.version,
        "slots_moved": int((ep.hook.phy2log != old).sum()),
        "bytes_received": stats.bytes_received,
        "copied_at_commit": stats.copied_at_commit,
        "swap_ms": round(1e3 * max(stats.swap_seconds), 3),
        "swap_step_ms": round(1e3 * times[commit_step - 1 - cfg.steps], 3) if commit_step > cfg.steps else None,
        "steps_to_commit": len(times),
    }


def _hook_plan(ep: ExpertParallelModel, step: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """Prepare and commit a reshuffled placement (every expert once, replicas elsewhere)
    on this rank as a controller's Prepare would, serving between; the swap figures."""
    from rebalancer.placement.transfers import transfers
    from rebalancer.v1 import rebalancer_pb2 as pb
    from rebalancer.wire import codec

    hook = ep.hook
    old, version = hook.phy2log.copy(), hook.version + 1
    # The first spare_rows redundant slots of every layer take other experts: each lands
    # in a spare row while serving, and every expert keeps its first copy.
    rng = np.random.default_rng(3)
    num_logical, moved = hook.config.num_logical, max(hook.config.spare_rows, 1)
    new = old.copy()
    for layer in range(old.shape[0]):
        held = set(old[layer, num_logical : num_logical + moved].tolist())
        others = np.array([e for e in range(num_logical) if e not in held])
        new[layer, num_logical : num_logical + moved] = rng.choice(others, moved, replace=False)
    swaps = len(hook.stats.swap_seconds)
    hook.on_prepare(pb.Prepare(
        version=version, base_version=hook.version,
        placement=pb.Placement(version=version, phy2log=codec.encode(new.astype(np.int32))),
        transfers=codec.encode(transfers(old, new, num_gpus=1).astype(np.int32)),
    ))
    times: list[float] = []
    while hook._migration is not None and hook._migration.is_alive():  # prepare beside serving
        times += timed_steps(step, 1, device)
    if hook.stats.failed:
        raise RuntimeError("the hook's plan failed to prepare")
    hook.on_commit(version)
    while hook.version < version:
        times += timed_steps(step, 1, device)
    return {
        "hook_plan_slots_moved": int((hook.phy2log != old).sum()),
        "hook_plan_copied_at_commit": hook.stats.copied_at_commit,
        "hook_plan_swap_ms": round(1e3 * hook.stats.swap_seconds[swaps], 3),
        "hook_plan_max_step_ms": round(1e3 * max(times), 3) if times else None,
        "version": hook.version,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--layers", type=int, default=BenchConfig.layers)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--steps", type=int, default=BenchConfig.steps)
    p.add_argument("--redundant", type=int, default=BenchConfig.redundant)
    p.add_argument("--spare-rows", type=int, default=BenchConfig.spare_rows)
    p.add_argument("--workload", default=BenchConfig.workload)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    tokens = args.tokens or (64 if args.small else BenchConfig.tokens)
    cfg = BenchConfig(device=args.device, small=args.small, layers=args.layers, tokens=tokens,
                      steps=args.steps, redundant=args.redundant, spare_rows=args.spare_rows,
                      workload=args.workload)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if cfg.device == "cpu":
        torch.set_num_threads(1)
    try:
        out = run(cfg, print if dist.get_rank() == 0 else (lambda _: None))
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
