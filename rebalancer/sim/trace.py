"""Traces of windowed expert counts: the input of the simulator.

A trace is a time series of windows, each holding the tokens routed to every (layer,
logical expert) during that window. Operators bring their own routing data in one of the
formats the engines already dump, so this module reads all of them into one `Trace`:
- `.npz` with `logical_count [T, L, E]` (and optionally `window_seconds`), what
  `rebalancer trace make` writes;
- SGLang `.pt` expert-distribution dumps (`logical_count [T, L, E]`; torch is imported
  only for these);
- `.json` with `logical_count` `[L, E]` (one window, e.g. a summed SGLang dump) or `[T, L, E]`;
- a directory of such `.pt` / `.json` / `.npz` files (e.g. one SGLang dump per window),
  concatenated in file-name order;
- per-token `.jsonl` lines `{"problem_id", "token_idx", "layer", "experts": [...]}` (the
  Mixtral GSM8K routing file), grouped in generation order into windows of a chosen
  number of tokens.
Layers that carry no count in the whole trace (dense layers) are dropped on load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rebalancer.errors import InputError

DEFAULT_WINDOW_SECONDS = 5.0


@dataclass
class Trace:
    """Windows of counts `[T, L, E]` (int64) and the nominal wall time of one window."""

    counts: np.ndarray
    window_seconds: float = DEFAULT_WINDOW_SECONDS
    name: str = "trace"
    # Optional per-window labels (e.g. the workload or mix a generated window came from).
    labels: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts)
        if counts.ndim != 3 or min(counts.shape) == 0:
            raise InputError(
                f"{self.name}: logical_count must be [T, L, E] with T, L, E > 0, "
                f"got shape {list(counts.shape)}"
            )
        if not (
            np.issubdtype(counts.dtype, np.integer) or np.issubdtype(counts.dtype, np.floating)
        ):
            raise InputError(f"{self.name}: logical_count must be numeric, got {counts.dtype}")
        if np.issubdtype(counts.dtype, np.floating):
            if not np.all(np.isfinite(counts)):
                raise InputError(f"{self.name}: logical_count holds NaN or infinity")
            if np.any(counts != np.round(counts)):
                raise InputError(f"{self.name}: logical_count must hold whole token counts")
        if np.any(counts < 0):
            raise InputError(f"{self.name}: logical_count holds negative counts")
        if not counts.any():
            raise InputError(f"{self.name}: logical_count is all zero")
        if not (np.isfinite(self.window_seconds) and self.window_seconds > 0):
            raise InputError(f"{self.name}: window_seconds must be > 0, got {self.window_seconds}")
        self.counts = counts.astype(np.int64)
        self.window_seconds = float(self.window_seconds)

    @property
    def num_windows(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.counts.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[2])

    def without_empty_layers(self) -> Trace:
        """The same trace without layers that never carry a count (dense layers)."""
        live = self.counts.sum(axis=(0, 2)) > 0
        if live.all():
            return self
        return Trace(self.counts[:, live, :], self.window_seconds, self.name, list(self.labels))

    def save(self, path: str | Path) -> None:
        """Write as `.npz` (logical_count, window_seconds, labels)."""
        np.savez_compressed(
            Path(path),
            logical_count=self.counts,
            window_seconds=np.float64(self.window_seconds),
            labels=np.asarray(self.labels, dtype=str),
        )


def _from_array(
    arr: object, path: Path, window_seconds: float | None, labels: list[str] | None = None
) -> Trace:
    counts = np.asarray(arr)
    if counts.ndim == 2:
        counts = counts[None]
    return Trace(
        counts,
        window_seconds if window_seconds is not None else DEFAULT_WINDOW_SECONDS,
        path.stem,
        labels or [],
    )


def _load_npz(path: Path, window_seconds: float | None) -> Trace:
    try:
        with np.load(path, allow_pickle=False) as data:
            if "logical_count" not in data.files:
                raise InputError(f"{path}: no 'logical_count' array (has {sorted(data.files)})")
            counts = data["logical_count"]
            if window_seconds is None and "window_seconds" in data.files:
                window_seconds = float(np.asarray(data["window_seconds"]).reshape(-1)[0])
            labels = [str(x) for x in data["labels"]] if "labels" in data.files else []
    except InputError:
        raise
    except Exception as exc:  # zip, pickle or header errors all mean a bad file
        raise InputError(f"{path}: not a readable .npz trace ({exc})") from exc
    if labels and len(labels) != np.asarray(counts).shape[0]:
        labels = []
    return _from_array(counts, path, window_seconds, labels)


def _load_pt(path: Path, window_seconds: float | None) -> Trace:
    try:
        import torch  # only SGLang dumps need torch
    except ImportError as exc:
        raise InputError(f"{path}: reading .pt dumps needs torch (pip install torch)") from exc
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise InputError(f"{path}: not a readable torch file ({exc})") from exc
    if isinstance(obj, dict):
        if "logical_count" not in obj:
            raise InputError(f"{path}: no 'logical_count' key (has {sorted(map(str, obj))})")
        counts = obj["logical_count"]
    else:
        counts = obj
    if hasattr(counts, "cpu"):
        counts = counts.cpu().numpy()
    return _from_array(counts, path, window_seconds)


def _load_json(path: Path, window_seconds: float | None) -> Trace:
    try:
        obj = json.loads(path.read_text())
        counts = np.asarray(obj["logical_count"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: not a JSON object with 'logical_count' ({exc})") from exc
    if counts.dtype == object:
        raise InputError(f"{path}: logical_count is ragged")
    if window_seconds is None and isinstance(obj.get("window_seconds"), (int, float)):
        window_seconds = float(obj["window_seconds"])
    return _from_array(counts, path, window_seconds)


def _load_jsonl(
    path: Path, tokens_per_window: int, window_seconds: float | None, num_experts: int | None
) -> Trace:
    """Per-(token, layer) routing lines grouped into windows of consecutive tokens."""
    if tokens_per_window <= 0:
        raise InputError(f"tokens per window must be > 0, got {tokens_per_window}")
    token_index: dict[tuple[object, object], int] = {}
    rows: list[tuple[int, int, int]] = []  # (token ordinal, layer, expert)
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = (rec.get("problem_id"), rec["token_idx"])
                layer = int(rec["layer"])
                experts = [int(e) for e in rec["experts"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise InputError(f"{path}:{lineno}: not a routing record ({exc})") from exc
            if layer < 0 or any(e < 0 for e in experts):
                raise InputError(f"{path}:{lineno}: negative layer or expert id")
            # Tokens are numbered in the order they first appear: generation order.
            ordinal = token_index.setdefault(key, len(token_index))
            rows.extend((ordinal, layer, e) for e in experts)
    if not rows:
        raise InputError(f"{path}: no routing records")
    table = np.asarray(rows, dtype=np.int64)
    num_layers = int(table[:, 1].max()) + 1
    experts_seen = int(table[:, 2].max()) + 1
    num_experts = num_experts or experts_seen
    if experts_seen > num_experts:
        raise InputError(f"{path}: expert id {experts_seen - 1} >= num_experts {num_experts}")
    num_windows = -(-len(token_index) // tokens_per_window)
    counts = np.zeros((num_windows, num_layers, num_experts), dtype=np.int64)
    np.add.at(counts, (table[:, 0] // tokens_per_window, table[:, 1], table[:, 2]), 1)
    return Trace(
        counts,
        window_seconds if window_seconds is not None else DEFAULT_WINDOW_SECONDS,
        path.stem,
    )


def _load_dir(path: Path, window_seconds: float | None, drop_empty_layers: bool) -> Trace:
    """Dumps in a directory, one or more windows each, in file-name order."""
    files = sorted(
        f
        for f in path.iterdir()
        if f.is_file() and f.suffix.lower() in (".pt", ".pth", ".json", ".npz")
    )
    if not files:
        raise InputError(f"{path}: no .pt, .json or .npz dumps in the directory")
    parts = [load_trace(f, window_seconds=window_seconds, drop_empty_layers=False) for f in files]
    shapes = {p.counts.shape[1:] for p in parts}
    if len(shapes) != 1:
        raise InputError(f"{path}: dumps disagree on [L, E]: {sorted(shapes)}")
    trace = Trace(
        np.concatenate([p.counts for p in parts]),
        window_seconds if window_seconds is not None else parts[0].window_seconds,
        path.name,
    )
    return trace.without_empty_layers() if drop_empty_layers else trace


def load_trace(
    path: str | Path,
    tokens_per_window: int = 8,
    window_seconds: float | None = None,
    num_experts: int | None = None,
    drop_empty_layers: bool = True,
) -> Trace:
    """Read a trace file in any supported format (see the module docstring).

    `tokens_per_window` and `num_experts` apply to per-token `.jsonl` only;
    `window_seconds` overrides what the file says (default 5 s when it says nothing).
    """
    path = Path(path)
    if path.is_dir():
        return _load_dir(path, window_seconds, drop_empty_layers)
    if not path.is_file():
        raise InputError(f"{path}: no such trace file")
    if window_seconds is not None and not (np.isfinite(window_seconds) and window_seconds > 0):
        raise InputError(f"window seconds must be > 0, got {window_seconds}")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        trace = _load_npz(path, window_seconds)
    elif suffix in (".pt", ".pth"):
        trace = _load_pt(path, window_seconds)
    elif suffix == ".json":
        trace = _load_json(path, window_seconds)
    elif suffix == ".jsonl":
        trace = _load_jsonl(path, tokens_per_window, window_seconds, num_experts)
    else:
        raise InputError(f"{path}: unknown trace format {suffix!r} (.npz, .pt, .json, .jsonl)")
    return trace.without_empty_layers() if drop_empty_layers else trace
