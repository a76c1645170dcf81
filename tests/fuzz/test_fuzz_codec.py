"""Fuzz the count codec (rebalancer/wire/codec.py): whatever Array arrives, decoding ends
in an InputError or in an array consistent with the declared dtype and shape."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec

U32 = 2**32 - 1
KNOWN = {
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_UINT32: np.dtype("<u4"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
}

dtype_enums = st.one_of(
    st.sampled_from(sorted(pb.DType.values())),
    st.integers(-(2**31), 2**31 - 1),  # proto3 enums are open: any int32 arrives as is
)
dims = st.one_of(st.integers(0, 5), st.sampled_from([0, 1, 2**16, 2**31, U32]))
shapes = st.lists(dims, max_size=6) | st.lists(st.just(0), min_size=60, max_size=80)


@st.composite
def raw_arrays(draw: st.DrawFn) -> pb.Array:
    """Any Array: dtype (known or not), shape, and data of the right or a wrong length."""
    dtype = draw(dtype_enums)
    shape = draw(shapes)
    itemsize = KNOWN[dtype].itemsize if dtype in KNOWN else 4
    size = math.prod(shape) * itemsize
    if size <= 4096 and draw(st.booleans()):
        data = draw(st.binary(min_size=size, max_size=size))
    else:
        data = draw(st.binary(max_size=64))
    return pb.Array(dtype=dtype, shape=shape, data=data)


def _mutated(msg: pb.Array, flips: list[tuple[int, int]], cut: int | None) -> bytes:
    raw = bytearray(msg.SerializeToString())
    for pos, value in flips:
        if raw:
            raw[pos % len(raw)] = value
    return bytes(raw[:cut] if cut is not None else raw)


def check_decoded(arr: np.ndarray, msg: pb.Array, shape: tuple[int, ...] | None) -> None:
    assert arr.dtype == KNOWN[msg.dtype]
    assert arr.shape == tuple(msg.shape)
    if shape is not None:
        assert arr.shape == shape
    assert arr.nbytes == len(msg.data)


@given(raw_arrays(), st.one_of(st.none(), shapes.map(tuple)))
@example(  # numpy refused the reshape with a bare ValueError (not an InputError)
    pb.Array(dtype=pb.DTYPE_INT32, shape=[0, U32, U32, U32], data=b""), None
)
@example(pb.Array(dtype=pb.DTYPE_INT64, shape=[0] * 70, data=b""), None)  # over numpy's ndim
@example(pb.Array(dtype=-5, shape=[1], data=b"\0" * 4), None)
def test_decode_refuses_or_is_consistent(msg: pb.Array, shape: tuple[int, ...] | None) -> None:
    try:
        arr = codec.decode(msg, "a", shape)
    except InputError as exc:
        assert str(exc).startswith("a: ") and "\n" not in str(exc)
        return
    check_decoded(arr, msg, shape)


@given(
    raw_arrays(),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    st.one_of(st.none(), st.integers(0, 200)),
)
def test_decode_of_mutated_wire_bytes(
    msg: pb.Array, flips: list[tuple[int, int]], cut: int | None
) -> None:
    """Bytes as they come off the wire, flipped and truncated: parse errors belong to
    protobuf (DecodeError, before the codec); whatever parses must decode or be refused."""
    from google.protobuf.message import DecodeError

    try:
        parsed = pb.Array.FromString(_mutated(msg, flips, cut))
    except DecodeError:
        return
    try:
        arr = codec.decode(parsed, "a")
    except InputError:
        return
    check_decoded(arr, parsed, None)


finite_or_not = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def count_arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(list(KNOWN.values())))
    shape = draw(hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=5))
    elements = finite_or_not if dtype.kind == "f" else None
    return draw(hnp.arrays(dtype, shape, elements=elements))


@given(count_arrays())
@example(np.array([[np.nan, 1.0]], np.float32))
@example(np.array([[1.0, np.inf]], np.float32))
@example(np.array([[-0.0, -1e-30]], np.float32))
@example(np.array([[0, -1]], np.int64))
@example(np.zeros((0, 3), np.float32))
@example(np.array([[2**53, 2**53 + 1]], np.int64))
@example(np.array([[1e38]], np.float32))
def test_decode_counts(counts: np.ndarray) -> None:
    msg = codec.encode(counts)
    bad = counts.size > 0 and (
        (counts.dtype.kind == "f" and not np.isfinite(counts).all())
        or (counts < 0).any()
        or (counts > codec.MAX_COUNT).any()
    )
    if bad:
        with pytest.raises(
            InputError,
            match=r"^c: counts contain (NaN or infinity|negative values|.* above the largest count "
            r"2\^53)$",
        ):
            codec.decode_counts(msg, "c", counts.shape)
        return
    out = codec.decode_counts(msg, "c", counts.shape)
    assert out.dtype == counts.dtype and np.array_equal(out, counts)
    # the wrong expected shape is always refused
    with pytest.raises(InputError, match="does not match expected"):
        codec.decode_counts(msg, "c", (counts.shape[0] + 1, counts.shape[1]))


wire_arrays = st.builds(
    lambda dtype, order: dtype.newbyteorder(order),
    st.sampled_from(list(KNOWN.values())),
    st.sampled_from(["<", ">"]),
).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
)


@given(wire_arrays, st.booleans())
@example(np.array(5, np.int32), False)  # encode made a 0-d array [1] (np.ascontiguousarray)
def test_round_trip_is_identity(arr: np.ndarray, transpose: bool) -> None:
    if transpose and arr.ndim >= 2:
        arr = arr.T  # not C-contiguous
    dtype = arr.dtype.newbyteorder("<")
    msg = codec.encode(arr)
    back = codec.decode(msg, "a", arr.shape)
    assert back.shape == arr.shape and back.dtype == dtype
    assert back.tobytes() == np.ascontiguousarray(arr, dtype=dtype).tobytes()  # NaN payloads too
    assert not back.flags.writeable


@given(
    hnp.arrays(
        st.sampled_from(
            [np.float64, np.int8, np.int16, np.uint64, np.bool_, np.complex64, np.float16]
        ),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
    )
)
def test_encode_refuses_other_dtypes(arr: np.ndarray) -> None:
    with pytest.raises(InputError, match="cannot encode dtype"):
        codec.encode(arr)


@st.composite
def phy2log_cases(draw: st.DrawFn) -> tuple[pb.Array, int, int, int]:
    L = draw(st.integers(1, 3))
    E = draw(st.integers(1, 5))
    P = draw(st.integers(E, E + 4))
    if draw(st.booleans()):  # a valid placement, perhaps broken in one entry
        arr = np.tile(np.arange(P) % E, (L, 1))
        for row in arr:
            draw(st.randoms(use_true_random=False)).shuffle(row)
        if draw(st.booleans()):
            arr[draw(st.integers(0, L - 1)), draw(st.integers(0, P - 1))] = draw(
                st.integers(-3, E + 3)
            )
        dtype = draw(st.sampled_from(list(KNOWN.values())))
        if dtype.kind == "u":
            arr = np.abs(arr)
        msg = codec.encode(arr.astype(dtype))
        if dtype.kind == "f" and draw(st.booleans()):
            msg = codec.encode(np.where(arr == 0, np.nan, arr).astype(dtype))
    else:
        msg = draw(raw_arrays())
    eL, eP, eE = (draw(st.sampled_from([v, v, v + 1, max(v - 1, 1)])) for v in (L, P, E))
    return msg, eL, eP, eE


@given(phy2log_cases())
def test_decode_phy2log(case: tuple[pb.Array, int, int, int]) -> None:
    msg, L, P, E = case
    try:
        out = codec.decode_phy2log(msg, L, P, E)
    except InputError:
        return
    assert msg.dtype in (pb.DTYPE_INT32, pb.DTYPE_INT64, pb.DTYPE_UINT32)
    assert out.dtype == np.int64 and out.shape == (L, P)
    assert out.min() >= 0 and out.max() < E
    for row in out:
        assert set(row.tolist()) == set(range(E))
