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
        with pytest.raises(
            InputError, match=r"^c: counts contain .* above the largest count 2\^53$"
        ):
            codec.decode_counts(codec.encode(big), "c", (2, 2))


class _Watched(np.ndarray):
    """An array that notes each min / max scan run over it."""

    scans: list[str] = []

    def min(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
        _Watched.scans.append("min")
        return super().min(*args, **kwargs)  # type: ignore[arg-type]

    def max(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
        _Watched.scans.append("max")
        return super().max(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "scans"),
    [
        (np.uint32, []),  # never negative, never above 2^53: nothing can fail
        (np.int32, ["min"]),  # the sign only: no int32 is above 2^53
        (np.int64, ["min", "max"]),
        (np.float32, ["min", "max"]),  # NaN and infinity too
    ],
)
def test_decode_counts_runs_only_the_scans_that_can_fail(
    dtype: type,
    scans: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The controller decodes every window: a uint32 window (what ranks and sidecars send)
    is taken without scanning it; the dtypes that can carry bad counts are still scanned."""
    real = codec.decode
    monkeypatch.setattr(
        codec, "decode", lambda msg, what, shape=None: real(msg, what, shape).view(_Watched)
    )
    _Watched.scans = []
    counts = (np.arange(12).reshape(3, 4) * 7).astype(dtype)
    out = codec.decode_counts(codec.encode(counts), "c", (3, 4))
    assert _Watched.scans == scans and np.array_equal(out, counts)
    assert codec.count_scans(np.dtype(dtype)) == ("min" in scans, "max" in scans)


def test_counts_at_the_edges_of_each_unscanned_check() -> None:
    """What a skipped scan would have checked holds by the dtype: the largest uint32 and
    int32 pass, a negative int32 is still refused."""
    for top in (
        np.full((2, 2), np.iinfo(np.uint32).max, np.uint32),
        np.full((2, 2), np.iinfo(np.int32).max, np.int32),
    ):
        assert np.array_equal(codec.decode_counts(codec.encode(top), "c", (2, 2)), top)
    with pytest.raises(InputError, match="negative"):
        codec.decode_counts(codec.encode(np.array([[0, -1]], np.int32)), "c", (1, 2))


def test_sent_windows_resume_from_the_controllers_cursor_and_drop_what_it_acked() -> None:
    """The link bookkeeping of agents and sidecars (rebalancer.wire.delivery)."""
    from rebalancer.wire.delivery import SentWindows

    sent = SentWindows()
    counts = np.ones((2, 3), np.int64)
    assert [sent.number(i, 1, 0, counts, None).seq for i in range(4)] == [0, 1, 2, 3]
    sent.ack(1)
    assert sorted(sent.unacked) == [2, 3]
    # The controller restarted having counted up to seq 2: seq 3 goes again as seq 3;
    # one that counted nothing beyond 0 gets both again, renumbered from 1.
    assert [w.seq for w in sent.resume(3)] == [3] and sent.next_seq == 4
    assert sent.number(9, 1, 0, counts, None).seq == 4
    assert [w.seq for w in sent.resume(1)] == [1, 2] and sent.next_seq == 3
    assert [w.first_step for w in sent.waiting()] == [3, 9]
