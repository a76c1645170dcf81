"""A rank's recorded totals and its count files: free functions, off the hot path.

The hook sums each window it hands to the agent (`add_window`) and, on demand, writes
what it summed to a count file (`write_count_file`, keys in rebalancer.wire.countfile).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rebalancer.errors import InputError
from rebalancer.wire.countfile import (
    COUNT_SUFFIXES_WRITTEN,
    GPU_COUNT,
    GPU_SHARED_COUNT,
    LOGICAL_COUNT,
    SHARED_COUNT,
    save_count_arrays,
)
from worker_hooks.config import HookConfig
from worker_hooks.serving import HookStats


def add_window(
    stats: HookStats, config: HookConfig, logical: np.ndarray, physical: np.ndarray | None
) -> None:
    """Add one window to the totals: logical [L, X] and, counted by row, physical
    [L, G * rows_per_rank (+ G shared)], summed per GPU into [L, G (+ G shared)]."""
    stats.logical_total = (
        logical.copy() if stats.logical_total is None else stats.logical_total + logical
    )
    if physical is None:
        return
    num_rows = config.num_rows
    rows = physical[:, :num_rows].reshape(
        config.shape.num_layers, config.shape.num_gpus, config.rows_per_rank
    )
    per_gpu = np.concatenate([rows.sum(axis=2), physical[:, num_rows:]], axis=1)
    stats.gpu_total = per_gpu if stats.gpu_total is None else stats.gpu_total + per_gpu


def count_arrays(config: HookConfig, stats: HookStats) -> dict[str, np.ndarray]:
    """What a rank recorded so far, by count-file key, int64 (zeros before any window).

    `logical_count` [L, E] routed picks per expert; with `shared_expert`, `shared_count`
    [L] tokens through the shared expert; with `windows.record_physical`, `gpu_count`
    [L, G] routed picks this rank sent to each GPU and, with `shared_expert`,
    `gpu_shared_count` [L, G] its shared-expert tokens computed on each GPU."""
    shared = 1 if config.shared_expert else 0
    G = config.shape.num_gpus
    logical = stats.logical_total
    if logical is None:  # no window closed yet: nothing recorded so far
        logical = np.zeros(
            (config.shape.num_layers, config.shape.num_logical + shared), dtype=np.int64
        )
    arrays = {LOGICAL_COUNT: logical[:, : config.shape.num_logical]}
    if config.shared_expert:
        arrays[SHARED_COUNT] = logical[:, config.shape.num_logical]
    if config.windows.record_physical:
        per_gpu = stats.gpu_total  # [L, G] routed, then [L, G] shared (add_window)
        if per_gpu is None:
            per_gpu = np.zeros((config.shape.num_layers, G * (1 + shared)), dtype=np.int64)
        arrays[GPU_COUNT] = per_gpu[:, :G]
        if config.shared_expert:
            arrays[GPU_SHARED_COUNT] = per_gpu[:, G:]
    return {key: np.ascontiguousarray(a, dtype=np.int64) for key, a in arrays.items()}


def write_count_file(path: str | Path, arrays: dict[str, np.ndarray], rank: int) -> None:
    """Write `arrays` (count_arrays) to `path`: `.json`, `.npz` or `.pt` (InputError for
    another suffix, before anything is written). `.pt` is SGLang's dump layout: a dict of
    tensors with a leading steps axis of 1 (`logical_count` [1, L, E]) and `rank`."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (*COUNT_SUFFIXES_WRITTEN, ".pt", ".pth"):
        raise InputError(f"{path}: cannot write counts as '{suffix}' (expected .json, .npz or .pt)")
    if suffix in (".pt", ".pth"):
        dump: dict[str, object] = {"rank": rank}
        dump.update({key: torch.from_numpy(arr)[None] for key, arr in arrays.items()})
        torch.save(dump, path)
    else:
        save_count_arrays(path, arrays)
