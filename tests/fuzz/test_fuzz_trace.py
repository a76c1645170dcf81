"""Fuzz the simulator's trace files (rebalancer/sim/trace.py, read by `rebalancer simulate`
and `rebalancer trace info/convert`): every refusal an InputError, every loaded trace a
valid one, save -> load the identity.

The inputs that once escaped as other exceptions (or were silently misread) are kept
below as regression tests, one per defect, with the input that found it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rebalancer.errors import InputError
from rebalancer.sim.trace import Trace, load_trace
from tests.fuzz.file_helpers import mutate, mutations, npz_bytes, pt_bytes

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("fuzz_trace")


def put(folder: Path, name: str, content: bytes) -> Path:
    path = folder / name
    path.write_bytes(content)
    return path


def load_or_refuse(path: Path, **kw: object) -> Trace | None:
    try:
        trace = load_trace(path, **kw)  # type: ignore[arg-type]
    except InputError as exc:
        assert str(exc) and "\n" not in str(exc), repr(str(exc))
        return None
    assert trace.counts.dtype == np.int64 and trace.counts.ndim == 3 and min(trace.counts.shape) > 0
    assert (trace.counts >= 0).all() and trace.counts.any()
    assert np.isfinite(trace.window_seconds) and trace.window_seconds > 0
    return trace


# Numbers within int64 and beyond it (up to beyond float's range).
safe_numbers = st.one_of(
    st.integers(0, 1000),
    st.integers(-(2**62), 2**62),
    st.booleans(),
    st.floats(-1e15, 1e15),
    st.sampled_from([float("nan"), float("inf"), 1e19, 1e308]),
    st.sampled_from([2**63 - 1, 2**63, 2**64, 2**70, 10**400]),
    st.text(max_size=3),
)
shallow_json = st.recursive(
    st.none() | safe_numbers,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=15,
)


def _valid_trace_files() -> dict[str, bytes]:
    counts = np.arange(2 * 3 * 4, dtype=np.int64).reshape(2, 3, 4)
    return {
        ".npz": npz_bytes(
            logical_count=counts, window_seconds=np.float64(2.0), labels=np.array(["a", "b"])
        ),
        ".json": json.dumps({"logical_count": counts.tolist(), "window_seconds": 2.0}).encode(),
        ".pt": pt_bytes({"logical_count": torch.from_numpy(counts)}),
        ".jsonl": b"".join(
            json.dumps(
                {"problem_id": p, "token_idx": t, "layer": layer, "experts": [t % 4, (t + 1) % 4]}
            ).encode()
            + b"\n"
            for p in range(2)
            for t in range(3)
            for layer in range(2)
        ),
    }


VALID_TRACE_FILES = _valid_trace_files()


@given(st.sampled_from([".json", ".npz", ".pt", ".pth", ".bin"]), st.binary(max_size=300))
def test_random_bytes(folder: Path, suffix: str, content: bytes) -> None:
    load_or_refuse(put(folder, "random" + suffix, content))


@given(st.sampled_from([".json", ".npz", ".pt"]), mutations)
def test_mutated_valid_files(folder: Path, suffix: str, mutation: tuple) -> None:
    load_or_refuse(put(folder, "mutated" + suffix, mutate(VALID_TRACE_FILES[suffix], *mutation)))


@given(shallow_json, shallow_json)
def test_json_of_wrong_structure(folder: Path, counts: object, seconds: object) -> None:
    for doc in (
        counts,
        {"logical_count": counts},
        {"logical_count": [[[1]]], "window_seconds": seconds},
    ):
        load_or_refuse(put(folder, "wrong.json", json.dumps(doc).encode()))


@st.composite
def routing_records(draw: st.DrawFn) -> bytes:
    """.jsonl lines: records with small ids, some fields missing or of the wrong type, a
    few ids too large to allocate for, lines that are not objects or not UTF-8."""
    big = st.sampled_from([2**20, 10**12, 2**70])
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        rec: dict[str, object] = {
            "problem_id": draw(st.integers(0, 3) | st.text(max_size=2) | st.none() | st.just([0])),
            "token_idx": draw(
                st.integers(0, 5) | st.text(max_size=2) | st.sampled_from([[1], 1.5, True])
            ),
            "layer": draw(
                st.integers(-1, 3) | st.sampled_from([1.5, "2", None, float("inf")]) | big
            ),
            "experts": draw(
                st.lists(st.integers(-1, 6) | st.sampled_from([2.5, "1", None]) | big, max_size=3)
                | st.sampled_from([None, 3, "x", "12"])
            ),
        }
        for key in draw(st.lists(st.sampled_from(sorted(rec)), max_size=1)):
            del rec[key]
        lines.append(json.dumps(rec))
    if draw(st.booleans()):
        lines.insert(
            draw(st.integers(0, len(lines))),
            draw(st.sampled_from(["", "  ", "{", "nul", "[1]", "7"])),
        )
    content = ("\n".join(lines) + "\n").encode()
    return content + b"\xff\xfe\n" if draw(st.integers(0, 9)) == 0 else content


@given(
    routing_records(),
    st.integers(-1, 4),
    st.one_of(st.none(), st.integers(-1, 8)),
    st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
)
def test_jsonl_records(
    folder: Path, content: bytes, tokens: int, experts: int | None, seconds: float | None
) -> None:
    load_or_refuse(
        put(folder, "routing.jsonl", content),
        tokens_per_window=tokens,
        num_experts=experts,
        window_seconds=seconds,
    )


@given(
    hnp.arrays(
        np.int64,
        hnp.array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=4),
        elements=st.integers(0, 10**9),
    ),
    st.floats(1e-3, 1e6),
    st.sampled_from([".npz", ".json", ".pt"]),
)
def test_round_trip(folder: Path, counts: np.ndarray, seconds: float, suffix: str) -> None:
    counts[0, :, 0] += 1  # no all-zero layer (those are dropped on load)
    if suffix == ".npz":
        Trace(counts, seconds, "t", [str(i) for i in range(len(counts))]).save(folder / "t.npz")
    elif suffix == ".json":
        put(
            folder,
            "t.json",
            json.dumps({"logical_count": counts.tolist(), "window_seconds": seconds}).encode(),
        )
    else:
        put(folder, "t.pt", pt_bytes({"logical_count": torch.from_numpy(counts)}))
    trace = load_trace(folder / ("t" + suffix))
    assert np.array_equal(trace.counts, counts)
    assert trace.window_seconds == (seconds if suffix != ".pt" else 5.0)


# ------------------------------------------------------------------ regressions (sim/trace.py)

JSONL_FOUND = {
    "not-an-object": b"[1]\n",  # AttributeError: 'list' object has no attribute 'get'
    "unhashable-token": b'{"token_idx": [1], "layer": 0, "experts": [1]}\n',  # TypeError
    "not-utf8": b"\xff\xfe\n",  # UnicodeDecodeError
    "infinite-layer": b'{"token_idx": 0, "layer": 1e400, "experts": [1]}\n',  # OverflowError
    "huge-expert": b'{"token_idx": 0, "layer": 0, "experts": [%d]}\n' % 2**70,  # OverflowError
    # MemoryError (7 TiB)
    "absurd-expert": b'{"token_idx": 0, "layer": 0, "experts": [1000000000000]}\n',
    "absurd-layer": b'{"token_idx": 0, "layer": 1000000000000, "experts": [1]}\n',  # MemoryError
    "deep": b"[" * 100_000 + b"\n",  # RecursionError
}


@pytest.mark.parametrize("case", sorted(JSONL_FOUND))
def test_jsonl_refusals(folder: Path, case: str) -> None:
    """Non-object lines, unhashable token ids, non-UTF-8 bytes, ids beyond int64 or
    infinite, absurd ids (the [T, L, E] was allocated first) and deep nesting escaped as
    AttributeError/TypeError/UnicodeDecodeError/OverflowError/MemoryError/RecursionError."""
    with pytest.raises(InputError, match=r"bad\.jsonl"):
        load_trace(put(folder, "bad.jsonl", JSONL_FOUND[case]))
    assert load_or_refuse(folder / "bad.jsonl") is None


def test_json_deep_nesting(folder: Path) -> None:
    """Deeply nested JSON escaped as RecursionError."""
    with pytest.raises(InputError, match="nested too deeply"):
        load_trace(put(folder, "deep.json", b"[" * 100_000))


@pytest.mark.parametrize("kind", ["sparse", "meta", "bfloat16"])
def test_pt_tensor_layouts(folder: Path, kind: str) -> None:
    """A sparse or meta tensor escaped as TypeError / NotImplementedError from .numpy()."""
    tensor = {
        "sparse": lambda: torch.ones(2, 3).to_sparse(),
        "meta": lambda: torch.ones(2, 3, device="meta"),
        "bfloat16": lambda: torch.ones(2, 3, dtype=torch.bfloat16),
    }[kind]()
    with pytest.raises(InputError, match="sparse|meta|bfloat16"):
        load_trace(put(folder, kind + ".pt", pt_bytes({"logical_count": tensor})))


@pytest.mark.parametrize(
    "content, suffix",
    [
        (b'{"logical_count": [[1e19, 1]]}', ".json"),
        (npz_bytes(logical_count=np.array([[2**63, 1]], dtype=np.uint64)), ".npz"),
        (b'{"logical_count": [[%d, 1]]}' % 2**64, ".json"),  # beyond uint64: an object array
        (b'{"logical_count": [[%d, %d]]}' % (2**62, 2**62), ".json"),  # each fits, the sum does not
    ],
)
def test_counts_beyond_int64(folder: Path, content: bytes, suffix: str) -> None:
    """Counts beyond int64 (1e19 in JSON, uint64 2**63 in .npz) wrapped negative in
    astype(int64) and were refused with a misleading 'got shape [1, 0, E]'."""
    with pytest.raises(InputError, match="range|large|int64"):
        load_trace(put(folder, "big" + suffix, content))


@pytest.mark.parametrize("seconds", [b"true", b'"5"', b"1e308", b"1" + b"0" * 400, b"[5]"])
def test_window_seconds_not_a_sane_number(folder: Path, seconds: bytes) -> None:
    """window_seconds true was taken as 1.0 s (bool passes isinstance(int)); 1e308 was
    accepted (and overflowed later, in the timing defaults)."""
    path = put(folder, "ws.json", b'{"logical_count": [[1]], "window_seconds": %s}' % seconds)
    with pytest.raises(InputError, match="window_seconds"):
        load_trace(path)


@pytest.mark.parametrize("expert", ["2.5", '"1"', "true", "2.0"])
def test_jsonl_non_integer_ids(folder: Path, expert: str) -> None:
    """Float and string expert ids were truncated or parsed (int(2.5) == 2, int('1') == 1)."""
    path = put(
        folder, "ids.jsonl", b'{"token_idx": 0, "layer": 0, "experts": [%s]}\n' % expert.encode()
    )
    with pytest.raises(InputError, match="must be an integer"):
        load_trace(path)


def test_pt_message_lines(folder: Path) -> None:
    """A bad .pt file was refused with torch's whole multi-line message (the weights_only
    explanation) inside the one-line InputError."""
    with pytest.raises(InputError) as info:
        load_trace(put(folder, "garbage.pt", b"\x80\x02garbage"))
    assert "\n" not in str(info.value) and "weights_only=False" not in str(info.value)


@pytest.mark.parametrize(
    "counts",
    [
        [[[1, 2, 3, 4], [4, 3, 2, 1]]] * 2,  # [T, L, E]: escaped as IndexError
        [[[1, 2], [2, 1]]] * 2,  # [T, L, E] with L == E: the mask fitted, read as [L, E] silently
        [1, 2, 3],
    ],
)
def test_generate_sources_of_wrong_rank(folder: Path, counts: list) -> None:
    """deepseek_v3_sources (datasets.load_deepseek_v3): a [T, L, E] counts file escaped as
    IndexError (only ValueError/KeyError/TypeError were caught)."""
    from rebalancer.sim.generate import deepseek_v3_sources

    path = put(folder, "steps.json", json.dumps({"logical_count": counts}).encode())
    with pytest.raises(InputError, match=r"\[L, E\]"):
        deepseek_v3_sources([path])


def test_generate_top_k_above_experts() -> None:
    """top_k above the number of experts was accepted (each token counted top_k times
    among fewer experts)."""
    from rebalancer.sim.generate import TraceGenConfig, make_trace

    sources = {"a": np.array([[1.0, 2.0, 3.0, 4.0]])}
    with pytest.raises(InputError, match="top_k"):
        make_trace(sources, TraceGenConfig(windows=1, tokens_per_window=4, top_k=9))
    assert (
        make_trace(sources, TraceGenConfig(windows=1, tokens_per_window=4, top_k=4)).counts.sum()
        == 16
    )
