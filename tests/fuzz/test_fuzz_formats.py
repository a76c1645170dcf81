"""Fuzz the count and placement files (rebalancer/formats.py) and the simulator's trace
files (rebalancer/sim/trace.py): random bytes, truncated and bit-flipped valid files,
valid JSON of the wrong structure, huge numbers, NaN. Every refusal is an InputError with
one line; every file that loads is a valid one; write -> read is the identity."""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rebalancer.errors import InputError
from rebalancer.formats import (
    load_counts,
    read_placement,
    write_placement,
    write_sglang_expert_location,
)
from tests.fuzz.file_helpers import mutate, mutations, npz_bytes, pt_bytes

torch = pytest.importorskip("torch")

COUNT_SUFFIXES = [".json", ".npz", ".pt", ".pth", ".txt", ""]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("fuzz_formats")


def put(folder: Path, name: str, content: bytes) -> Path:
    path = folder / name
    path.write_bytes(content)
    return path


def one_line_input_error(fn, path: Path):  # type: ignore[no-untyped-def]
    """fn(path), or None after an InputError of one line that names the file."""
    try:
        return fn(path)
    except InputError as exc:
        message = str(exc)
        assert message and "\n" not in message, repr(message)
        assert str(path) in message or "JSON" in message or "torch" in message, message
        return None


# ------------------------------------------------------------------ strategies

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)
numbers = st.one_of(
    st.integers(0, 100),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**400, 2**64, 2**63, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)


@st.composite
def count_lists(draw: st.DrawFn) -> object:
    """[L][E] or [T][L][E] lists of numbers, sometimes ragged, sometimes with bad entries."""
    ndim = draw(st.sampled_from([1, 2, 2, 3]))
    shape = draw(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim))
    good = st.integers(0, 1000) | st.floats(0, 1e6)
    elements = good if draw(st.booleans()) else numbers

    def build(dims: list[int]) -> object:
        if not dims:
            return draw(elements)
        width = dims[0] + (draw(st.integers(-1, 1)) if draw(st.integers(0, 9)) == 0 else 0)
        return [build(dims[1:]) for _ in range(max(width, 0))]

    return build(shape)


def dumps(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


# ------------------------------------------------------------------ counts


def check_counts(arr: np.ndarray | None) -> None:
    if arr is None:
        return
    assert arr.dtype == np.float64 and arr.ndim == 2 and arr.size > 0
    assert np.isfinite(arr).all() and (arr >= 0).all()


@given(st.sampled_from(COUNT_SUFFIXES), st.binary(max_size=300))
@example(suffix=".npz", content=b"PK\x03\x04garbage")  # zipfile.BadZipFile escaped
@example(suffix=".npz", content=b"")  # EOFError escaped
@example(
    suffix=".npz",
    content=b"\x93NUMPY\x01\x00v\x00{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }",
)
@example(suffix=".json", content=b"[" * 100_000)  # RecursionError escaped
def test_counts_random_bytes(folder: Path, suffix: str, content: bytes) -> None:
    check_counts(one_line_input_error(load_counts, put(folder, "random" + suffix, content)))


@given(count_lists(), st.sampled_from(["json", "npz", "pt"]))
@example(counts=[[10**400]], kind="json")  # OverflowError escaped
@example(counts=[[1, 2**64 + 1]], kind="json")
@example(counts=[[True, False]], kind="json")  # booleans taken as counts
@example(counts=[["1", "2"]], kind="json")  # strings taken as counts
@example(counts=[[1.0, float("nan")]], kind="json")
@example(counts=[[524288.09375]], kind="pt")  # float32 in the .pt (the test's own expectation)
@example(counts=[[[2**64]], [[0.0]]], kind="pt")  # ditto
def test_counts_structure(folder: Path, counts: object, kind: str) -> None:
    if kind == "json":
        content = dumps({"logical_count": counts})
    elif kind == "npz":
        try:
            arr = np.asarray(counts)
        except (ValueError, OverflowError):
            return  # not an array numpy can save
        content = npz_bytes(logical_count=arr)
    else:
        try:
            tensor = torch.tensor(counts)
        except (ValueError, TypeError, RuntimeError, OverflowError):
            return
        content = pt_bytes({"logical_count": tensor})
    arr = one_line_input_error(load_counts, put(folder, "counts." + kind, content))
    check_counts(arr)
    if arr is not None:  # only well-formed non-negative finite numbers load
        # (torch.tensor makes float32 of Python floats: compare with what it saved)
        expected = tensor.double().numpy() if kind == "pt" else np.asarray(counts, dtype=np.float64)
        expected = expected.sum(axis=0) if expected.ndim == 3 else expected
        assert np.array_equal(arr, expected)
        if kind != "pt":  # (torch.tensor made floats of whatever numbers it got)
            assert np.asarray(counts).dtype.kind in "iuf"


@given(json_values)
@example(value={"logical_count": {"a": 1}})
@example(value={"logical_count": None})
@example(value=[1, 2])
def test_counts_json_of_wrong_structure(folder: Path, value: object) -> None:
    for doc in (value, {"logical_count": value}):
        check_counts(one_line_input_error(load_counts, put(folder, "wrong.json", dumps(doc))))


def _tensor_cases() -> list[object]:
    base = torch.ones(2, 3)
    return [
        {"logical_count": base.to_sparse()},  # TypeError escaped
        {"logical_count": torch.ones(2, 3, device="meta")},  # TypeError escaped
        {
            "logical_count": torch.quantize_per_tensor(base, 0.1, 0, torch.quint8)
        },  # RuntimeError escaped
        {"logical_count": base * 1j},  # imaginary part silently dropped
        {"logical_count": base.bool()},
        {"logical_count": base.to(torch.bfloat16)},
        {"logical_count": [[1, 2]]},
        {"logical_count": "x"},
        {1: 2},
        base,
        [base],
        7,
    ]


@given(st.sampled_from(range(len(_tensor_cases()))), st.sampled_from([".pt", ".pth"]))
def test_counts_torch_objects(folder: Path, index: int, suffix: str) -> None:
    obj = _tensor_cases()[index]
    arr = one_line_input_error(load_counts, put(folder, "obj" + suffix, pt_bytes(obj)))
    check_counts(arr)
    if arr is not None:
        tensor = obj["logical_count"] if isinstance(obj, dict) else obj
        assert isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.float32, torch.bfloat16)


def _valid_count_files() -> dict[str, bytes]:
    counts = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    return {
        ".json": dumps({"logical_count": counts[0].tolist()}),
        ".npz": npz_bytes(logical_count=counts),
        ".pt": pt_bytes({"logical_count": torch.from_numpy(counts)}),
    }


VALID_COUNT_FILES = _valid_count_files()


@given(st.sampled_from(sorted(VALID_COUNT_FILES)), mutations)
@example(suffix=".npz", mutation=([(29, 1)], None))  # EOFError escaped
@example(suffix=".npz", mutation=([(28, 0)], None))  # zlib.error escaped
@example(suffix=".npz", mutation=([], 4))  # zipfile.BadZipFile escaped
def test_counts_mutated_valid_files(folder: Path, suffix: str, mutation: tuple) -> None:
    content = mutate(VALID_COUNT_FILES[suffix], *mutation)
    check_counts(one_line_input_error(load_counts, put(folder, "mutated" + suffix, content)))


def test_counts_oversized_npz_header(folder: Path) -> None:
    """A .npz member whose header declares terabytes: MemoryError escaped."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<f8", "fortran_order": False, "shape": (10**6, 10**7)}
    )
    buf.write(b"\0" * 64)
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as z:
        z.writestr("logical_count.npy", buf.getvalue())
    assert one_line_input_error(load_counts, put(folder, "big.npz", zbuf.getvalue())) is None


@given(
    hnp.arrays(
        st.sampled_from([np.int64, np.int32, np.float32, np.float64]),
        hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=5),
        elements=st.integers(0, 10**6),
    ),
    st.sampled_from(["json", "npz", "pt"]),
)
def test_counts_round_trip(folder: Path, counts: np.ndarray, kind: str) -> None:
    if kind == "json":
        content = dumps({"logical_count": counts.tolist()})
    elif kind == "npz":
        content = npz_bytes(logical_count=counts)
    else:
        content = pt_bytes({"logical_count": torch.from_numpy(counts)})
    got = load_counts(put(folder, "good." + kind, content))
    expected = counts.astype(np.float64)
    assert np.array_equal(got, expected.sum(axis=0) if counts.ndim == 3 else expected)


# ------------------------------------------------------------------ placements


def check_placement(saved) -> None:  # type: ignore[no-untyped-def]
    if saved is None:
        return
    L, P = saved.phy2log.shape
    assert saved.phy2log.dtype == np.int64 and L > 0 and P > 0
    assert P % saved.num_gpus == 0 and saved.num_gpus % saved.num_nodes == 0
    assert 0 < saved.num_logical <= P
    for row in saved.phy2log:
        assert set(row.tolist()) == set(range(saved.num_logical))
    assert saved.version is None or isinstance(saved.version, int)


@st.composite
def valid_placements(draw: st.DrawFn) -> dict:
    N = draw(st.integers(1, 2))
    G = N * draw(st.integers(1, 3))
    E = draw(st.integers(1, 6))
    P = G * draw(st.integers(max(1, math.ceil(E / G)), math.ceil(E / G) + 2))
    L = draw(st.integers(1, 3))
    rows = []
    for _ in range(L):
        row = list(range(E)) + [draw(st.integers(0, E - 1)) for _ in range(P - E)]
        rows.append(draw(st.permutations(row)))
    version = draw(st.one_of(st.none(), st.integers(0, 2**40)))
    return dict(
        phy2log=np.array(rows, np.int64), num_gpus=G, num_nodes=N, num_logical=E, version=version
    )


@st.composite
def broken_placement_docs(draw: st.DrawFn) -> dict:
    """A valid PLACEMENT.json with one key replaced, removed or added."""
    p = draw(valid_placements())
    doc = json.loads(
        json.dumps(
            {
                "format": "rebalancer.placement/v1",
                "num_gpus": p["num_gpus"],
                "num_nodes": p["num_nodes"],
                "num_logical": p["num_logical"],
                "phy2log": p["phy2log"].tolist(),
                "version": p["version"],
            }
        )
    )
    key = draw(
        st.sampled_from(
            ["num_gpus", "num_nodes", "num_logical", "phy2log", "version", "format", "extra"]
        )
    )
    how = draw(st.sampled_from(["replace", "delete", "entry"]))
    if how == "delete":
        doc.pop(key, None)
    elif how == "entry" and doc["phy2log"] and doc["phy2log"][0]:
        doc["phy2log"][draw(st.integers(0, len(doc["phy2log"]) - 1))][0] = draw(
            numbers | json_scalars
        )
    else:
        doc[key] = draw(numbers | json_values | count_lists())
    return doc


@given(broken_placement_docs())
@example(doc={"num_gpus": 1, "phy2log": [[0.5, 1.7]]})  # floats truncated to experts 0, 1
@example(doc={"num_gpus": 1, "phy2log": [[True, False]]})  # booleans taken as experts
@example(doc={"num_gpus": 1, "phy2log": [[10**30]]})  # OverflowError escaped
@example(doc={"num_gpus": 1, "phy2log": [[float("inf")]]})  # OverflowError escaped
@example(doc={"num_gpus": 1, "phy2log": [[0, 1]], "num_logical": 10**11})  # MemoryError (bincount)
@example(doc={"num_gpus": 1, "phy2log": [[0, 10**12]]})  # MemoryError (bincount)
@example(doc={"num_gpus": 1, "phy2log": [[0, 2**64 - 1]]})
def test_placement_documents(folder: Path, doc: dict) -> None:
    check_placement(one_line_input_error(read_placement, put(folder, "placement.json", dumps(doc))))


@given(json_values)
def test_placement_json_of_wrong_structure(folder: Path, value: object) -> None:
    for doc in (value, {"phy2log": value}, {"num_gpus": 1, "phy2log": value}):
        check_placement(one_line_input_error(read_placement, put(folder, "wrong.json", dumps(doc))))


@given(st.sampled_from([".json", ".npz", ""]), st.binary(max_size=200))
@example(suffix=".json", content=b"[" * 100_000)  # RecursionError escaped
@example(suffix=".json", content=b"\xff\xfe")
def test_placement_random_bytes(folder: Path, suffix: str, content: bytes) -> None:
    check_placement(one_line_input_error(read_placement, put(folder, "random" + suffix, content)))


@given(valid_placements(), mutations)
def test_placement_mutated_valid_files(folder: Path, p: dict, mutation: tuple) -> None:
    path = folder / "valid.json"
    write_placement(path, **p)
    content = mutate(path.read_bytes(), *mutation)
    check_placement(one_line_input_error(read_placement, put(folder, "mutated.json", content)))


@given(valid_placements())
def test_placement_round_trip(folder: Path, p: dict) -> None:
    path = folder / "round.json"
    write_placement(path, **p)
    saved = read_placement(path)
    assert np.array_equal(saved.phy2log, p["phy2log"]) and saved.phy2log.dtype == np.int64
    assert (saved.num_gpus, saved.num_nodes, saved.num_logical, saved.version) == (
        p["num_gpus"],
        p["num_nodes"],
        p["num_logical"],
        p["version"],
    )
    sglang = folder / "sglang.json"
    write_sglang_expert_location(sglang, p["phy2log"])
    assert json.loads(sglang.read_text()) == {"physical_to_logical_map": p["phy2log"].tolist()}
