"""The count file's keys and its plain writer: what a worker's recorder writes
(worker_hooks, `RebalanceHook.write_counts`) and the CLI reads (rebalancer.formats,
`read_counts`), so both sides name the arrays from one place.

`logical_count` is SGLang's [L, E] routed picks per expert (its loaders read only that
key and ignore the rest); the others are optional: `shared_count` [L] tokens through the
shared expert (the recorder's column E), `gpu_count` [L, G] routed picks each GPU
computed and `gpu_shared_count` [L, G] shared-expert tokens each GPU computed (a rank's
own file: those it sent to each GPU; the ranks' files sum to what each GPU computed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

LOGICAL_COUNT = "logical_count"
SHARED_COUNT = "shared_count"
GPU_COUNT = "gpu_count"
GPU_SHARED_COUNT = "gpu_shared_count"
COUNT_KEYS = (LOGICAL_COUNT, SHARED_COUNT, GPU_COUNT, GPU_SHARED_COUNT)
# What `save_count_arrays` writes (`.pt`, SGLang's dump, needs torch: worker_hooks).
COUNT_SUFFIXES_WRITTEN = (".json", ".npz")


def save_count_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write `arrays` (keyed by COUNT_KEYS, already checked) as `.json` (SGLang's summed
    form, plain nested lists) or `.npz`, by `path`'s suffix (one of COUNT_SUFFIXES_WRITTEN)."""
    if path.suffix.lower() == ".json":
        doc = {key: np.asarray(arr).tolist() for key, arr in arrays.items()}
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    else:
        with open(path, "wb") as f:  # a file object: np.savez would add ".npz" to "x.NPZ"
            np.savez(f, **dict(arrays))  # type: ignore[arg-type]
