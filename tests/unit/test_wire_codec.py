from __future__ import annotations

import numpy as np
import pytest

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.float32])
def test_round_trip(dtype: type) -> None:
    a = (np.arange(12).reshape(3, 4) * 3).astype(dtype)
    back = codec.decode(codec.encode(a), "a", (3, 4))
    assert back.dtype == np.dtype(dtype) and np.array_equal(back, a)


def test_big_endian_input_is_sent_little_endian() -> None:
    a = np.arange(6, dtype=">i8").reshape(2, 3)
    assert np.array_equal(codec.decode(codec.encode(a), "a"), a)


def test_refusals() -> None:
    with pytest.raises(InputError, match="cannot encode"):
        codec.encode(np.zeros(3, np.float64))
    msg = codec.encode(np.ones((2, 2), np.int64))
    with pytest.raises(InputError, match="does not match expected"):
        codec.decode(msg, "c", (2, 3))
    with pytest.raises(InputError, match="unsupported dtype"):
        codec.decode(pb.Array(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 8), "c")
    with pytest.raises(InputError, match="negative"):
        codec.decode_counts(codec.encode(-np.ones((2, 2), np.int64)), "c", (2, 2))
    with pytest.raises(InputError, match="NaN"):
        codec.decode_counts(codec.encode(np.full((2, 2), np.inf, np.float32)), "c", (2, 2))


def test_phy2log_must_cover_every_expert() -> None:
    ok = np.array([[0, 1, 2, 0]], np.int32)
    assert codec.decode_phy2log(codec.encode(ok), 1, 4, 3).tolist() == [[0, 1, 2, 0]]
    with pytest.raises(InputError, match="layer 0 has no replica of expert 2"):
        codec.decode_phy2log(codec.encode(np.array([[0, 1, 1, 0]], np.int32)), 1, 4, 3)
    with pytest.raises(InputError, match="refers to expert 3 but there are 3 experts"):
        codec.decode_phy2log(codec.encode(np.array([[0, 1, 2, 3]], np.int32)), 1, 4, 3)


def test_counts_above_2_to_the_53_are_refused() -> None:
    """A count is a number of routed tokens: above 2^53 float64 no longer counts it
    exactly, so the wire refuses it (one rule with the count files); 2^53 itself passes."""
    top = np.full((2, 2), codec.MAX_COUNT, np.int64)
    assert codec.decode_counts(codec.encode(top), "c", (2, 2)).max() == 2**53
    for big in (np.full((2, 2), 2**60, np.int64), np.full((2, 2), 3e38, np.float32)):
        with pytest.raises(InputError, match=r"^c: counts contain .* above the largest count 2\^53$"):
            codec.decode_counts(codec.encode(big), "c", (2, 2))
