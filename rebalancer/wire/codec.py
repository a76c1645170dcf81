"""Arrays on the wire: numpy <-> rebalancer.v1.Array, with validation.

Counts travel as raw little-endian bytes with a declared dtype and shape; this
module is the only place that turns them into numpy (zero-copy `frombuffer`,
no Python loops over experts) and the only place that says what is malformed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.layout import check_phy2log

_TO_NUMPY: dict[Any, np.dtype] = {
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_UINT32: np.dtype("<u4"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
}
_FROM_NUMPY: dict[np.dtype, Any] = {v: k for k, v in _TO_NUMPY.items()}

# The largest count accepted, from the wire or a count file: counts are routed tokens,
# and above 2^53 float64 (what the estimate and the placement math add them in) no longer
# counts them exactly. It also keeps every sum finite: 1e308 counts once summed to
# infinity and the placement math answered with overflow warnings and balancedness 1.0.
MAX_COUNT = 2**53


def encode(array: np.ndarray) -> pb.Array:
    """Any int32/int64/uint32/float32 numpy array as an Array message."""
    arr = np.asarray(array)
    dtype = arr.dtype.newbyteorder("<")
    if dtype not in _FROM_NUMPY:
        raise InputError(f"cannot encode dtype {arr.dtype}; use int32, int64, uint32 or float32")
    # np.asarray keeps a 0-d array 0-d (np.ascontiguousarray would make it [1]).
    arr = np.asarray(arr, dtype=dtype, order="C")
    return pb.Array(dtype=_FROM_NUMPY[dtype], shape=list(arr.shape), data=arr.tobytes())


def decode(msg: pb.Array, what: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """An Array message as a read-only numpy array, checked against `shape`.

    Raises InputError naming `what` on an unknown dtype, a shape mismatch, or a
    byte length that does not match dtype x shape.
    """
    dtype = _TO_NUMPY.get(msg.dtype)
    if dtype is None:
        raise InputError(
            f"{what}: unsupported dtype "
            f"{pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype}"
        )
    got = tuple(msg.shape)  # uint64 on the wire: Python ints already
    if shape is not None and got != tuple(shape):
        raise InputError(f"{what}: shape {list(got)} does not match expected {list(shape)}")
    expected = math.prod(got) * dtype.itemsize
    data = msg.data  # each read of a bytes field copies the payload: read it once
    if len(data) != expected:
        raise InputError(
            f"{what}: {len(data)} bytes for shape {list(got)} of {dtype.name} (expected {expected})"
        )
    try:
        return np.frombuffer(data, dtype=dtype).reshape(got)
    except ValueError as exc:  # an empty shape numpy cannot hold: too many or too large dims
        raise InputError(f"{what}: shape {list(got)} is not a valid array shape ({exc})") from None


def count_scans(dtype: np.dtype) -> tuple[bool, bool]:
    """Which scans counts of a wire dtype need: (min, max). A scan that cannot fail is
    skipped: an unsigned count is never negative, and no int32 or uint32 count is above
    MAX_COUNT. So uint32 (what ranks and sidecars send) needs none, int32 the sign only,
    int64 and float32 both (float32: NaN and infinity as well)."""
    return _SCANS[np.dtype(dtype).newbyteorder("<")]


_SCANS: dict[np.dtype, tuple[bool, bool]] = {
    dt: (dt.kind != "u", dt.kind == "f" or int(np.iinfo(dt).max) > MAX_COUNT)
    for dt in _TO_NUMPY.values()
}


def decode_counts(msg: pb.Array, what: str, shape: tuple[int, ...]) -> np.ndarray:
    """Counts must be integers or finite non-negative floats, none above MAX_COUNT.
    Returned without a copy (read-only, the wire dtype): callers add them into arrays of
    their own. Only the scans that can fail run (`count_scans`)."""
    arr = decode(msg, what, shape)
    scan_low, scan_high = _SCANS[arr.dtype]
    if not arr.size or not (scan_low or scan_high):
        return arr
    if arr.dtype.kind == "f":
        low, high = float(arr.min()), float(arr.max())  # NaN propagates through both
        if not (math.isfinite(low) and math.isfinite(high)):
            raise InputError(f"{what}: counts contain NaN or infinity")
    else:
        low = int(arr.min()) if scan_low else 0
        high = int(arr.max()) if scan_high else 0
    if low < 0:
        raise InputError(f"{what}: counts contain negative values")
    if high > MAX_COUNT:
        raise InputError(f"{what}: counts contain {high:.4g}, above the largest count 2^53")
    return arr


def decode_phy2log(msg: pb.Array, num_layers: int, num_slots: int, num_logical: int) -> np.ndarray:
    """A placement's phy2log [L, P] as int64, every entry a valid expert, every expert held."""
    arr = decode(msg, "phy2log", (num_layers, num_slots))
    if arr.dtype.kind not in "iu":
        raise InputError("phy2log: must be an integer array")
    return check_phy2log(arr, num_logical, name="phy2log")


def encode_counts(counts: np.ndarray) -> pb.Array:
    """Counts on the wire as uint32 (half of int64, and the receiver need not check
    signs); int64 only for a window merged past 2^32 - 1 tokens on one expert."""
    if counts.size and int(counts.max()) > np.iinfo(np.uint32).max:
        return encode(counts.astype(np.int64))
    return encode(counts.astype(np.uint32))


# What a sender serves: (placement version, placement_digest); digest 0 = not stated.
Statement = tuple[int, int]


def window_message(
    seq: int,
    first_step: int,
    num_steps: int,
    version: int,
    logical: np.ndarray,
    physical: np.ndarray | None,
    serving: Statement = (0, 0),
) -> pb.Window:
    """One window of counts as ranks and sidecars send it: logical `[L, E]`, and the
    dispatched slot counts `[L, P]` when there are any; `serving`: (version, digest) of the
    placement the sender serves now (digest 0: not stated)."""
    msg = pb.Window(
        seq=seq,
        first_step=first_step,
        num_steps=num_steps,
        placement_version=version,
        logical_count=encode_counts(logical),
        serving_version=serving[0],
        serving_hash=serving[1],
    )
    if physical is not None:
        msg.physical_count.CopyFrom(encode_counts(physical))
    return msg


def resend_from(unacked: dict[int, pb.Window], expected: int) -> dict[int, pb.Window]:
    """After a (re-)Register: the unacknowledged windows the controller has not counted
    (seq >= its cursor `expected`), renumbered from `expected` in order, so the sender
    resends them and continues at `expected + len(result)`."""
    kept = [w for s, w in sorted(unacked.items()) if s >= expected]
    for i, w in enumerate(kept):
        w.seq = expected + i
    return {w.seq: w for w in kept}
