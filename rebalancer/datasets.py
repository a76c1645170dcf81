"""Where the real routing data lives, and small loaders for it.

The project never ships routing data; it reads the public files under
`../shared/data` beside the checkout (override with REBALANCER_DATA).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from rebalancer.errors import InputError

_REPO = Path(__file__).resolve().parent.parent


def shared_data_dir() -> Path:
    """The folder holding deepseek-v3/ and mixtral-8x7b/."""
    env = os.environ.get("REBALANCER_DATA")
    path = Path(env) if env else _REPO.parent / "shared" / "data"
    if not (path / "deepseek-v3").is_dir():
        raise InputError(f"routing data not found at {path} (set REBALANCER_DATA)")
    return path


def deepseek_v3_files() -> list[Path]:
    """The DeepSeek-V3 workload files, sorted by name."""
    return sorted((shared_data_dir() / "deepseek-v3").glob("*.json"))


def load_deepseek_v3(path: Path, moe_only: bool = True) -> np.ndarray:
    """Counts of one workload file: `[L, 256]` int64 (58 MoE layers when moe_only)."""
    counts = np.asarray(json.loads(Path(path).read_text())["logical_count"], dtype=np.int64)
    if moe_only:
        counts = counts[counts.sum(axis=1) > 0]
    return counts
