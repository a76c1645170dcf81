"""Drifting traces built from real summed routing counts.

The public DeepSeek-V3 files hold one routing distribution per workload (prefill and
decode at several lengths), summed over a whole run: no time axis. Serving traffic
drifts between such workloads, so this module builds time series from them, to test and
demonstrate the policies on routing that is real per workload:
- `phase`: the traffic switches from one workload to another every 20-60 windows;
- `mix`: the share of each workload varies smoothly (sums of slow sinusoids, softmaxed);
- `burst`: a smooth mix plus unpredictable bursts, where a few random experts per
  layer get several times their load for one to a few windows.
Each window draws `tokens_per_window * top_k` routings per layer from the window's
distribution (multinomial). Tokens of one request route alike, so the effective number
of independent tokens per window is below the tokens served; pick it accordingly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rebalancer.controller.cost import check_window_seconds
from rebalancer.errors import InputError
from rebalancer.sim.trace import MAX_TOTAL_COUNT, MAX_TRACE_CELLS, Trace

KINDS = ("phase", "mix", "burst")


@dataclass(frozen=True)
class TraceGenConfig:
    kind: str = "phase"
    windows: int = 240
    # Independent tokens per window; each is routed to `top_k` experts in every layer.
    tokens_per_window: int = 65536
    top_k: int = 8
    window_seconds: float = 5.0
    seed: int = 0
    # phase: length of one workload phase, uniform in [min, max] windows.
    phase_min_windows: int = 20
    phase_max_windows: int = 60
    # mix: typical period, in windows, of the sinusoids that drive the mix weights,
    # and how sharp the mix is (0: always the uniform mix; large: one workload at a time).
    mix_period_windows: float = 120.0
    mix_sharpness: float = 2.0
    # burst: chance a window starts a burst, hot experts per layer, their load factor,
    # and the longest burst in windows.
    burst_probability: float = 0.08
    burst_experts: int = 4
    burst_factor: float = 6.0
    burst_max_windows: int = 3

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"trace kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("windows", "tokens_per_window", "top_k", "phase_min_windows"):
            if getattr(self, name) <= 0:
                raise InputError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.phase_max_windows < self.phase_min_windows:
            raise InputError("phase_max_windows must be >= phase_min_windows")
        check_window_seconds(self.window_seconds)
        if not self.mix_period_windows > 0:
            raise InputError("mix_period_windows must be > 0")
        if not 0.0 <= self.burst_probability <= 1.0 or self.burst_factor < 1.0:
            raise InputError("burst_probability must be in [0, 1] and burst_factor >= 1")
        if self.burst_experts < 0 or self.burst_max_windows <= 0 or self.mix_sharpness < 0:
            raise InputError("burst_experts >= 0, burst_max_windows > 0, mix_sharpness >= 0")


def _normalise(sources: dict[str, np.ndarray]) -> tuple[list[str], np.ndarray]:
    """Per-layer routing distributions [K, L, E] of the source workloads."""
    if not sources:
        raise InputError("a trace needs at least one source workload")
    names = list(sources)
    arrays = [np.asarray(sources[n], dtype=np.float64) for n in names]
    shape = arrays[0].shape
    if len(shape) != 2 or any(a.shape != shape for a in arrays):
        raise InputError(f"source workloads must all be [L, E], got {[a.shape for a in arrays]}")
    stacked = np.stack(arrays)
    if np.any(stacked < 0) or not np.all(np.isfinite(stacked)):
        raise InputError("source counts must be finite and non-negative")
    totals = stacked.sum(axis=2, keepdims=True)
    if np.any(totals <= 0):
        raise InputError("every layer of every source workload needs some load")
    return names, stacked / totals


def _phase_weights(cfg: TraceGenConfig, k: int, rng: np.random.Generator) -> np.ndarray:
    weights = np.zeros((cfg.windows, k))
    t, current = 0, int(rng.integers(k))
    while t < cfg.windows:
        length = int(rng.integers(cfg.phase_min_windows, cfg.phase_max_windows + 1))
        weights[t : t + length, current] = 1.0
        t += length
        if k > 1:  # always switch to a different workload
            current = int((current + rng.integers(1, k)) % k)
    return weights


def _mix_weights(cfg: TraceGenConfig, k: int, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(cfg.windows, dtype=np.float64)[:, None]
    drive = np.zeros((cfg.windows, k))
    for _ in range(2):  # two sinusoids per workload, random periods and phases
        period = cfg.mix_period_windows * rng.uniform(0.5, 1.5, size=k)
        phase = rng.uniform(0, 2 * np.pi, size=k)
        drive += np.sin(2 * np.pi * t / period + phase)
    logits = cfg.mix_sharpness * drive
    logits -= logits.max(axis=1, keepdims=True)
    w = np.exp(logits)
    return w / w.sum(axis=1, keepdims=True)


def make_trace(
    sources: dict[str, np.ndarray], config: TraceGenConfig = TraceGenConfig(), name: str = ""
) -> Trace:
    """A drifting trace `[windows, L, E]` sampled from the source workloads' distributions."""
    config.validate()
    names, dists = _normalise(sources)
    rng = np.random.default_rng(config.seed)
    k, num_layers, num_experts = dists.shape
    if config.top_k > num_experts:
        raise InputError(
            f"top_k ({config.top_k}) must be at most the number of experts ({num_experts}): "
            "a token routes to top_k distinct experts"
        )
    cells = config.windows * num_layers * num_experts
    if cells > MAX_TRACE_CELLS:
        raise InputError(
            f"{config.windows} windows x {num_layers} layers x {num_experts} experts is {cells} "
            "counts, more than the limit of 2**27"
        )
    routings = config.windows * num_layers * config.tokens_per_window * config.top_k
    if routings > MAX_TOTAL_COUNT:
        raise InputError(
            f"{config.windows} windows x {num_layers} layers x {config.tokens_per_window} tokens "
            f"x top_k {config.top_k} is {routings:.4g} routings, more than 2**62"
        )
    if config.kind == "phase":
        weights = _phase_weights(config, k, rng)
    else:
        weights = _mix_weights(config, k, rng)
    probs = np.einsum("tk,kle->tle", weights, dists)
    labels = [names[int(np.argmax(w))] for w in weights]
    if config.kind == "burst" and config.burst_experts > 0:
        t = 0
        while t < config.windows:
            if rng.random() < config.burst_probability:
                length = int(rng.integers(1, config.burst_max_windows + 1))
                hot = np.argsort(rng.random((num_layers, num_experts)), axis=1)[
                    :, : config.burst_experts
                ]
                span = slice(t, min(t + length, config.windows))
                factor = np.ones((num_layers, num_experts))
                np.put_along_axis(factor, hot, config.burst_factor, axis=1)
                probs[span] *= factor
                probs[span] /= probs[span].sum(axis=2, keepdims=True)
                for i in range(span.start, span.stop):
                    labels[i] += "+burst"
                t += length
            else:
                t += 1
    draws = config.tokens_per_window * config.top_k
    counts = rng.multinomial(draws, probs).astype(np.int64)
    return Trace(counts, config.window_seconds, name or f"{config.kind}-seed{config.seed}", labels)


def deepseek_v3_sources(paths: list[Path] | None = None) -> dict[str, np.ndarray]:
    """The summed DeepSeek-V3 workload files as sources, keyed by workload name."""
    from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3

    files = paths if paths else deepseek_v3_files()
    if not files:
        raise InputError("no DeepSeek-V3 workload files found")
    sources = {}
    for path in map(Path, files):
        if not path.is_file():
            raise InputError(f"{path}: no such file")
        try:
            counts = load_deepseek_v3(path, moe_only=False)
        except RecursionError as exc:
            raise InputError(f"{path}: not a summed counts file (JSON nested too deeply)") from exc
        except (ValueError, KeyError, TypeError, IndexError, OverflowError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise InputError(
                f"{path}: not a summed counts file (logical_count [L, E]): "
                f"{type(exc).__name__}: {reason[:200]}"
            ) from exc
        if counts.ndim != 2:
            raise InputError(
                f"{path}: not a summed counts file: logical_count must be [L, E], got shape "
                f"{list(counts.shape)}"
            )
        sources[path.stem] = counts[counts.sum(axis=1) > 0]  # the MoE layers (load_deepseek_v3)
    return sources
