"""Fixtures of the simulator tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from rebalancer.datasets import shared_data_dir
from rebalancer.errors import InputError


@pytest.fixture
def mixtral_path() -> Path:
    """The real Mixtral GSM8K routing file; the test skips where the data is absent."""
    try:
        path = shared_data_dir() / "mixtral-8x7b" / "gsm8k_routing.jsonl"
    except InputError:
        pytest.skip("shared routing data not present")
    if not path.is_file():
        pytest.skip("shared routing data not present")
    return path
