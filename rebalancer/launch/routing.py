"""The routing the demo's workers replay: DeepSeek-V3's real per-layer expert loads,
scaled down to the demo's model and drifting across the six published workloads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3
from rebalancer.launch.config import DemoConfig

# Phase order: alternate prefill and decode so the hot experts move.
PHASES = (
    "prefill_in1024",
    "decode_in1000out1000",
    "prefill_in4096",
    "decode_in2000out100",
    "prefill_in500out1500",
    "prefill_in1000out1000",
)


def routing_profiles(config: DemoConfig) -> np.ndarray:
    """Per-phase expert probabilities [phases, L, E] from the DeepSeek-V3 files.

    Small layer l replays real layer round(l * 57 / (L - 1)); its E experts are
    picked at evenly spaced load ranks of that layer (hottest included, so the
    real skew survives the scale-down) and shuffled over the slots."""
    files = {f.stem: f for f in deepseek_v3_files()}
    rng = np.random.default_rng(config.seed)
    real = np.stack([load_deepseek_v3(files[name]).astype(np.float64) for name in PHASES])
    _, num_real_layers, num_real_experts = real.shape
    layers = np.linspace(0, num_real_layers - 1, config.layers).round().astype(int)
    ranks = np.linspace(0, num_real_experts - 1, config.experts).round().astype(int)
    out = np.empty((len(PHASES), config.layers, config.experts))
    for i, layer in enumerate(layers):
        by_load = np.argsort(-real[:, layer].sum(axis=0))
        experts = rng.permutation(by_load[ranks])
        out[:, i] = real[:, layer][:, experts]
    return out / out.sum(axis=2, keepdims=True)


def write_profile(config: DemoConfig, folder: Path) -> Path:
    """The routing profile the workers replay, as an .npz in `folder`."""
    path = folder / "routing.npz"
    np.savez(
        path,
        profiles=routing_profiles(config),
        steps_per_phase=config.windows.steps * config.windows_per_phase,
    )
    return path
