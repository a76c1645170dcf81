"""Fuzz the simulator's trace files (rebalancer/sim/trace.py, read by `rebalancer simulate`
and `rebalancer trace info/convert`): every refusal an InputError, every loaded trace a
valid one, save -> load the identity.

rebalancer/sim is being refactored by others: the defects found there are pinned below as
strict xfails (one per defect, with the input) and left out of the generic strategies so
those keep guarding everything else.
"""

from __future__ import annotations

import io
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
        # torch's multi-line messages of .pt files: pinned in test_defect_pt_message_lines
        if path.suffix not in (".pt", ".pth"):
            assert str(exc) and "\n" not in str(exc), repr(str(exc))
        return None
    assert trace.counts.dtype == np.int64 and trace.counts.ndim == 3 and min(trace.counts.shape) > 0
    assert (trace.counts >= 0).all() and trace.counts.any()
    assert np.isfinite(trace.window_seconds) and trace.window_seconds > 0
    return trace


def npz_bytes(**arrays: object) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def pt_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def mutate(data: bytes, flips: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for pos, value in flips:
        if out:
            out[pos % len(out)] = value
    if cut is not None and out:
        out = out[: cut % (len(out) + 1)]
    return bytes(out)


mutations = st.tuples(
    st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), max_size=3),
    st.one_of(st.none(), st.integers(0, 2**20)),
)
# Numbers within int64 (values beyond it are a pinned defect below).
safe_numbers = st.one_of(
    st.integers(0, 1000), st.integers(-(2**62), 2**62), st.booleans(),
    st.floats(-1e15, 1e15), st.sampled_from([float("nan"), float("inf")]), st.text(max_size=3),
)
shallow_json = st.recursive(
    st.none() | safe_numbers,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=15,
)


def _valid_trace_files() -> dict[str, bytes]:
    counts = np.arange(2 * 3 * 4, dtype=np.int64).reshape(2, 3, 4)
    return {
        ".npz": npz_bytes(logical_count=counts, window_seconds=np.float64(2.0), labels=np.array(["a", "b"])),
        ".json": json.dumps({"logical_count": counts.tolist(), "window_seconds": 2.0}).encode(),
        ".pt": pt_bytes({"logical_count": torch.from_numpy(counts)}),
        ".jsonl": b"".join(
            json.dumps({"problem_id": p, "token_idx": t, "layer": layer, "experts": [t % 4, (t + 1) % 4]}).encode() + b"\n"
            for p in range(2) for t in range(3) for layer in range(2)
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
    for doc in (counts, {"logical_count": counts}, {"logical_count": [[[1]]], "window_seconds": seconds}):
        load_or_refuse(put(folder, "wrong.json", json.dumps(doc).encode()))


@st.composite
def routing_records(draw: st.DrawFn) -> bytes:
    """.jsonl lines: records with small ids, some fields missing or of the wrong type."""
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        rec: dict[str, object] = {
            "problem_id": draw(st.integers(0, 3) | st.text(max_size=2) | st.none()),
            "token_idx": draw(st.integers(0, 5) | st.text(max_size=2)),
            "layer": draw(st.integers(-1, 3) | st.sampled_from([1.5, "2", None])),
            "experts": draw(st.lists(st.integers(-1, 6) | st.sampled_from([2.5, "1", None]), max_size=3)
                            | st.sampled_from([None, 3, "x"])),
        }
        for key in draw(st.lists(st.sampled_from(sorted(rec)), max_size=1)):
            del rec[key]
        lines.append(json.dumps(rec))
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from(["", "  ", "{", "nul"])))
    return ("\n".join(lines) + "\n").encode()


@given(routing_records(), st.integers(-1, 4), st.one_of(st.none(), st.integers(-1, 8)),
       st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)))
def test_jsonl_records(folder: Path, content: bytes, tokens: int, experts: int | None, seconds: float | None) -> None:
    load_or_refuse(put(folder, "routing.jsonl", content), tokens_per_window=tokens,
                   num_experts=experts, window_seconds=seconds)


@given(hnp.arrays(np.int64, hnp.array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=4),
                  elements=st.integers(0, 10**9)),
       st.floats(1e-3, 1e6), st.sampled_from([".npz", ".json", ".pt"]))
def test_round_trip(folder: Path, counts: np.ndarray, seconds: float, suffix: str) -> None:
    counts[0, :, 0] += 1  # no all-zero layer (those are dropped on load)
    if suffix == ".npz":
        Trace(counts, seconds, "t", [str(i) for i in range(len(counts))]).save(folder / "t.npz")
    elif suffix == ".json":
        put(folder, "t.json", json.dumps({"logical_count": counts.tolist(), "window_seconds": seconds}).encode())
    else:
        put(folder, "t.pt", pt_bytes({"logical_count": torch.from_numpy(counts)}))
    trace = load_trace(folder / ("t" + suffix))
    assert np.array_equal(trace.counts, counts)
    assert trace.window_seconds == (seconds if suffix != ".pt" else 5.0)


# ------------------------------------------------------------------ defects (sim/trace.py)

JSONL_DEFECTS = {
    "not-an-object": b"[1]\n",  # AttributeError: 'list' object has no attribute 'get'
    "unhashable-token": b'{"token_idx": [1], "layer": 0, "experts": [1]}\n',  # TypeError
    "not-utf8": b"\xff\xfe\n",  # UnicodeDecodeError
    "infinite-layer": b'{"token_idx": 0, "layer": 1e400, "experts": [1]}\n',  # OverflowError
    "huge-expert": b'{"token_idx": 0, "layer": 0, "experts": [%d]}\n' % 2**70,  # OverflowError
    "absurd-expert": b'{"token_idx": 0, "layer": 0, "experts": [1000000000000]}\n',  # MemoryError (7 TiB)
    "absurd-layer": b'{"token_idx": 0, "layer": 1000000000000, "experts": [1]}\n',  # MemoryError
    "deep": b"[" * 100_000 + b"\n",  # RecursionError
}


@pytest.mark.xfail(strict=True, reason="sim/trace.py _load_jsonl: non-object lines, unhashable token ids, "
                   "non-UTF-8 bytes, ids beyond int64 or infinite, absurd ids (allocates [T, L, E] first) "
                   "and deep nesting escape as AttributeError/TypeError/UnicodeDecodeError/OverflowError/"
                   "MemoryError/RecursionError instead of InputError")
@pytest.mark.parametrize("case", sorted(JSONL_DEFECTS))
def test_defect_jsonl_refusals(folder: Path, case: str) -> None:
    load_or_refuse(put(folder, "bad.jsonl", JSONL_DEFECTS[case]))


@pytest.mark.xfail(strict=True, reason="sim/trace.py _load_json: deeply nested JSON escapes as RecursionError")
def test_defect_json_deep_nesting(folder: Path) -> None:
    load_or_refuse(put(folder, "deep.json", b"[" * 100_000))


@pytest.mark.xfail(strict=True, reason="sim/trace.py _load_pt: a sparse or meta tensor escapes as "
                   "TypeError / NotImplementedError from .numpy()")
@pytest.mark.parametrize("kind", ["sparse", "meta"])
def test_defect_pt_tensor_layouts(folder: Path, kind: str) -> None:
    tensor = torch.ones(2, 3).to_sparse() if kind == "sparse" else torch.ones(2, 3, device="meta")
    load_or_refuse(put(folder, kind + ".pt", pt_bytes({"logical_count": tensor})))


@pytest.mark.xfail(strict=True, reason="sim/trace.py Trace: counts beyond int64 (1e19 in JSON, uint64 2**63 "
                   "in .npz) wrap negative in astype(int64) and are refused with a misleading "
                   "'got shape [1, 0, E]' (all layers dropped as empty), not as out of range")
@pytest.mark.parametrize("content, suffix", [
    (b'{"logical_count": [[1e19, 1]]}', ".json"),
    (npz_bytes(logical_count=np.array([[2**63, 1]], dtype=np.uint64)), ".npz"),
])
def test_defect_counts_beyond_int64(folder: Path, content: bytes, suffix: str) -> None:
    with pytest.raises(InputError, match="range|large|int64"):
        load_trace(put(folder, "big" + suffix, content))


@pytest.mark.xfail(strict=True, reason="sim/trace.py _load_json: window_seconds true is taken as 1.0 s "
                   "(bool passes isinstance(int))")
def test_defect_window_seconds_bool(folder: Path) -> None:
    path = put(folder, "ws.json", b'{"logical_count": [[1]], "window_seconds": true}')
    with pytest.raises(InputError):
        load_trace(path)


@pytest.mark.xfail(strict=True, reason="sim/trace.py _load_jsonl: float and string expert ids are truncated "
                   "or parsed (int(2.5) == 2, int('1') == 1) instead of refused")
@pytest.mark.parametrize("expert", ["2.5", '"1"'])
def test_defect_jsonl_non_integer_ids(folder: Path, expert: str) -> None:
    path = put(folder, "ids.jsonl", b'{"token_idx": 0, "layer": 0, "experts": [%s]}\n' % expert.encode())
    with pytest.raises(InputError):
        load_trace(path)


@pytest.mark.xfail(strict=True, reason="sim/trace.py _load_pt: a bad .pt file is refused with torch's "
                   "whole multi-line message (weights_only explanation) inside the one-line InputError")
def test_defect_pt_message_lines(folder: Path) -> None:
    with pytest.raises(InputError) as info:
        load_trace(put(folder, "garbage.pt", b"\x80\x02garbage"))
    assert "\n" not in str(info.value)


@pytest.mark.xfail(strict=True, reason="sim/generate.py deepseek_v3_sources (datasets.load_deepseek_v3): a "
                   "[T, L, E] counts file escapes as IndexError (only ValueError/KeyError/TypeError are "
                   "caught); `trace make --source` now reads sources through rebalancer.formats instead")
def test_defect_generate_sources_of_rank_3(folder: Path) -> None:
    from rebalancer.sim.generate import deepseek_v3_sources

    path = put(folder, "steps.json", json.dumps({"logical_count": [[[1, 2, 3, 4], [4, 3, 2, 1]]] * 2}).encode())
    with pytest.raises(InputError):
        deepseek_v3_sources([path])


@pytest.mark.xfail(strict=True, reason="sim/generate.py TraceGenConfig: top_k above the number of experts is "
                   "accepted (each token is counted top_k times among fewer experts)")
def test_defect_generate_top_k_above_experts() -> None:
    from rebalancer.sim.generate import TraceGenConfig, make_trace

    sources = {"a": np.array([[1.0, 2.0, 3.0, 4.0]])}
    with pytest.raises(InputError):
        make_trace(sources, TraceGenConfig(windows=1, tokens_per_window=4, top_k=9))
