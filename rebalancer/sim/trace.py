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

Every bad file is refused with a one-line InputError, never another exception. Limits:
counts are whole numbers that fit int64 and together total at most 2**62 (so no sum of
them wraps); `window_seconds` is a number in (0, 1e6] (`MAX_WINDOW_SECONDS`); in `.jsonl`
the layer and expert ids are JSON integers in [0, 2**20) (`MAX_JSONL_ID`) and the dense
`[T, L, E]` they expand into holds at most 2**27 counts (`MAX_TRACE_CELLS`, 1 GiB), checked
before anything is allocated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rebalancer.controller.cost import MAX_WINDOW_SECONDS, check_window_seconds
from rebalancer.errors import InputError

DEFAULT_WINDOW_SECONDS = 5.0
# Largest count total of a trace: every sum of its counts fits int64.
MAX_TOTAL_COUNT = 2**62
# Per-token .jsonl: layer and expert ids are below this (experts and layers <= 2**20)...
MAX_JSONL_ID = 2**20
# ...and the dense [T, L, E] counts they expand into hold at most this many (1 GiB).
MAX_TRACE_CELLS = 2**27

__all__ = [
    "DEFAULT_WINDOW_SECONDS",
    "MAX_JSONL_ID",
    "MAX_TOTAL_COUNT",
    "MAX_TRACE_CELLS",
    "MAX_WINDOW_SECONDS",
    "Trace",
    "load_trace",
]


def _brief(value: object, limit: int = 40) -> str:
    """A value from a file as JSON writes it (else its repr), cut to `limit` characters;
    one line, since both escape line breaks."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message on one line; torch's weights-only refusal reduced to its
    reason (the rest is advice to load the file unsafely)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].split(" Check the documentation")[0].strip()
        text = f"weights-only unpickler: {reason or 'refused'}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        # Before the cast to int64, which would wrap larger counts negative.
        if np.issubdtype(counts.dtype, np.floating):
            beyond = bool(counts.max() >= 2.0**63)
        else:
            beyond = bool(counts.max() > np.iinfo(np.int64).max)
        if beyond:
            raise InputError(
                f"{self.name}: logical_count holds a count of {counts.max():.4g} tokens, beyond "
                "the int64 range (at most 2**63 - 1)"
            )
        total = float(counts.sum(dtype=np.float64))
        if total > MAX_TOTAL_COUNT:
            raise InputError(
                f"{self.name}: logical_count totals {total:.4g} tokens, more than 2**62 (too "
                "large: sums of the counts would overflow int64)"
            )
        if not counts.any():
            raise InputError(f"{self.name}: logical_count is all zero")
        self.window_seconds = check_window_seconds(
            self.window_seconds, f"{self.name}: window_seconds"
        )
        self.counts = counts.astype(np.int64)

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


def _as_counts(value: object, path: Path) -> np.ndarray:
    """A counts array from what a file held (nested lists, a numpy array), or InputError."""
    try:
        counts = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged nested lists
        raise InputError(
            f"{path}: logical_count is not an array of one shape ({_one_line(exc)})"
        ) from exc
    if counts.dtype == object:
        # numpy keeps objects for what is not a plain number: null, text beside numbers,
        # objects, or integers beyond uint64
        for item in counts.ravel():
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                raise InputError(f"{path}: logical_count holds a non-number: {_brief(item)}")
        raise InputError(
            f"{path}: logical_count holds a count beyond the int64 range (at most 2**63 - 1)"
        )
    return counts


def _from_array(
    arr: object, path: Path, window_seconds: float | None, labels: list[str] | None = None
) -> Trace:
    counts = _as_counts(arr, path)
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
                seconds = np.asarray(data["window_seconds"]).reshape(-1)
                if seconds.size != 1 or seconds.dtype.kind not in "iuf":
                    raise InputError(
                        f"{path}: window_seconds must be one number, got {seconds.size} of "
                        f"dtype {seconds.dtype}"
                    )
                window_seconds = check_window_seconds(seconds[0], f"{path}: window_seconds")
            labels = [str(x) for x in data["labels"]] if "labels" in data.files else []
    except InputError:
        raise
    except Exception as exc:  # zip, pickle or header errors all mean a bad file
        raise InputError(f"{path}: not a readable .npz trace ({_one_line(exc)})") from exc
    if labels and (np.ndim(counts) == 0 or len(labels) != np.shape(counts)[0]):
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
        raise InputError(f"{path}: not a readable torch file ({_one_line(exc)})") from exc
    if isinstance(obj, dict):
        if "logical_count" not in obj:
            raise InputError(
                f"{path}: no 'logical_count' key (has {_brief(sorted(map(str, obj)), 200)})"
            )
        counts = obj["logical_count"]
    else:
        counts = obj
    if isinstance(counts, torch.Tensor):
        if counts.layout != torch.strided:
            raise InputError(
                f"{path}: logical_count is a {str(counts.layout).removeprefix('torch.')} tensor; "
                "expected a dense one"
            )
        if counts.device.type == "meta":
            raise InputError(f"{path}: logical_count is a meta tensor (it holds no data)")
        try:
            counts = counts.detach().cpu().numpy()
        except Exception as exc:  # dtypes numpy lacks (bfloat16), quantized tensors
            raise InputError(
                f"{path}: logical_count tensor of dtype {counts.dtype} is not readable as "
                f"counts ({_one_line(exc)})"
            ) from exc
    return _from_array(counts, path, window_seconds)


def _load_json(path: Path, window_seconds: float | None) -> Trace:
    try:
        obj = json.loads(path.read_bytes())
    except RecursionError as exc:
        raise InputError(f"{path}: JSON nested too deeply") from exc
    except ValueError as exc:  # not JSON, or not UTF-8/16/32 text
        raise InputError(f"{path}: not JSON ({_one_line(exc)})") from exc
    if not isinstance(obj, dict) or "logical_count" not in obj:
        what = f"keys {_brief(sorted(obj), 200)}" if isinstance(obj, dict) else type(obj).__name__
        raise InputError(f"{path}: not a JSON object with 'logical_count' (got {what})")
    counts = _as_counts(obj["logical_count"], path)
    if window_seconds is None and obj.get("window_seconds") is not None:
        window_seconds = check_window_seconds(obj["window_seconds"], f"{path}: window_seconds")
    return _from_array(counts, path, window_seconds)


def _jsonl_id(value: object, what: str, where: str) -> int:
    """A layer or expert id of a .jsonl record: a JSON integer in [0, MAX_JSONL_ID)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: {what} must be an integer, got {_brief(value)}")
    if not 0 <= value < MAX_JSONL_ID:
        raise InputError(f"{where}: {what} {_brief(value)} out of range [0, 2**20)")
    return value


def _jsonl_record(raw: bytes, where: str) -> tuple[tuple[object, object], int, list[int]] | None:
    """One .jsonl line: ((problem_id, token_idx), layer, experts), None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
    except RecursionError as exc:
        raise InputError(f"{where}: JSON nested too deeply") from exc
    except ValueError as exc:
        raise InputError(f"{where}: not a routing record (not JSON: {_one_line(exc)})") from exc
    if not isinstance(rec, dict):
        raise InputError(
            f"{where}: not a routing record (a JSON {type(rec).__name__}, not an object)"
        )
    for key in ("token_idx", "layer", "experts"):
        if key not in rec:
            raise InputError(f"{where}: not a routing record (no {key!r})")
    problem, token = rec.get("problem_id"), rec["token_idx"]
    if problem is not None and (isinstance(problem, bool) or not isinstance(problem, (int, str))):
        raise InputError(
            f"{where}: problem_id must be an integer or a string, got {_brief(problem)}"
        )
    if isinstance(token, bool) or not isinstance(token, (int, str)):
        raise InputError(f"{where}: token_idx must be an integer or a string, got {_brief(token)}")
    layer = _jsonl_id(rec["layer"], "layer", where)
    experts = rec["experts"]
    if not isinstance(experts, list):
        raise InputError(f"{where}: experts must be a list of expert ids, got {_brief(experts)}")
    return (problem, token), layer, [_jsonl_id(e, "expert id", where) for e in experts]


def _load_jsonl(
    path: Path, tokens_per_window: int, window_seconds: float | None, num_experts: int | None
) -> Trace:
    """Per-(token, layer) routing lines grouped into windows of consecutive tokens."""
    if isinstance(tokens_per_window, bool) or not isinstance(tokens_per_window, (int, np.integer)):
        raise InputError(f"tokens per window must be an integer, got {_brief(tokens_per_window)}")
    if tokens_per_window <= 0:
        raise InputError(f"tokens per window must be > 0, got {tokens_per_window}")
    if num_experts is not None and (
        isinstance(num_experts, bool)
        or not isinstance(num_experts, (int, np.integer))
        or not 0 < num_experts <= MAX_JSONL_ID
    ):
        raise InputError(f"num_experts must be an integer in [1, 2**20], got {_brief(num_experts)}")
    token_index: dict[tuple[object, object], int] = {}
    rows: list[tuple[int, int, int]] = []  # (token ordinal, layer, expert)
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            record = _jsonl_record(raw, f"{path}:{lineno}")
            if record is None:
                continue
            key, layer, experts = record
            # Tokens are numbered in the order they first appear: generation order.
            ordinal = token_index.setdefault(key, len(token_index))
            rows.extend((ordinal, layer, e) for e in experts)
    if not rows:
        raise InputError(f"{path}: no routing records")
    table = np.asarray(rows, dtype=np.int64)
    num_layers = int(table[:, 1].max()) + 1
    experts_seen = int(table[:, 2].max()) + 1
    num_experts = int(num_experts or experts_seen)
    if experts_seen > num_experts:
        raise InputError(f"{path}: expert id {experts_seen - 1} >= num_experts {num_experts}")
    num_windows = -(-len(token_index) // int(tokens_per_window))
    cells = num_windows * num_layers * num_experts
    if cells > MAX_TRACE_CELLS:
        hint = " (use more tokens per window)" if num_windows > 1 else ""
        raise InputError(
            f"{path}: {num_windows} windows x {num_layers} layers x {num_experts} experts is "
            f"{cells} counts, more than the limit of 2**27{hint}"
        )
    flat = (table[:, 0] // tokens_per_window * num_layers + table[:, 1]) * num_experts + table[:, 2]
    counts = np.bincount(flat, minlength=cells).reshape(num_windows, num_layers, num_experts)
    return Trace(
        counts.astype(np.int64, copy=False),
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
    if window_seconds is not None:
        window_seconds = check_window_seconds(window_seconds, "window seconds")
    if path.is_dir():
        return _load_dir(path, window_seconds, drop_empty_layers)
    if not path.is_file():
        raise InputError(f"{path}: no such trace file")
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
