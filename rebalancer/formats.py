"""Files the rebalancer reads and writes: expert counts and placements.

Counts arrive in the forms the engines already dump (SGLang's summed JSON and `.pt`
expert-distribution dumps, `.npz`, vLLM's EPLB load window saved with torch); placements are saved
as PLACEMENT.json and can be exported in the form SGLang's `--init-expert-location` takes. Every
malformed file is refused with an InputError whose one line says what is wrong and where.

A count file may also carry what the worker's recorder counts beside SGLang's routed
`logical_count`: the shared expert's tokens per layer and what each GPU computed
(`CountFile`). They sit under keys of their own, so SGLang's loaders, which read only
`logical_count`, still take the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rebalancer.errors import InputError
from rebalancer.wire.codec import MAX_COUNT
from rebalancer.wire.countfile import (
    COUNT_KEYS,
    COUNT_SUFFIXES_WRITTEN,
    GPU_COUNT,
    GPU_SHARED_COUNT,
    LOGICAL_COUNT,
    SHARED_COUNT,
    save_count_arrays,
)

PLACEMENT_FORMAT = "rebalancer.placement/v1"

# Each key's axes (singular), after an optional leading steps axis that is summed over
# (SGLang's `.pt` dumps hold [T, L, E]).
_COUNT_AXES = {
    LOGICAL_COUNT: ("layer", "expert"),
    SHARED_COUNT: ("layer",),
    GPU_COUNT: ("layer", "GPU"),
    GPU_SHARED_COUNT: ("layer", "GPU"),
}


def _counts_array(raw: object, path: Path, key: str = LOGICAL_COUNT) -> np.ndarray:
    """Validate `key`'s counts (its axes, or [T, *axes] summed over T) into float64."""
    axes = _COUNT_AXES[key]
    try:
        arr = np.asarray(raw)
    except (TypeError, ValueError):
        arr = None
    # Booleans, strings, complex numbers and integers beyond 64 bits (object arrays) are
    # not counts: refuse them rather than let numpy convert them.
    if arr is None or arr.dtype.kind not in "iuf":
        rows = " of equal-length rows" if len(axes) > 1 else ""
        raise InputError(f"{path}: '{key}' is not a numeric array{rows}")
    arr = arr.astype(np.float64)
    if arr.size and np.isfinite(arr).all() and arr.max() > MAX_COUNT:
        where = ", ".join(str(i) for i in np.unravel_index(int(arr.argmax()), arr.shape))
        raise InputError(
            f"{path}: '{key}' has {arr.max():.4g} at [{where}], above the largest count 2^53"
        )
    if arr.ndim == len(axes) + 1:
        arr = arr.sum(axis=0)
    if arr.ndim != len(axes):
        names = ", ".join(f"{axis}s" for axis in axes)
        raise InputError(
            f"{path}: '{key}' must have rank {len(axes)} [{names}] or {len(axes) + 1} "
            f"[steps, {names}], got rank {arr.ndim}"
        )
    if 0 in arr.shape:
        raise InputError(f"{path}: '{key}' is empty (shape {arr.shape})")
    if not np.isfinite(arr).all():
        raise InputError(f"{path}: '{key}' has NaN or infinite values")
    if (arr < 0).any():
        first = np.argwhere(arr < 0)[0]
        where = ", ".join(f"{axis} {i}" for axis, i in zip(axes, first, strict=True))
        raise InputError(f"{path}: '{key}' has a negative value at {where}")
    return arr


@dataclass(frozen=True)
class CountFile:
    """A count file's arrays, float64, summed over any steps axis.

    logical: [L, E] routed picks per expert (SGLang's `logical_count`); shared: [L] tokens
    through the shared expert, or None; gpu: [L, G] routed picks each GPU computed, or
    None; gpu_shared: [L, G] shared-expert tokens each GPU computed, or None.
    """

    logical: np.ndarray
    shared: np.ndarray | None = None
    gpu: np.ndarray | None = None
    gpu_shared: np.ndarray | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays present, by their key in the file (COUNT_KEYS order)."""
        values = (self.logical, self.shared, self.gpu, self.gpu_shared)
        return {key: arr for key, arr in zip(COUNT_KEYS, values, strict=True) if arr is not None}


def _count_file(raw: Mapping[str, object], path: Path) -> CountFile:
    """Validate the arrays of `raw` (COUNT_KEYS present, LOGICAL_COUNT among them) and
    check that their layers (and GPUs) agree."""
    arrays = {key: _counts_array(raw[key], path, key) for key in COUNT_KEYS if key in raw}
    layers = arrays[LOGICAL_COUNT].shape[0]
    for key, arr in arrays.items():
        if arr.shape[0] != layers:
            raise InputError(
                f"{path}: '{key}' covers {arr.shape[0]} layers, '{LOGICAL_COUNT}' {layers}"
            )
    if GPU_COUNT in arrays and GPU_SHARED_COUNT in arrays:
        gpus, shared_gpus = arrays[GPU_COUNT].shape[1], arrays[GPU_SHARED_COUNT].shape[1]
        if gpus != shared_gpus:
            raise InputError(
                f"{path}: '{GPU_SHARED_COUNT}' has {shared_gpus} GPUs, '{GPU_COUNT}' {gpus}"
            )
    return CountFile(
        arrays[LOGICAL_COUNT],
        arrays.get(SHARED_COUNT),
        arrays.get(GPU_COUNT),
        arrays.get(GPU_SHARED_COUNT),
    )


def _check_file(path: Path) -> None:
    """InputError unless `path` is a file that exists (a folder is named as one)."""
    if path.is_dir():
        raise InputError(f"{path}: is a folder, not a file")
    if not path.is_file():
        raise InputError(f"{path}: no such file")


def read_counts(path: str | Path) -> CountFile:
    """A count file: SGLang's summed JSON `{"logical_count": [L][E]}`, SGLang's `.pt` dump
    (`logical_count` [T, L, E] or [L, E], summed over T) or `.npz`, each optionally with
    `shared_count` [L], `gpu_count` [L, G] and `gpu_shared_count` [L, G] (any of them
    with a leading [T] axis, summed, like `logical_count`)."""
    path = Path(path)
    _check_file(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        data = _json_object_with(path, LOGICAL_COUNT)
        return _count_file({key: data[key] for key in COUNT_KEYS if key in data}, path)
    if suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as data:
                if LOGICAL_COUNT not in data.files:
                    raise InputError(f"{path}: missing key '{LOGICAL_COUNT}'")
                raw = {key: data[key] for key in COUNT_KEYS if key in data.files}
        except InputError:
            raise
        except Exception as exc:  # zip, zlib, header, size and pickle errors: a bad file
            # (a bare .npy has no context manager: also "not an .npz file")
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise InputError(f"{path}: not a readable .npz file ({reason})") from None
        return _count_file(raw, path)
    if suffix in (".pt", ".pth"):
        return _count_file(_load_torch_counts(path), path)
    raise InputError(f"{path}: unknown counts format '{suffix}' (expected .json, .pt or .npz)")


def load_counts(path: str | Path) -> np.ndarray:
    """Expert counts from a file: `[L, E]` float64 (`read_counts(path).logical`)."""
    return read_counts(path).logical


def write_counts(
    path: str | Path,
    logical: np.ndarray,
    shared: np.ndarray | None = None,
    gpu: np.ndarray | None = None,
    gpu_shared: np.ndarray | None = None,
) -> None:
    """Write a count file `read_counts` reads back: `.json` (SGLang's summed form
    `{"logical_count": [L][E]}` plus the keys given) or `.npz`.

    logical: [L, E]; shared: [L]; gpu, gpu_shared: [L, G] (each may have a leading [T]
    axis, written summed). Whole numbers are written as integers, as SGLang writes them.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in COUNT_SUFFIXES_WRITTEN:
        raise InputError(
            f"{path}: cannot write counts as '{suffix}' "
            f"(expected {' or '.join(COUNT_SUFFIXES_WRITTEN)})"
        )
    # Checked as they would be read: a file written here is one read_counts takes.
    given = CountFile(logical, shared, gpu, gpu_shared).arrays()
    arrays: dict[str, Any] = {
        key: _whole_if_whole(arr) for key, arr in _count_file(given, path).arrays().items()
    }
    save_count_arrays(path, arrays)


def _whole_if_whole(arr: np.ndarray) -> np.ndarray:
    """int64 when every value is a whole number int64 holds exactly, else float64."""
    if (arr == np.rint(arr)).all() and arr.max() < 2.0**53:
        return arr.astype(np.int64)
    return arr


# vLLM has no load dump of its own: its EPLB window saved with torch
# (worker_hooks.engines.vllm.save_load_dump) holds vLLM's two tensors under their names.
VLLM_WINDOW = "expert_load_window"  # [W, L, P] or [L, P] tokens per physical slot
VLLM_MAP = "physical_to_logical_map"  # [L, P] the logical expert of each slot
VLLM_NUM_LOGICAL = "num_logical_experts"


def _vllm_logical_counts(data: Mapping[str, Any], path: Path) -> np.ndarray:
    """`[L, E]` from a vLLM window: each slot's tokens go to the expert it held."""
    import torch

    window, phy2log = data.get(VLLM_WINDOW), data.get(VLLM_MAP)
    if not isinstance(window, torch.Tensor) or not isinstance(phy2log, torch.Tensor):
        raise InputError(f"{path}: a vLLM dump needs tensors '{VLLM_WINDOW}' and '{VLLM_MAP}'")
    counts = window.detach().to(torch.float64).numpy()
    mapping = phy2log.detach().to(torch.int64).numpy()
    if counts.ndim == 3:
        counts = counts.sum(axis=0)
    if mapping.ndim != 2 or counts.shape != mapping.shape:
        raise InputError(
            f"{path}: '{VLLM_WINDOW}' {list(window.shape)} does not fit "
            f"'{VLLM_MAP}' {list(phy2log.shape)} ([W, L, P] or [L, P] against [L, P])"
        )
    num_logical = int(data.get(VLLM_NUM_LOGICAL, int(mapping.max(initial=-1)) + 1))
    if mapping.size and (mapping.min() < 0 or mapping.max() >= num_logical):
        raise InputError(f"{path}: '{VLLM_MAP}' holds experts outside 0..{num_logical - 1}")
    logical = np.zeros((mapping.shape[0], num_logical), dtype=np.float64)
    for layer in range(mapping.shape[0]):
        np.add.at(logical[layer], mapping[layer], counts[layer])
    return logical


def _load_torch_counts(path: Path) -> dict[str, np.ndarray]:
    """The count arrays of an SGLang expert-distribution `.pt` dump, or of one with the
    extra keys of `read_counts` (torch imported here only, so the controller stays
    torch-free). A bare tensor is `logical_count`; other keys (SGLang's `rank`, ...) are
    ignored."""
    try:
        import torch
    except ImportError:
        raise InputError(f"{path}: reading .pt files needs torch installed") from None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        raise InputError(f"{path}: not a readable torch file ({type(exc).__name__})") from None
    if isinstance(data, dict) and LOGICAL_COUNT not in data and VLLM_WINDOW in data:
        return {LOGICAL_COUNT: _vllm_logical_counts(data, path)}
    if isinstance(data, dict):
        if LOGICAL_COUNT not in data:
            raise InputError(f"{path}: missing key '{LOGICAL_COUNT}'")
        tensors = {key: data[key] for key in COUNT_KEYS if key in data}
    else:
        tensors = {LOGICAL_COUNT: data}
    out = {}
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise InputError(f"{path}: '{key}' is not a tensor")
        if (
            tensor.layout != torch.strided
            or tensor.device.type != "cpu"
            or tensor.is_quantized
            or tensor.is_complex()
            or tensor.dtype == torch.bool
        ):
            raise InputError(
                f"{path}: '{key}' must be a dense real-valued tensor, got {tensor.dtype} "
                f"({tensor.layout}, {tensor.device.type})"
            )
        try:
            out[key] = tensor.detach().to(torch.float64).numpy()
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            raise InputError(
                f"{path}: '{key}' is not readable as numbers ({type(exc).__name__})"
            ) from None
    return out


@dataclass(frozen=True)
class PlacementFile:
    """A saved placement: phy2log [L, P] int64 and its layout."""

    phy2log: np.ndarray
    num_gpus: int
    num_nodes: int
    num_logical: int
    version: int | None = None


def _positive_int(data: dict, key: str, path: Path, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise InputError(f"{path}: missing key '{key}'")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{path}: '{key}' must be a positive integer, got {value!r}")
    return value


def _json_object_with(path: Path, key: str) -> dict[str, Any]:
    """The JSON object in `path`; InputError unless it parses and has `key`."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise InputError(f"{path}: JSON nested too deeply") from None
    if not isinstance(data, dict) or key not in data:
        raise InputError(f"{path}: missing key {key!r}")
    return data


def read_placement(path: str | Path) -> PlacementFile:
    """Read PLACEMENT.json (see `write_placement`), checking it is a valid placement."""
    path = Path(path)
    _check_file(path)
    data = _json_object_with(path, "phy2log")
    num_gpus = _positive_int(data, "num_gpus", path)
    num_nodes = _positive_int(data, "num_nodes", path, 1)
    try:
        phy2log = np.asarray(data["phy2log"])
    except (TypeError, ValueError):
        phy2log = None
    # Only JSON integers (numpy would truncate 1.7 to 1 and take true for 1; integers
    # beyond 64 bits make an object array).
    if phy2log is None or (phy2log.size and phy2log.dtype.kind not in "iu"):
        raise InputError(f"{path}: 'phy2log' is not an integer array of equal-length rows")
    if phy2log.ndim != 2 or phy2log.size == 0:
        raise InputError(f"{path}: 'phy2log' must have rank 2 [layers, slots], got {phy2log.shape}")
    if (phy2log < 0).any():
        raise InputError(f"{path}: 'phy2log' has a negative expert index")
    if phy2log.max() > np.iinfo(np.int64).max:  # uint64 beyond int64
        raise InputError(f"{path}: 'phy2log' refers to expert {int(phy2log.max())}")
    phy2log = phy2log.astype(np.int64)
    num_logical = _positive_int(data, "num_logical", path, int(phy2log.max()) + 1)
    if num_logical > phy2log.shape[1]:
        # every expert needs a slot in every layer (this also bounds the count below)
        if "num_logical" not in data:
            raise InputError(
                f"{path}: 'phy2log' refers to expert {int(phy2log.max())} but has only "
                f"{phy2log.shape[1]} slots per layer"
            )
        raise InputError(
            f"{path}: {num_logical} experts do not fit in {phy2log.shape[1]} slots per layer"
        )
    if phy2log.shape[1] % num_gpus:
        raise InputError(f"{path}: {phy2log.shape[1]} slots do not divide over {num_gpus} GPUs")
    if num_gpus % num_nodes:
        raise InputError(f"{path}: {num_gpus} GPUs do not divide over {num_nodes} nodes")
    if phy2log.max() >= num_logical:
        raise InputError(
            f"{path}: 'phy2log' refers to expert {int(phy2log.max())} of {num_logical}"
        )
    offsets = np.arange(phy2log.shape[0])[:, None] * num_logical
    seen = np.bincount((phy2log + offsets).ravel(), minlength=phy2log.shape[0] * num_logical)
    missing = np.argwhere(seen.reshape(phy2log.shape[0], num_logical) == 0)
    if len(missing):
        raise InputError(f"{path}: layer {missing[0][0]} has no replica of expert {missing[0][1]}")
    version = data.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise InputError(f"{path}: 'version' must be an integer, got {version!r}")
    return PlacementFile(phy2log, num_gpus, num_nodes, num_logical, version)


def placement_document(
    phy2log: np.ndarray,
    num_gpus: int,
    num_nodes: int = 1,
    num_logical: int | None = None,
    version: int | None = None,
) -> dict:
    """The JSON object of PLACEMENT.json."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    doc: dict = {
        "format": PLACEMENT_FORMAT,
        "num_gpus": int(num_gpus),
        "num_nodes": int(num_nodes),
        "num_logical": int(num_logical if num_logical is not None else phy2log.max() + 1),
        "phy2log": phy2log.tolist(),
    }
    if version is not None:
        doc["version"] = int(version)
    return doc


def write_placement(
    path: str | Path,
    phy2log: np.ndarray,
    num_gpus: int,
    num_nodes: int = 1,
    num_logical: int | None = None,
    version: int | None = None,
) -> None:
    """Write PLACEMENT.json: {"format", "num_gpus", "num_nodes", "num_logical",
    "phy2log": [L][P], "version"?}."""
    doc = placement_document(phy2log, num_gpus, num_nodes, num_logical, version)
    Path(path).write_text(json.dumps(doc, separators=(",", ":")) + "\n")


def write_sglang_expert_location(path: str | Path, phy2log: np.ndarray) -> None:
    """Write a file SGLang's `--init-expert-location` accepts:
    {"physical_to_logical_map": [L][P]} (all model layers, dense ones included)."""
    doc = {"physical_to_logical_map": np.asarray(phy2log, dtype=np.int64).tolist()}
    Path(path).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
