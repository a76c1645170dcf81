"""Shared inputs: real DeepSeek-V3 counts and small random loads."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3

# (slots, gpus, nodes, groups): global and hierarchical on 32 GPUs, 256 GPUs
LAYOUTS = [(288, 32, 4, None), (288, 32, 4, 8), (512, 256, 32, 8)]


@pytest.fixture(scope="session")
def deepseek() -> dict[str, np.ndarray]:
    """Every DeepSeek-V3 workload, all 61 layers (dense layers are zero rows)."""
    return {f.stem: load_deepseek_v3(f, moe_only=False) for f in deepseek_v3_files()}


def random_load(seed: int, layers: int = 6, experts: int = 16, zero_rows: int = 1) -> np.ndarray:
    """Skewed integer load [layers, experts] with some zero rows and zero experts."""
    rng = np.random.default_rng(seed)
    load = np.floor(rng.pareto(1.2, size=(layers, experts)) * 100).astype(np.int64)
    load[:zero_rows] = 0
    return load
