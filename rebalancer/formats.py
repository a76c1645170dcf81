"""Files the rebalancer reads and writes: expert counts and placements.

Counts arrive in the forms the engines already dump (SGLang's summed JSON and `.pt`
expert-distribution dumps, `.npz`); placements are saved as PLACEMENT.json and can be
exported in the form SGLang's `--init-expert-location` takes. Every malformed file is
refused with an InputError whose one line says what is wrong and where.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rebalancer.errors import InputError

PLACEMENT_FORMAT = "rebalancer.placement/v1"


def _counts_array(raw: object, path: Path, key: str = "logical_count") -> np.ndarray:
    """Validate counts [L, E] or [T, L, E] (summed over T) into float64 [L, E]."""
    try:
        arr = np.asarray(raw)
    except (TypeError, ValueError):
        arr = None
    # Booleans, strings, complex numbers and integers beyond 64 bits (object arrays) are
    # not counts: refuse them rather than let numpy convert them.
    if arr is None or arr.dtype.kind not in "iuf":
        raise InputError(f"{path}: '{key}' is not a numeric array of equal-length rows")
    arr = arr.astype(np.float64)
    if arr.ndim == 3:
        arr = arr.sum(axis=0)
    if arr.ndim != 2:
        raise InputError(
            f"{path}: '{key}' must have rank 2 [layers, experts] or 3 [steps, layers, experts], "
            f"got rank {arr.ndim}"
        )
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"{path}: '{key}' is empty (shape {arr.shape})")
    if not np.isfinite(arr).all():
        raise InputError(f"{path}: '{key}' has NaN or infinite values")
    if (arr < 0).any():
        layer, expert = np.argwhere(arr < 0)[0]
        raise InputError(f"{path}: '{key}' has a negative value at layer {layer}, expert {expert}")
    return arr


def load_counts(path: str | Path) -> np.ndarray:
    """Expert counts from a file: `[L, E]` float64.

    Reads SGLang's summed JSON `{"logical_count": [L][E]}`, SGLang's `.pt` dump
    (`logical_count` [T, L, E] or [L, E], summed over T) and `.npz` with `logical_count`.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _counts_array(_json_object_with(path, "logical_count")["logical_count"], path)
    if suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as data:
                if "logical_count" not in data.files:
                    raise InputError(f"{path}: missing key 'logical_count'")
                raw = data["logical_count"]
        except InputError:
            raise
        except Exception as exc:  # zip, zlib, header, size and pickle errors: a bad file
            # (a bare .npy has no context manager: also "not an .npz file")
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise InputError(f"{path}: not a readable .npz file ({reason})") from None
        return _counts_array(raw, path)
    if suffix in (".pt", ".pth"):
        return _counts_array(_load_torch_counts(path), path)
    raise InputError(f"{path}: unknown counts format '{suffix}' (expected .json, .pt or .npz)")


def _load_torch_counts(path: Path) -> np.ndarray:
    """`logical_count` of an SGLang expert-distribution `.pt` dump (torch imported here
    only, so the controller stays torch-free)."""
    try:
        import torch
    except ImportError:
        raise InputError(f"{path}: reading .pt files needs torch installed") from None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        raise InputError(f"{path}: not a readable torch file ({type(exc).__name__})") from None
    if isinstance(data, dict):
        if "logical_count" not in data:
            raise InputError(f"{path}: missing key 'logical_count'")
        data = data["logical_count"]
    if not isinstance(data, torch.Tensor):
        raise InputError(f"{path}: 'logical_count' is not a tensor")
    if (
        data.layout != torch.strided
        or data.device.type != "cpu"
        or data.is_quantized
        or data.is_complex()
        or data.dtype == torch.bool
    ):
        raise InputError(
            f"{path}: 'logical_count' must be a dense real-valued tensor, got {data.dtype} "
            f"({data.layout}, {data.device.type})"
        )
    try:
        return data.detach().to(torch.float64).numpy()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise InputError(f"{path}: 'logical_count' is not readable as numbers ({type(exc).__name__})") from None


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
    if not path.is_file():
        raise InputError(f"{path}: no such file")
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
        raise InputError(f"{path}: 'phy2log' refers to expert {int(phy2log.max())} of {num_logical}")
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
