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

Figures: per-step wall time (the forward plus `step_end`, synchronized), the stock model
and the adapter measured in ONE process, interleaved: rounds of `--block-steps` steps of
each (A B, B A, ...; a warm-up round and one untimed step after each switch dropped), both
replaying the same pre-drawn routings in a round. A figure is the median over rounds of the
round's ratio, with its interquartile range and range (bench/interleave.py):
- stock: the stock model (transformers' grouped_mm experts), its blocks graphed too;
- adapter before / after a live rebalance: a real controller (embedded, on loopback) gets
  the windows, an operator-forced plan is prepared (weights moved into spare rows) and
  committed through the hook between two replays;
- hook overhead = adapter / stock - 1 per round (before the rebalance), and after / stock
  - 1 in a second interleaved phase after it; the swap pause (`HookStats.swap_seconds`);
- logits: wrapped vs unwrapped, and after vs before the rebalance, on one fixed input;
- with `--profile-steps N`, each variant's device time per kernel after each phase, and
  the kernels whose time moved most from before the plan to after it.
One GPU has nothing to balance, so its plan (`--hook-plan`) is the bench's own: "rotate"
(default) moves weights into spare rows and swaps the maps but keeps every expert's
replicas, so the grouped products do the same work and the after-plan overhead is the
adapter's; "random" replicates other experts, a different placement: on one H100 its
grouped products took +121..149 us a step (+1.5 %; hot experts lost their replica to
cold ones), which was the whole of the after-plan overhead once read as the dispatch's.
The stock model's MoE blocks (their graphs on CUDA, their experts on CPU) stay alive
beside the adapter's so the two can alternate: the stock expert weights are kept (the
adapter alone would drop them), 21 GiB a layer at DeepSeek-V3's shapes, beside the
adapter's 25 GiB of slot and spare rows. Before allocating, the bench works out what
its configuration needs on each GPU (`memory_need`) against the free memory: by default
it serves as many of its 2 layers as fit (one on an 80 GB H100) and says so; an explicit
`--layers` (or `--tokens`) that cannot fit is refused in one line with the numbers, exit 2.
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
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from bench.interleave import overhead_pct, run_interleaved, spread
from rebalancer.controller.config import ControllerConfig
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3
from worker_hooks.config import WindowConfig
from worker_hooks.engines.transformers.adapter import (
    WEIGHT_NAMES,
    AdapterConfig,
    ExpertParallelModel,
    Link,
    MoEBlock,
    attach,
    find_moe_blocks,
    graph_moe_blocks,
)

DeviceKind = Literal["cuda", "cpu"]
HookPlan = Literal["rotate", "random"]


@dataclass
class BenchConfig:
    device: DeviceKind = "cuda"
    small: bool = False
    layers: int = 2  # with auto_layers: the most, fewer if the GPU cannot hold them
    auto_layers: bool = False
    tokens: int = 2048  # per rank per step (one sequence)
    redundant: int = 32  # P = 256 + 32 slots
    spare_rows: int = 16
    steps: int = 30  # timed steps per variant per phase (rounded up to whole blocks)
    block_steps: int = 10  # steps of one variant in a row (a round: one block of each)
    routings: int = 16  # distinct routings drawn ahead and replayed in turn
    window_steps: int = 4
    agree_every: int = 2
    workload: str = "prefill_in4096"
    hook_plan: HookPlan = "rotate"  # one GPU's plan (`reshuffled`): "rotate" or "random"
    profile_steps: int = 0  # steps of each variant under torch.profiler after each phase
    # How long to serve waiting for the forced plan to commit: bounded by time, not by a
    # number of steps that a fast machine happens to reach before a loaded one decides.
    swap_timeout_s: float = 120.0

    @property
    def rounds(self) -> int:
        """Timed rounds of an interleaved phase: `steps` per variant in whole blocks."""
        return -(-self.steps // self.block_steps)


# The model's shapes: DeepSeek-V3's (CUDA) or a tiny one (--small). `model_config` and
# the memory sizing (`memory_need`) read the same numbers.
FULL_SHAPE: dict[str, int] = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    vocab_size=4096,
)
SMALL_SHAPE: dict[str, int] = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    vocab_size=256,
)
TOP_K = 8
SHARED_EXPERTS = 1


def model_config(cfg: BenchConfig) -> Any:
    """DeepSeek-V3's MoE shapes (or a tiny one with --small); every layer MoE."""
    from transformers import DeepseekV3Config

    shape: dict[str, Any] = SMALL_SHAPE if cfg.small else FULL_SHAPE
    config = DeepseekV3Config(
        num_hidden_layers=cfg.layers,
        first_k_dense_replace=0,
        num_experts_per_tok=TOP_K,
        n_group=8,
        topk_group=4,
        n_shared_experts=SHARED_EXPERTS,
        max_position_embeddings=max(4096, cfg.tokens),
        rope_scaling=None,
        **shape,
    )
    config._attn_implementation = "sdpa"
    return config


GIB = float(1 << 30)
# Bytes a graphed MoE block's intermediates take per pick (token x top-k) and hidden
# element: its static buffers and private pool (the gathered picks, the two grouped
# products, the per-pick outputs, the fp32 weighted combine), with room to spare.
ACT_BYTES_PER_PICK = 16
# cuBLAS and NCCL workspaces, the allocator's rounding, the CUDA graphs' own state.
MARGIN_BYTES = 2 << 30


class SizeError(ValueError):
    """The configuration asked for does not fit the device (one line: needed vs free)."""


@dataclass(frozen=True)
class MemoryNeed:
    """What one GPU holds for `layers` MoE layers, in bytes: the stock experts `[E, ...]`
    (kept beside the adapter's so the two variants alternate), the adapter's slot rows
    `[P / G + spare rows, ...]`, the staging of the bench's plan, the layers' other
    weights, the embeddings, the activations of `tokens` (each layer's two graphed
    blocks, stock and adapter, plus one eager forward) and a margin."""

    layers: int
    stock_experts: int
    slot_rows: int
    staging: int
    other_weights: int
    activations: int
    margin: int = MARGIN_BYTES

    @property
    def total(self) -> int:
        return (
            self.stock_experts
            + self.slot_rows
            + self.staging
            + self.other_weights
            + self.activations
            + self.margin
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            k: round(v / GIB, 2)
            for k, v in {**asdict(self), "total": self.total}.items()
            if k != "layers"
        }


def memory_need(
    cfg: BenchConfig, layers: int, world: int = 1, element_bytes: int = 2
) -> MemoryNeed:
    """The bytes one GPU of `world` needs to run `cfg` with `layers` MoE layers (pure
    arithmetic on the shapes `model_config` builds; `element_bytes`: 2 for bf16)."""
    shape = SMALL_SHAPE if cfg.small else FULL_SHAPE
    h, i, e = shape["hidden_size"], shape["moe_intermediate_size"], shape["n_routed_experts"]
    heads, vocab = shape["num_attention_heads"], shape["vocab_size"]
    expert = 3 * h * i * element_bytes  # gate_up [2I, H] + down [H, I]
    rows = (e + cfg.redundant) // world + cfg.spare_rows
    # One GPU's plan (_hook_plan) moves max(spare_rows, 1) experts a layer, staged first.
    moved = max(cfg.spare_rows, 1)
    q_head = shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"]
    attention = (
        h * shape["q_lora_rank"]
        + shape["q_lora_rank"] * heads * q_head
        + h * (shape["kv_lora_rank"] + shape["qk_rope_head_dim"])
        + shape["kv_lora_rank"] * heads * (shape["qk_nope_head_dim"] + shape["v_head_dim"])
        + heads * shape["v_head_dim"] * h
    )
    per_layer_other = (attention + SHARED_EXPERTS * 3 * h * i + e * h) * element_bytes
    embeddings = 2 * vocab * h * element_bytes  # input embeddings and the LM head
    picks = cfg.tokens * world * TOP_K  # a rank's blocks see every rank's tokens
    block = picks * h * ACT_BYTES_PER_PICK
    # sdpa's scores and probabilities (fp32) and the fp32 logits of the eager forward
    eager = block + 2 * heads * cfg.tokens**2 * 4 + cfg.tokens * vocab * 4
    graphs_per_layer = 2 if cfg.device == "cuda" else 0
    return MemoryNeed(
        layers=layers,
        stock_experts=layers * e * expert,
        slot_rows=layers * rows * expert,
        staging=layers * moved * expert,
        other_weights=layers * per_layer_other + embeddings,
        activations=layers * graphs_per_layer * block + eager,
    )


def size_to_device(
    cfg: BenchConfig, free_bytes: int, world: int = 1
) -> tuple[BenchConfig, MemoryNeed]:
    """`cfg` with the layers that fit `free_bytes` on each GPU: with `auto_layers`, the
    most up to `cfg.layers`; else exactly `cfg.layers`. Raises SizeError (one line, the
    numbers) when nothing asked for fits."""
    need = memory_need(cfg, cfg.layers, world)
    if need.total <= free_bytes:
        return cfg, need
    fits = [
        n for n in range(cfg.layers - 1, 0, -1) if memory_need(cfg, n, world).total <= free_bytes
    ]
    what = f"{cfg.layers} layer{'s' if cfg.layers > 1 else ''} x {cfg.tokens} tokens"
    short = (
        f"{what} need {need.total / GIB:.1f} GiB on each GPU ({need.stock_experts / GIB:.1f} stock "
        f"experts, {need.slot_rows / GIB:.1f} slot rows, {need.activations / GIB:.1f} "
        f"activations), {free_bytes / GIB:.1f} GiB free"
    )
    if not fits:
        one = memory_need(cfg, 1, world)
        raise SizeError(
            f"{short}; even 1 layer needs {one.total / GIB:.1f} GiB: use fewer --tokens, "
            f"--redundant or --spare-rows, or a larger GPU"
        )
    if not cfg.auto_layers:
        raise SizeError(f"{short}: --layers {fits[0]} fits (or leave --layers out to fit the GPU)")
    return replace(cfg, layers=fits[0]), memory_need(cfg, fits[0], world)


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


def sample_ids(
    profile: np.ndarray, tokens: int, top_k: int, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """`[L, T, K]` distinct experts per token drawn from `profile` `[L, E]` (Gumbel top-k)."""
    logp = torch.from_numpy(np.log(profile)).float()
    u = torch.rand((profile.shape[0], tokens, profile.shape[1]), generator=gen).clamp_(
        1e-9, 1 - 1e-9
    )
    return (logp[:, None, :] - torch.log(-torch.log(u))).topk(top_k, dim=-1).indices.to(device)


class ReplayRouter(nn.Module):
    """The stock router, its top-k ids replaced by a static buffer (graph-safe)."""

    def __init__(self, gate: nn.Module, tokens: int, top_k: int, device: torch.device) -> None:
        super().__init__()
        self.gate = gate
        self.ids = torch.zeros(tokens, top_k, dtype=torch.int64, device=device)

    def forward(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


# Submodules to put in place for one variant: (parent, attribute, module).
SwapSet = list[tuple[nn.Module, str, nn.Module]]


def swap_set(model: nn.Module, modules: dict[str, nn.Module]) -> SwapSet:
    """Where each of `modules` (dotted path -> module) goes in `model`; the parents are
    looked up once, so installing a variant is a few attribute writes."""
    out: SwapSet = []
    for path, module in modules.items():
        parent_name, _, attr = path.rpartition(".")
        out.append((model.get_submodule(parent_name) if parent_name else model, attr, module))
    return out


def install(modules: SwapSet) -> None:
    for parent, attr, module in modules:
        setattr(parent, attr, module)


def interleaved_phase(
    variants: dict[str, tuple[SwapSet, Callable[[int], None]]],
    cfg: BenchConfig,
    device: torch.device,
) -> dict[str, list[list[float]]]:
    """Each variant (its modules, its step on routing i) in blocks of `block_steps` steps,
    alternating round by round (a warm-up round dropped); round r of every variant
    replays routings r * block_steps ... of the pool. Per variant: the step times (s) of
    each round."""

    def measure(name: str) -> Callable[[int], list[float]]:
        modules, step = variants[name]

        def block(r: int) -> list[float]:
            install(modules)
            first = r * cfg.block_steps
            step(first - 1)  # untimed: the first step after a switch pays for it
            indices = iter(range(first, first + cfg.block_steps))
            return timed_steps(lambda: step(next(indices)), cfg.block_steps, device)

        return block

    return run_interleaved({name: measure(name) for name in variants}, cfg.rounds, warmup_rounds=1)


def kernel_times(step: Callable[[int], None], steps: int) -> dict[str, float]:
    """Device time (us per step) of each kernel, by name, over `steps` steps of `step`
    on routings 0, 1, ... (kernels replayed from CUDA graphs included)."""
    from torch.profiler import ProfilerActivity, profile

    step(-1)  # untimed: the first step after a switch
    torch.cuda.synchronize()
    with (
        warnings.catch_warnings()
    ):  # "Profiler clears events at the end of each cycle": one cycle here
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(steps):
                step(i)
            torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:120]
            out[name] = out.get(name, 0.0) + event.time_range.elapsed_us() / steps
    return out


def profile_phase(
    variants: dict[str, tuple[SwapSet, Callable[[int], None]]], steps: int
) -> dict[str, dict[str, float]]:
    """`kernel_times` of each variant, its modules installed; kernels under 1 us a step
    are left out."""
    out = {}
    for name, (modules, step) in variants.items():
        install(modules)
        times = kernel_times(step, steps)
        out[name] = {
            k: round(v, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1]) if v >= 1.0
        }
    return out


def profile_deltas(
    before: dict[str, float], after: dict[str, float], top: int = 8
) -> list[tuple[str, float]]:
    """The kernels whose device time per step moved most from `before` to `after` (us),
    largest change first, with the total's change first of all."""
    names = set(before) | set(after)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in names}
    ranked = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:top]
    return [("total", sum(after.values()) - sum(before.values())), *ranked]


def step_figures(times: dict[str, list[list[float]]], base: str, variant: str) -> dict[str, Any]:
    """Median step times (ms) of the two variants, and the variant's overhead over the
    baseline: per round, the ratio of the two blocks' median steps."""
    per_round = {k: [statistics.median(r) for r in v] for k, v in times.items()}
    steps = {k: [t for r in v for t in r] for k, v in times.items()}
    over = overhead_pct(per_round[base], per_round[variant])
    return {
        "base_ms": round(1e3 * statistics.median(steps[base]), 3),
        "variant_ms": round(1e3 * statistics.median(steps[variant]), 3),
        "base_round_ms": spread([1e3 * t for t in per_round[base]]).as_dict(3),
        "variant_round_ms": spread([1e3 * t for t in per_round[variant]]).as_dict(3),
        "overhead_pct": over,
    }


def run(cfg: BenchConfig, emit: Callable[[str], None], scratch: str) -> dict[str, Any]:
    """The bench on this rank; `scratch` is a folder for the controller's store (rank 0)."""
    import transformers

    if cfg.steps < 1 or cfg.block_steps < 1 or cfg.routings < 1:
        raise ValueError("steps, block_steps and routings must be at least 1")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device(cfg.device, rank % max(torch.cuda.device_count(), 1))
        if cfg.device == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    graphs = device.type == "cuda"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    memory: dict[str, Any] = {}
    if device.type == "cuda":
        # Sized before anything is allocated, every rank to the tightest GPU.
        free = torch.tensor([torch.cuda.mem_get_info(device)[0]], dtype=torch.int64)
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
        asked = cfg.layers
        cfg, need = size_to_device(cfg, int(free), world)
        memory = {
            "layers_asked": asked,
            "memory_free_gib": round(int(free) / GIB, 2),
            "memory_need_gib": need.as_dict(),
        }
        emit(
            f"memory: {cfg.layers} of {asked} layers fit ({need.total / GIB:.1f} GiB needed, "
            f"{int(free) / GIB:.1f} GiB free on each GPU)"
        )
    config = model_config(cfg)
    torch.manual_seed(0)  # every rank: the same weights
    with device:
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, experts_implementation="grouped_mm"
        )
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
    probe_ids = sample_ids(
        profile, cfg.tokens, top_k, torch.Generator().manual_seed(7 + rank), device
    )
    # Drawn ahead (on the host, out of the timed steps) and replayed in turn, so the
    # variants of a round serve the very same routings.
    pool = [sample_ids(profile, cfg.tokens, top_k, gen, device) for _ in range(cfg.routings)]

    def set_routing(ids: torch.Tensor) -> None:
        for layer, router in enumerate(routers):
            router.ids.copy_(ids[layer])

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids, use_cache=False).logits

    def example(b: MoEBlock) -> tuple[torch.Tensor, dict[str, Any]]:
        return torch.randn(1, cfg.tokens, config.hidden_size, device=device, dtype=dtype), {}

    def serve(hook_step: Callable[[], None] | None) -> Callable[[int], None]:
        """One step on routing i of the pool."""

        def step(i: int) -> None:
            set_routing(pool[i % len(pool)])
            forward()
            if hook_step is not None:
                hook_step()

        return step

    def graphed_or_experts() -> dict[str, nn.Module]:
        """The modules that make a variant: the graphed blocks (CUDA), else the experts."""
        if graphs:
            return {b.name: model.get_submodule(b.name) for b in blocks}
        return {f"{b.name}.experts": b.block.experts for b in blocks}

    # 1. The stock model (its blocks graphed too): the baseline. attach() below drops
    # the stock experts' weights; they are put back so the stock variant keeps serving.
    set_routing(probe_ids)
    stock_logits = forward()
    stock_experts = [
        (b.block.experts, {n: getattr(b.block.experts, n) for n in WEIGHT_NAMES}) for b in blocks
    ]
    if graphs:
        graph_moe_blocks(model, example)
    set_routing(probe_ids)
    stock_graphed_logits = forward()
    stock = swap_set(model, graphed_or_experts())
    install(swap_set(model, {b.name: b.block for b in blocks}))  # attach wraps the bare blocks

    # 2. The adapter, talking to a real controller (rank 0 runs it).
    ctl: EmbeddedController | None = None
    address = [""]
    if rank == 0:
        ctl = EmbeddedController(
            ControllerConfig(
                port=0,
                db_path=os.path.join(scratch, "c.sqlite"),
                drain_seconds=0.0,
                policy=PolicyConfig(
                    min_windows=1,
                    decision_period_seconds=0.2,
                    prepare_timeout_seconds=60.0,
                    max_moved_fraction=1.0,
                    paused=True,
                ),
            )
        )
        address[0] = ctl.start().address
    dist.broadcast_object_list(address, src=0)
    # The token exchange of G > 1 CUDA ranks runs on NCCL (captured in the graphs).
    ep_group = dist.new_group(backend="nccl") if world > 1 and device.type == "cuda" else None
    try:
        ep = attach(
            model,
            AdapterConfig(
                link=Link(address[0], deployment="bench-tf"),
                redundant_slots=cfg.redundant,
                spare_rows=cfg.spare_rows,
                windows=WindowConfig(steps=cfg.window_steps),
                agree_every=cfg.agree_every,
            ),
            ep_group=ep_group,
        )
        for experts, held in stock_experts:
            for name, weight in held.items():
                setattr(experts, name, weight)
        # `stock_experts` stays referenced to the end of run: on CUDA the stock graphs read
        # these weights, and a graph holds no reference to what it reads.
        ep.start()
        ep.hook.agent.connected.wait(10)
        set_routing(probe_ids)
        wrapped_logits = forward()
        if graphs:
            graph_moe_blocks(model, example)
        adapter = swap_set(model, graphed_or_experts())
        set_routing(probe_ids)
        before_logits = forward()
        before_variants = {"stock": (stock, serve(None)), "adapter": (adapter, serve(ep.step_end))}
        before = interleaved_phase(before_variants, cfg, device)
        profiles: dict[str, dict[str, dict[str, float]]] = {}
        if cfg.profile_steps and device.type == "cuda":
            profiles["before"] = profile_phase(before_variants, cfg.profile_steps)
        install(adapter)
        served = iter(range(1 << 62))
        adapter_step = serve(ep.step_end)

        def next_step() -> None:
            adapter_step(next(served))

        result = _rebalance_live(cfg, ep, ctl, next_step, device, world)
        if world == 1:
            # One GPU has nothing to balance: the controller's plan moves no slot. Move
            # experts anyway through the hook's own prepare/commit path (spare rows, map
            # swap between replays) so the graphs are replayed across a real weight move.
            ep.hook.stop()  # the controller does not know this plan: nothing reported
            result.update(_hook_plan(ep, next_step, device, cfg.hook_plan))
        after_variants = {"stock": (stock, serve(None)), "adapter": (adapter, serve(ep.step_end))}
        after = interleaved_phase(after_variants, cfg, device)
        if cfg.profile_steps and device.type == "cuda":
            profiles["after"] = profile_phase(after_variants, cfg.profile_steps)
        install(stock)  # the stock variant still serves the stock model (its weights kept)
        set_routing(probe_ids)
        stock_again_logits = forward()
        install(adapter)
        set_routing(probe_ids)
        after_logits = forward()
        ep.finish()
        del stock_experts  # the stock graphs are not replayed again
    finally:
        if ctl is not None:
            ctl.stop()

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max())

    first, second = (
        step_figures(before, "stock", "adapter"),
        step_figures(after, "stock", "adapter"),
    )
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world": world,
        "cuda_graphs": graphs,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        **asdict(cfg),
        "rounds": cfg.rounds,
        "moe_layers": len(blocks),
        "experts": num_experts,
        "slots": num_experts + cfg.redundant,
        "step_ms_unwrapped": first["base_ms"],
        "step_ms_before": first["variant_ms"],
        "step_ms_unwrapped_after_phase": second["base_ms"],
        "step_ms_after": second["variant_ms"],
        "round_ms_unwrapped": first["base_round_ms"],
        "round_ms_before": first["variant_round_ms"],
        "round_ms_unwrapped_after_phase": second["base_round_ms"],
        "round_ms_after": second["variant_round_ms"],
        "hook_overhead_pct": round(first["overhead_pct"].median, 2),
        "hook_overhead_pct_spread": first["overhead_pct"].as_dict(3),
        "after_overhead_pct": round(second["overhead_pct"].median, 2),
        "after_overhead_pct_spread": second["overhead_pct"].as_dict(3),
        **result,
        "logit_diff_wrapped_vs_stock": diff(wrapped_logits, stock_logits),
        "logit_diff_graphed_vs_eager_stock": diff(stock_graphed_logits, stock_logits),
        "logit_diff_graphed_vs_eager_wrapped": diff(before_logits, wrapped_logits),
        "logit_diff_after_vs_before": diff(after_logits, before_logits),
        "logit_diff_stock_at_end_vs_start": diff(stock_again_logits, stock_graphed_logits),
        "logit_scale": float(stock_logits.float().abs().max()),
        **memory,
    }
    if profiles:
        out["profile_us_per_step"] = profiles
        for variant in ("adapter", "stock"):
            moved = profile_deltas(profiles["before"][variant], profiles["after"][variant])
            out[f"profile_{variant}_after_minus_before_us"] = [[k, round(v, 1)] for k, v in moved]
            emit(
                f"profile, {variant} after - before (device us/step): "
                + "; ".join(f"{k[:60]} {v:+.1f}" for k, v in moved)
            )
    if device.type == "cuda":
        out["memory_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GIB, 2)
    emit(
        f"interleaved, {out['rounds']} rounds of {cfg.block_steps} steps per variant: "
        f"stock {out['step_ms_unwrapped']} ms/step, adapter {out['step_ms_before']} ms/step; "
        f"hook overhead {first['overhead_pct'].text('%', signed=True)}"
    )
    emit(
        f"after the rebalance: stock {out['step_ms_unwrapped_after_phase']} ms/step, adapter "
        f"{out['step_ms_after']} ms/step; overhead {second['overhead_pct'].text('%', signed=True)}"
    )
    emit(
        f"rebalance v{out['version']}: {out['slots_moved']} slots moved, swap {out['swap_ms']} ms, "
        f"swap step {out['swap_step_ms']} ms; logits after vs before "
        f"{out['logit_diff_after_vs_before']}"
    )
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
    cfg: BenchConfig,
    ep: ExpertParallelModel,
    ctl: EmbeddedController | None,
    step: Callable[[], None],
    device: torch.device,
    world: int = 1,
) -> dict[str, Any]:
    """Serve until the controller has windows, force one plan (rank 0), serve until it
    commits; returns the swap figures."""
    old = ep.hook.phy2log.copy()
    first_step = ep.hook.step  # times[i] is the hook's step first_step + i + 1
    forced = [0]
    times: list[float] = []
    deadline = time.monotonic() + cfg.swap_timeout_s
    while time.monotonic() < deadline:
        times += timed_steps(step, 1, device)
        if ctl is not None and not forced[0]:
            forced[0] = int(ctl.call(lambda: _force(ctl, "bench-tf")))  # type: ignore[call-overload]
            if forced[0] < 0 and world == 1:
                # One GPU has nothing to balance: the controller starts no plan that moves
                # nothing (the caller moves experts through the hook's own path instead).
                return {
                    "version": ep.version,
                    "slots_moved": 0,
                    "swap_ms": None,
                    "swap_step_ms": None,
                    "controller_plan": "nothing to move on one GPU",
                }
            if forced[0] < 0:
                raise RuntimeError("the controller found no placement change to force")
        if ep.version >= 1:
            break
    if ep.version < 1:
        raise RuntimeError(
            f"no plan committed within {cfg.swap_timeout_s:g} s ({len(times)} steps served)"
        )
    stats = ep.hook.stats
    commit_step = stats.commits[0][0]
    return {
        "version": ep.version,
        "slots_moved": int((ep.hook.phy2log != old).sum()),
        "bytes_received": stats.bytes_received,
        "copied_at_commit": stats.copied_at_commit,
        "swap_ms": round(1e3 * max(stats.swap_seconds), 3),
        "swap_step_ms": round(1e3 * times[commit_step - 1 - first_step], 3)
        if commit_step > first_step
        else None,
        "steps_to_commit": len(times),
    }


def reshuffled(old: np.ndarray, num_logical: int, moved: int, kind: HookPlan) -> np.ndarray:
    """The placement `[L, P]` of one GPU's plan: the first `moved` redundant slots of
    every layer take other experts (each lands in a spare row while serving; every
    expert keeps its first copy).

    "rotate": those slots' experts rotate by one slot, so the same experts keep the same
    number of replicas: the weights move and the maps change, the work does not (the
    after-plan overhead is the adapter's alone). "random": they take experts drawn among
    the others, a different placement whose grouped products differ in work (hot
    experts lose their replica to cold ones)."""
    new = old.copy()
    lo, hi = num_logical, min(num_logical + moved, old.shape[1])
    if hi <= lo:
        return new
    if kind == "rotate":
        new[:, lo:hi] = np.roll(old[:, lo:hi], 1, axis=1)
        return new
    rng = np.random.default_rng(3)
    for layer in range(old.shape[0]):
        held = set(old[layer, lo:hi].tolist())
        others = np.array([e for e in range(num_logical) if e not in held])
        new[layer, lo:hi] = rng.choice(others, hi - lo, replace=False)
    return new


def _hook_plan(
    ep: ExpertParallelModel,
    step: Callable[[], None],
    device: torch.device,
    kind: HookPlan = "rotate",
) -> dict[str, Any]:
    """Prepare and commit a reshuffled placement (`reshuffled`) on this rank as a
    controller's Prepare would, serving between; the swap figures."""
    from rebalancer.placement.transfers import transfers
    from rebalancer.v1 import rebalancer_pb2 as pb
    from rebalancer.wire import codec

    hook = ep.hook
    old, version = hook.phy2log.copy(), hook.version + 1
    # The first spare_rows redundant slots of every layer take other experts: each lands
    # in a spare row while serving, and every expert keeps its first copy.
    num_logical, moved = hook.config.shape.num_logical, max(hook.config.commit.spare_rows, 1)
    new = reshuffled(old, num_logical, moved, kind)
    swaps = len(hook.stats.swap_seconds)
    hook.plans.on_prepare(
        pb.Prepare(
            version=version,
            base_version=hook.version,
            placement=pb.Placement(version=version, phy2log=codec.encode(new.astype(np.int32))),
            transfers=codec.encode(transfers(old, new, num_gpus=1).astype(np.int32)),
        )
    )
    times: list[float] = []
    while (
        hook.plans.migration is not None and hook.plans.migration.is_alive()
    ):  # prepare beside serving
        times += timed_steps(step, 1, device)
    if hook.stats.failed:
        raise RuntimeError("the hook's plan failed to prepare")
    hook.plans.on_commit(version)
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
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"MoE layers (default: up to {BenchConfig.layers}, as many as the GPU holds)",
    )
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument(
        "--steps", type=int, default=BenchConfig.steps, help="timed steps per variant and phase"
    )
    p.add_argument(
        "--block-steps",
        type=int,
        default=BenchConfig.block_steps,
        help="steps of one variant in a row before the other's turn",
    )
    p.add_argument(
        "--routings",
        type=int,
        default=BenchConfig.routings,
        help="distinct routings replayed in turn",
    )
    p.add_argument("--redundant", type=int, default=BenchConfig.redundant)
    p.add_argument("--spare-rows", type=int, default=BenchConfig.spare_rows)
    p.add_argument("--workload", default=BenchConfig.workload)
    p.add_argument(
        "--hook-plan",
        choices=("rotate", "random"),
        default=BenchConfig.hook_plan,
        help="one GPU's plan: rotate the replicated experts (same work) or replicate random ones",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each phase, profile this many steps of each variant (device time per kernel)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    for name in ("layers", "steps", "block_steps", "routings", "tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    tokens = args.tokens or (64 if args.small else BenchConfig.tokens)
    cfg = BenchConfig(
        device=args.device,
        small=args.small,
        layers=args.layers or BenchConfig.layers,
        auto_layers=args.layers is None,
        tokens=tokens,
        steps=args.steps,
        block_steps=args.block_steps,
        routings=args.routings,
        redundant=args.redundant,
        spare_rows=args.spare_rows,
        workload=args.workload,
        hook_plan=args.hook_plan,
        profile_steps=max(args.profile_steps, 0),
    )
    # The store, and a world of one's rendezvous (a file: no port to race other processes
    # for), live in a folder removed on the way out.
    with tempfile.TemporaryDirectory(prefix="bench-tf-") as scratch:
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group("gloo")
        else:
            dist.init_process_group(
                "gloo", init_method=f"file://{scratch}/rdzv", rank=0, world_size=1
            )
        if cfg.device == "cpu":
            torch.set_num_threads(1)
        try:
            out = run(cfg, print if dist.get_rank() == 0 else (lambda _: None), scratch)
        except SizeError as exc:  # every rank sized to the same (tightest) GPU
            if dist.get_rank() == 0:
                p.exit(2, f"{p.prog}: error: {exc}\n")
            raise SystemExit(2) from None
        finally:
            dist.barrier()
            dist.destroy_process_group()
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
