"""Where the real routing data lives, and small loaders for it.

The project ships its routing data as package data in `rebalancer/data` (unmodified
copies of public files; see rebalancer/data/README.md), so a checkout or an installed
wheel works with nothing beside it. Set REBALANCER_DATA to a folder with the same layout
(`deepseek-v3/*.json`, `mixtral-8x7b/gsm8k_routing.jsonl`) to read another or larger set;
an empty value counts as unset.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from rebalancer.errors import InputError

PACKAGED_DATA = Path(__file__).resolve().parent / "data"


def shared_data_dir() -> Path:
    """The folder holding deepseek-v3/ and mixtral-8x7b/: REBALANCER_DATA, else rebalancer/data."""
    env = os.environ.get("REBALANCER_DATA")
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise InputError(f"REBALANCER_DATA={env} is not a folder")
        return path
    if not PACKAGED_DATA.is_dir():
        raise InputError(
            f"packaged routing data missing at {PACKAGED_DATA} (reinstall, or set REBALANCER_DATA)"
        )
    return PACKAGED_DATA


def deepseek_v3_files() -> list[Path]:
    """The DeepSeek-V3 workload files, sorted by name."""
    folder = shared_data_dir() / "deepseek-v3"
    files = sorted(folder.glob("*.json"))
    if not files:
        raise InputError(f"no DeepSeek-V3 routing files (*.json) in {folder}")
    return files


def mixtral_gsm8k_file() -> Path:
    """The Mixtral-8x7B GSM8K per-token routing trace (JSON lines)."""
    path = shared_data_dir() / "mixtral-8x7b" / "gsm8k_routing.jsonl"
    if not path.is_file():
        raise InputError(f"Mixtral routing trace not found at {path}")
    return path


def load_deepseek_v3(path: Path, moe_only: bool = True) -> np.ndarray:
    """Counts of one workload file: `[L, 256]` int64 (58 MoE layers when moe_only)."""
    counts = np.asarray(json.loads(Path(path).read_text())["logical_count"], dtype=np.int64)
    if moe_only:
        counts = counts[counts.sum(axis=1) > 0]
    return counts
