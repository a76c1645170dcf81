"""Fixtures of the simulator tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rebalancer.datasets import mixtral_gsm8k_file
from rebalancer.errors import InputError
from rebalancer.sim import deepseek_v3_sources


@pytest.fixture
def mixtral_path() -> Path:
    """The real Mixtral GSM8K routing file (shipped in rebalancer/data)."""
    return mixtral_gsm8k_file()


@pytest.fixture(scope="session")
def sources() -> dict[str, np.ndarray]:
    """Four real DeepSeek-V3 MoE layers of every workload: the real routing skew, fast."""
    try:
        full = deepseek_v3_sources()
    except InputError:
        pytest.skip("shared routing data not present")
    return {name: counts[10:14] for name, counts in full.items()}
