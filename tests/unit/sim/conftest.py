"""Fixtures of the simulator tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from rebalancer.datasets import mixtral_gsm8k_file


@pytest.fixture
def mixtral_path() -> Path:
    """The real Mixtral GSM8K routing file (shipped in rebalancer/data)."""
    return mixtral_gsm8k_file()
