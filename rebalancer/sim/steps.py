"""Per-step balance: each step's tokens drawn from its window's routing, per dispatch mode.

A window's counts average thousands of steps, so a placement judged on them hides the
noise every single step carries: the busiest GPU of a step is busier than the busiest
GPU of the window's average. Dispatch by load (rebalancer.wire.dispatch) exists to
absorb exactly that noise, so it can only be judged step by step:
1. for a window served by a placement, draw steps: every rank's `batch_tokens` tokens,
   each routed to `top_k` experts of every layer from the window's routing distribution
   (decode: 64-512 tokens per GPU, prefill: 4,096-16,384), plus one shared-expert
   token each (DeepSeek-V3's shared expert is the size of a routed one);
2. give every mode the same draws and compute each GPU's tokens (routed + shared) with
   the placement math (`dispatch_allocation`, the water-fill the workers run);
3. a step's time is its busiest GPU's tokens summed over layers (layers synchronise);
   `relative_step_throughput` is the ideal (mean GPU) over that, and `vs_split` the step
   throughput of a mode over split's on the same draws.
Windows are sampled evenly (`sampled_windows`) to keep the cost of a whole trace to
seconds per batch size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rebalancer.errors import InputError
from rebalancer.placement.metrics import dispatch_allocation, gpu_replicas
from rebalancer.sim.engine import PolicyResult, SimConfig, Simulator
from rebalancer.sim.trace import Trace
from rebalancer.wire.dispatch import (
    DISPATCH_MODES,
    WATERFILL_PASSES,
    DispatchMode,
    check_dispatch_mode,
    check_waterfill_passes,
)

# Tokens per GPU per step the CLI reports by default: decode and prefill batch sizes.
DECODE_BATCH_TOKENS = (64, 128, 256, 512)
PREFILL_BATCH_TOKENS = (4096, 16384)
# The largest batch a step may draw per GPU (the draws are [L, G, E] per step).
MAX_BATCH_TOKENS = 1 << 20


@dataclass(frozen=True)
class StepConfig:
    """What the per-step model draws and under which dispatch modes it serves it."""

    batch_tokens: tuple[int, ...] = DECODE_BATCH_TOKENS
    modes: tuple[DispatchMode, ...] = DISPATCH_MODES
    top_k: int = 8
    # Shared-expert tokens per token (DeepSeek-V3: one shared expert, a routed one's size).
    shared_experts: int = 1
    # Windows evaluated (evenly spaced over the trace), and steps drawn in each.
    sampled_windows: int = 32
    steps_per_window: int = 1
    seed: int = 0
    # Water-filling passes of the load modes (what HookConfig.dispatch.waterfill_passes sets).
    waterfill_passes: int = WATERFILL_PASSES

    def validate(self) -> None:
        if not self.batch_tokens:
            raise InputError("batch_tokens needs at least one batch size")
        for b in self.batch_tokens:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 < b <= MAX_BATCH_TOKENS:
                raise InputError(
                    f"batch tokens must be integers in [1, {MAX_BATCH_TOKENS}], got {b!r}"
                )
        if not self.modes:
            raise InputError("modes needs at least one dispatch mode")
        for mode in self.modes:
            check_dispatch_mode(mode)
        for name in ("top_k", "sampled_windows", "steps_per_window"):
            if getattr(self, name) <= 0:
                raise InputError(f"{name} must be > 0, got {getattr(self, name)}")
        check_waterfill_passes(self.waterfill_passes)
        if self.shared_experts not in (0, 1):
            raise InputError(f"shared_experts must be 0 or 1, got {self.shared_experts}")


def sample_step(
    rng: np.random.Generator, probs: np.ndarray, num_gpus: int, batch_tokens: int, top_k: int
) -> np.ndarray:
    """One step's routing: every rank's `batch_tokens * top_k` picks per layer.

    probs: [L, E] routing distribution per layer (rows sum to 1).
    Returns: [L, G, E] int64 tokens each rank routed to each expert.
    """
    num_layers, num_logical = probs.shape
    draws = rng.multinomial(
        batch_tokens * top_k, np.broadcast_to(probs, (num_gpus, num_layers, num_logical))
    )
    return np.ascontiguousarray(np.swapaxes(draws, 0, 1)).astype(np.int64)


def window_probs(counts: np.ndarray) -> np.ndarray:
    """A window's routing distribution per layer; a layer without counts routes uniformly.

    counts: [L, E]. Returns: [L, E] float64, rows summing to 1.
    """
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum(axis=1, keepdims=True)
    uniform = np.full_like(c, 1.0 / c.shape[1])
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, c / np.where(total > 0, total, 1.0), uniform)


def sampled_windows(num_windows: int, count: int) -> np.ndarray:
    """`count` window indices evenly spaced over [0, num_windows) (all when fewer)."""
    if count >= num_windows:
        return np.arange(num_windows)
    return np.unique(np.linspace(0, num_windows - 1, count).round().astype(np.int64))


def step_balance(
    trace: Trace,
    placements: Sequence[np.ndarray] | Mapping[str, Sequence[np.ndarray]],
    num_gpus: int,
    config: StepConfig,
) -> dict[str, Any]:
    """Per-step balance of one policy's placements under each dispatch mode.

    placements: [T] of [L, P], the placement serving each window; or, per mode, the
    placements a policy deciding under that mode served (`decide_under_modes`). Returns
    `{str(batch_tokens): {mode: {"relative_step_throughput", "vs_split", "steps"}}}`.
    The draws depend only on (seed, window, batch size, step): every policy and mode
    sees the same tokens.
    """
    config.validate()
    by_mode = (
        placements if isinstance(placements, Mapping) else dict.fromkeys(config.modes, placements)
    )
    for mode in config.modes:
        if mode not in by_mode:
            raise InputError(f"no placements for dispatch mode {mode!r}")
        if len(by_mode[mode]) != trace.num_windows:
            raise InputError(f"{len(by_mode[mode])} placements for {trace.num_windows} windows")
    windows = sampled_windows(trace.num_windows, config.sampled_windows)
    out: dict[str, Any] = {}
    for batch in config.batch_tokens:
        busiest = dict.fromkeys(config.modes, 0.0)
        ideal = 0.0
        steps = 0
        for w in windows:
            probs = window_probs(trace.counts[w])
            replicas_of: dict[int, np.ndarray] = {}  # one table per distinct placement
            for mode in config.modes:
                p2l = by_mode[mode][w]
                if id(p2l) not in replicas_of:
                    replicas_of[id(p2l)] = gpu_replicas(
                        np.asarray(p2l, dtype=np.int64), trace.num_experts, num_gpus
                    )
            for s in range(config.steps_per_window):
                rng = np.random.default_rng([config.seed, int(w), batch, s])
                counts = sample_step(rng, probs, num_gpus, batch, config.top_k)
                shared = None
                if config.shared_experts:
                    shared = np.full((trace.num_layers, num_gpus), batch * config.shared_experts)
                for mode in config.modes:
                    replicas = replicas_of[id(by_mode[mode][w])]
                    loads = dispatch_allocation(
                        counts, replicas, mode, shared, config.waterfill_passes
                    ).sum(axis=1)
                    busiest[mode] += float(loads.max(axis=1).sum())
                ideal += float(counts.sum()) / num_gpus
                if shared is not None:
                    ideal += float(shared.sum()) / num_gpus
                steps += 1
        base = busiest.get("split")
        out[str(batch)] = {
            mode: {
                "relative_step_throughput": round(ideal / busiest[mode], 6),
                "vs_split": round(base / busiest[mode], 6) if base else None,
                "steps": steps,
            }
            for mode in config.modes
        }
    return out


def decide_under_modes(
    trace: Trace, sim: SimConfig, config: StepConfig, adaptive: PolicyResult | None = None
) -> dict[str, PolicyResult]:
    """The adaptive policy run once per dispatch mode, deciding under it: the controller
    predicts a placement's balance under the deployment's mode (`predicted_balance`), so
    a placement worth a plan under `split` need not be one under `load`. The shared
    expert's load is derived from the routed picks (`top_k`) when the model has one.

    adaptive: the adaptive run of `sim` itself, if already made: it stands for the mode
    `sim` decides under when that is `split` (which leaves the shared load out, so
    `top_k` changes nothing there). Returns: {mode: the adaptive PolicyResult of a
    simulator deciding under it}."""
    config.validate()
    top_k = config.top_k if config.shared_experts else 0
    out: dict[str, PolicyResult] = {}
    for mode in config.modes:
        if adaptive is not None and mode == sim.shape.dispatch_mode == "split":
            out[mode] = adaptive
        else:
            shape = replace(sim.shape, dispatch_mode=mode, top_k=top_k)
            out[mode] = Simulator(trace, replace(sim, shape=shape)).run("adaptive")
    return out


def attach_step_balance(
    results: dict[str, PolicyResult],
    trace: Trace,
    num_gpus: int,
    config: StepConfig,
    decided: Mapping[str, PolicyResult] | None = None,
) -> None:
    """Fill every result's `dispatch` with `step_balance` of the placements it served;
    the adaptive result's, with `decided` (`decide_under_modes`), from the placements of
    the run that decided under each mode, and its plan count per mode under
    `"decided_under_mode"`."""
    for name, result in results.items():
        if name == "adaptive" and decided is not None:
            result.dispatch = step_balance(
                trace, {m: r.placements for m, r in decided.items()}, num_gpus, config
            )
            result.dispatch_decisions = {
                m: {
                    "rebalances": r.rebalances,
                    "slots_moved": r.slots_moved,
                    "relative_throughput": round(r.relative_throughput, 6),
                }
                for m, r in decided.items()
            }
        else:
            result.dispatch = step_balance(trace, result.placements, num_gpus, config)
