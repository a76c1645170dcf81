"""The simulator's inputs out of range or of the wrong type: one-line InputErrors naming
what is wrong, before anything large is allocated (invariant 6, ARCHITECTURE.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from rebalancer.controller.cost import (
    MAX_WINDOW_SECONDS,
    REFERENCE,
    check_window_seconds,
    derived_timing,
)
from rebalancer.errors import InputError
from rebalancer.sim import CostModel
from rebalancer.sim.generate import TraceGenConfig, make_trace
from rebalancer.sim.trace import MAX_JSONL_ID, MAX_TRACE_CELLS, Trace, load_trace
from rebalancer.wire.shape import ClusterShape, check_expert_bytes


def _jsonl(tmp_path: Path, *records: dict) -> Path:
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "setting, match",
    [
        ({"moe_fraction": [1]}, "moe_fraction must be a number"),
        ({"moe_fraction": 0}, r"moe_fraction must be in \(0, 1\]"),
        ({"fixed_seconds_per_layer": "x"}, "fixed_seconds_per_layer must be a number or null"),
        ({"seconds_per_token": {}}, "seconds_per_token must be a number or null"),
        ({"plan_overhead_seconds": 10**400}, "plan_overhead_seconds must be finite"),
        ({"periodic_stall_seconds": float("nan")}, "periodic_stall_seconds must be finite"),
        ({"periodic_stall_seconds": -1.0}, "periodic_stall_seconds must be >= 0"),
    ],
)
def test_cost_model_types_and_ranges(setting: dict, match: str) -> None:
    with pytest.raises(InputError, match=match):
        dataclasses.replace(CostModel(), **setting).validate()


def test_cost_model_defaults_and_nulls_are_valid() -> None:
    CostModel().validate()
    CostModel(fixed_seconds_per_layer=None, seconds_per_token=0.0).validate()


@pytest.mark.parametrize(
    "value, match",
    [
        ("x", "expert_bytes must be an integer"),
        (1.5, "expert_bytes must be an integer"),
        (True, "expert_bytes must be an integer"),
        (2**70, r"expert_bytes must be in \[0, 2\*\*40\]"),
        (-1, r"expert_bytes must be in \[0, 2\*\*40\]"),
    ],
)
def test_expert_bytes_types_and_ranges(value: object, match: str) -> None:
    """The simulated deployment's expert bytes are its shape's, checked by the shape's
    one rule (what a Register's shape is held to)."""
    shape = ClusterShape(num_layers=2, num_logical=8, num_slots=8, num_gpus=4)
    with pytest.raises(InputError, match=match):
        dataclasses.replace(shape, expert_bytes=value).validate()
    assert check_expert_bytes(2**40) == 2**40


@pytest.mark.parametrize(
    "value", [0, -1.0, float("nan"), float("inf"), 1e308, 10**400, True, "5", None]
)
def test_window_seconds_refused(value: object) -> None:
    with pytest.raises(InputError, match="window_seconds"):
        check_window_seconds(value)


def test_window_seconds_bounds_accepted() -> None:
    assert check_window_seconds(MAX_WINDOW_SECONDS) == MAX_WINDOW_SECONDS
    assert check_window_seconds(np.float32(0.5)) == 0.5
    assert check_window_seconds(3) == 3.0


def test_derived_timing_refuses_windows_out_of_range() -> None:
    """`simulate --window-seconds 1e308` overflowed in _ceil_tenth (OverflowError)."""
    for seconds in (1e308, float("inf"), 0.0):
        with pytest.raises(InputError, match="window_seconds"):
            derived_timing(
                0.3, 0.02, 0.25, deployment=dataclasses.replace(REFERENCE, window_seconds=seconds)
            )
    longest = derived_timing(
        0.3,
        0.02,
        0.25,
        deployment=dataclasses.replace(REFERENCE, window_seconds=MAX_WINDOW_SECONDS),
    )
    assert np.isfinite(longest.min_interval_seconds)


def test_load_trace_window_override(tmp_path: Path) -> None:
    Trace(np.ones((1, 1, 2)), 2.0, "t").save(tmp_path / "t.npz")
    for seconds in (1e308, -1.0, float("nan")):
        with pytest.raises(InputError, match="window seconds must be in"):
            load_trace(tmp_path / "t.npz", window_seconds=seconds)
    assert (
        load_trace(tmp_path / "t.npz", window_seconds=MAX_WINDOW_SECONDS).window_seconds
        == MAX_WINDOW_SECONDS
    )


def test_npz_window_seconds_of_wrong_type(tmp_path: Path) -> None:
    np.savez(tmp_path / "t.npz", logical_count=np.ones((1, 1, 2)), window_seconds=np.array(True))
    with pytest.raises(InputError, match="window_seconds must be one number"):
        load_trace(tmp_path / "t.npz")


def test_jsonl_ids_bounded_before_allocating(tmp_path: Path) -> None:
    top = MAX_JSONL_ID - 1
    with pytest.raises(InputError, match=r"expert id 1048576 out of range \[0, 2\*\*20\)"):
        load_trace(_jsonl(tmp_path, {"token_idx": 0, "layer": 0, "experts": [MAX_JSONL_ID]}))
    with pytest.raises(InputError, match=r"layer -1 out of range"):
        load_trace(_jsonl(tmp_path, {"token_idx": 0, "layer": -1, "experts": [0]}))
    # each id in range, but together a [1, 2**20, 2**20] array: refused by its size
    with pytest.raises(InputError, match=r"more than the limit of 2\*\*27"):
        load_trace(_jsonl(tmp_path, {"token_idx": 0, "layer": top, "experts": [top]}))
    # the largest id alone is fine where the array stays small
    trace = load_trace(_jsonl(tmp_path, {"token_idx": 0, "layer": 0, "experts": [top]}))
    assert trace.counts.shape == (1, 1, MAX_JSONL_ID) and trace.counts.size <= MAX_TRACE_CELLS


@pytest.mark.parametrize(
    "record, match",
    [
        ({"token_idx": 0, "layer": 0, "experts": "12"}, "experts must be a list"),
        ({"token_idx": 0, "layer": True, "experts": [1]}, "layer must be an integer"),
        (
            {"token_idx": 0.5, "layer": 0, "experts": [1]},
            "token_idx must be an integer or a string",
        ),
        ({"problem_id": [0], "token_idx": 0, "layer": 0, "experts": [1]}, "problem_id must be"),
        ({"layer": 0, "experts": [1]}, "no 'token_idx'"),
    ],
)
def test_jsonl_records_of_wrong_type(tmp_path: Path, record: dict, match: str) -> None:
    with pytest.raises(InputError, match=r"r\.jsonl:1: .*" + match):
        load_trace(_jsonl(tmp_path, record))


@pytest.mark.parametrize("num_experts", [0, -1, 2**20 + 1, 2**40, True])
def test_jsonl_num_experts_bounded(tmp_path: Path, num_experts: int) -> None:
    with pytest.raises(InputError, match="num_experts"):
        load_trace(
            _jsonl(tmp_path, {"token_idx": 0, "layer": 0, "experts": [1]}), num_experts=num_experts
        )


def test_jsonl_line_number_in_errors(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"token_idx": 0, "layer": 0, "experts": [1]}\n\n\xc3\x28\n')
    with pytest.raises(InputError, match=r"r\.jsonl:3: not UTF-8 text"):
        load_trace(path)


def test_generator_sizes_bounded() -> None:
    sources = {"a": np.ones((4, 64))}
    with pytest.raises(InputError, match="top_k"):
        make_trace(sources, TraceGenConfig(windows=1, tokens_per_window=4, top_k=65))
    with pytest.raises(InputError, match=r"limit of 2\*\*27"):
        make_trace(sources, TraceGenConfig(windows=2**30, tokens_per_window=4, top_k=2))
    with pytest.raises(InputError, match=r"more than 2\*\*62"):
        make_trace(sources, TraceGenConfig(windows=1, tokens_per_window=2**62, top_k=2))
    with pytest.raises(InputError, match="window_seconds"):
        make_trace(sources, TraceGenConfig(windows=1, window_seconds=float("inf")))
