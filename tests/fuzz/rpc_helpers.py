"""Shared pieces of the RPC fuzz modules: a controller on loopback per module, calls that
return (status, details, reply), and a snapshot of what the AdminService reports."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
import numpy as np
from hypothesis import strategies as st

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec

# What a refusal may be (invariant 6, ARCHITECTURE.md): never UNKNOWN / INTERNAL / UNAVAILABLE.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}
OK = grpc.StatusCode.OK
TIMEOUT = 10.0
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
U32, U64 = 2**32 - 1, 2**64 - 1

# The deployment every module seeds: tiny, so placements and decisions are instant.
L, E, P, G = 2, 4, 6, 2
SHAPE = pb.ModelShape(
    num_layers=L,
    num_logical_experts=E,
    num_physical_slots=P,
    num_gpus=G,
    num_nodes=1,
    expert_bytes=1000,
)


def call(
    fn: Any, request: Any, metadata: Iterable[tuple[str, str]] = ()
) -> tuple[grpc.StatusCode, str, Any]:
    try:
        return OK, "", fn(request, timeout=TIMEOUT, metadata=tuple(metadata))
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


def stream(
    stub: Any, messages: list[pb.WorkerMessage], metadata: Iterable[tuple[str, str]] = ()
) -> tuple[grpc.StatusCode, str, list[pb.ControllerMessage]]:
    """Send `messages` on one Stream, then end it; the status and what came back."""
    replies: list[pb.ControllerMessage] = []
    try:
        for reply in stub.Stream(iter(messages), timeout=TIMEOUT, metadata=tuple(metadata)):
            replies.append(reply)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", replies
    return OK, "", replies


def assert_refusal(code: grpc.StatusCode, details: str, what: object = "") -> None:
    assert code in REFUSALS, (code, details, what)
    assert details.strip(), (code, what)


def hello(session: str) -> pb.WorkerMessage:
    return pb.WorkerMessage(hello=pb.Hello(session_id=session))


def window(seq: int, counts: np.ndarray | None = None, **kw: Any) -> pb.WorkerMessage:
    counts = np.ones((L, E), np.int64) if counts is None else counts
    return pb.WorkerMessage(
        window=pb.Window(seq=seq, num_steps=1, logical_count=codec.encode(counts), **kw)
    )


def snapshot(
    admin: Any, names: Iterable[str] = (), metadata: Iterable[tuple[str, str]] = ()
) -> list[bytes]:
    """What the AdminService says: Status of every deployment, and the placement, policy
    and history (less its contingency sets) of the named ones that exist."""
    md = tuple(metadata)
    status = admin.Status(pb.StatusRequest(), timeout=TIMEOUT, metadata=md)
    parts = [status.SerializeToString(deterministic=True)]
    existing = {d.deployment for d in status.deployments}
    for name in sorted(set(names) & existing):
        ref = pb.DeploymentRef(deployment=name)
        parts.append(
            admin.GetPlacement(ref, timeout=TIMEOUT, metadata=md).SerializeToString(
                deterministic=True
            )
        )
        parts.append(
            admin.GetPolicy(ref, timeout=TIMEOUT, metadata=md).SerializeToString(deterministic=True)
        )
        history = admin.History(
            pb.HistoryRequest(deployment=name, limit=10_000), timeout=TIMEOUT, metadata=md
        )
        # Contingency sets are planned in the background whenever the decision worker is
        # idle (controller/contingency.py), not by the call under test.
        del history.contingency_sets[:]
        parts.append(history.SerializeToString(deterministic=True))
    return parts


# ------------------------------------------------------------------ strategies


def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`good` three times in four, else `bad`."""
    return st.sampled_from([0, 1, 2, 3]).flatmap(lambda i: bad if i == 3 else good)


names = st.one_of(
    st.just("dep"),
    st.sampled_from(["nosuch", "r0", "r1", "", "bad name", "-x", "x" * 129, "é", "a/b", "dep\n"]),
    st.text(max_size=8),
)
u32 = st.one_of(st.integers(0, 8), st.sampled_from([U32, 2**31, 2**16]), st.integers(0, U32))
u64 = st.one_of(st.integers(0, 8), st.sampled_from([U64, 2**63, 2**32]), st.integers(0, U64))
doubles = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, -1.0, 1e308])
)
small = st.integers(0, 9)


@st.composite
def arrays(draw: st.DrawFn, shape: tuple[int, ...] | None = None) -> pb.Array:
    """An Array: often clean counts of the right shape, or such counts with one bad entry
    (negative, NaN, infinite), at times anything: any dtype enum (unknown ones too), any
    shape, data of any length."""
    kind = draw(st.sampled_from(["clean", "clean", "one-bad", "raw"]))
    if kind != "raw" and shape is not None:
        dtype = np.dtype(draw(st.sampled_from([np.int32, np.int64, np.uint32, np.float32])))
        counts = np.array(
            draw(
                st.lists(st.integers(0, 100), min_size=math.prod(shape), max_size=math.prod(shape))
            ),
            dtype=dtype,
        ).reshape(shape)
        if kind == "one-bad" and counts.size:
            if dtype.kind == "f":
                bad = draw(
                    st.sampled_from(
                        [float("nan"), float("inf"), float("-inf"), -1.0, -1e-30, 3.4e38]
                    )
                )
            else:
                info = np.iinfo(dtype)
                bad = draw(
                    st.sampled_from(
                        [int(info.min), -1, int(info.max)] if info.min else [int(info.max)]
                    )
                )
            counts.flat[draw(st.integers(0, counts.size - 1))] = bad
        return codec.encode(counts)
    dtype_enum = draw(st.sampled_from(sorted(pb.DType.values())) | st.integers(-(2**31), 2**31 - 1))
    dims = draw(st.lists(st.integers(0, 7) | st.sampled_from([U32, 2**31]), max_size=4))
    data = draw(st.binary(max_size=200))
    return pb.Array(dtype=dtype_enum, shape=dims, data=data)


def valid_counts(msg: pb.Array, shape: tuple[int, ...]) -> bool:
    try:
        codec.decode_counts(msg, "c", shape)
    except Exception:  # noqa: BLE001 - any refusal of the codec
        return False
    return True


def settled_snapshot(
    admin: Any,
    expected: list[bytes],
    names: Iterable[str] = (),
    metadata: Iterable[tuple[str, str]] = (),
    wait: float = 2.0,
) -> list[bytes]:
    """The snapshot, read again for up to `wait` seconds until it equals `expected`: a
    stream's status reaches the client just before the server detaches its session (the
    abort is sent, then the handler's `finally` runs), so `connected_ranks` may lag."""
    deadline = time.monotonic() + wait
    while True:
        got = snapshot(admin, names, metadata)
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def consume_sessions(
    stub: Any, sessions: Iterator[str] | list[str], metadata: Iterable[tuple[str, str]] = ()
) -> None:
    """Open and end a stream on each session, so it is detached (a registered session
    that never streamed holds its rank for a while)."""
    for session in sessions:
        stream(stub, [hello(session)], metadata)


def describe_change(before: list[bytes], after: list[bytes]) -> str:
    """The first differing part of two snapshots, as text."""
    kinds = [pb.StatusResponse]
    for i, (a, b) in enumerate(zip(before, after, strict=False)):
        if a != b:
            kind = (
                kinds[0] if i == 0 else (pb.Placement, pb.Policy, pb.HistoryResponse)[(i - 1) % 3]
            )
            return f"before:\n{kind.FromString(a)}\nafter:\n{kind.FromString(b)}"
    return f"{len(before)} parts before, {len(after)} after"
