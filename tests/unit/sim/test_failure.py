"""`rebalancer simulate --fail/--fail-node`: the failure specs, and the three ways compared
on a real-data drift trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rebalancer.cli import main
from rebalancer.errors import InputError
from rebalancer.sim import TraceGenConfig, make_trace
from rebalancer.sim.failure import FAILURE_WAYS, Failure, check_window, parse_at, parse_failures


@pytest.mark.parametrize(
    "spec, expected", [("3@10", (3, 10)), (" 0 @ 0 ", (0, 0)), ("31@7", (31, 7))]
)
def test_parse_at_reads_index_and_window(spec: str, expected: tuple[int, int]) -> None:
    assert parse_at(spec, "--fail", "RANK") == expected


@pytest.mark.parametrize("spec", ["3", "3@", "@4", "a@1", "-1@2", "3@1.5", "3@4@5", ""])
def test_parse_at_refuses_malformed_specs(spec: str) -> None:
    with pytest.raises(InputError, match="--fail: expected RANK@WINDOW"):
        parse_at(spec, "--fail", "RANK")


def test_parse_failures_expands_nodes_and_joins_ranks() -> None:
    # G=32 in 4 nodes of 8: node 1 is ranks 8..15; rank 9 is in it already, rank 30 not
    failure = parse_failures(["9@4", "30@4"], ["1@4"], num_gpus=32, num_nodes=4)
    assert failure == Failure(tuple(range(8, 16)) + (30,), 4)
    assert parse_failures([], [], 32, 4) is None


@pytest.mark.parametrize(
    "ranks, nodes, message",
    [
        (["32@1"], [], "rank 32 is out of range"),
        ([], ["4@1"], "node 4 is out of range"),
        (["1@1", "2@3"], [], "same window"),
        ([], ["0@1", "1@1"], "none survives"),
    ],
)
def test_parse_failures_refuses_what_the_group_cannot_lose(
    ranks: list[str], nodes: list[str], message: str
) -> None:
    with pytest.raises(InputError, match=message):
        parse_failures(ranks, nodes, num_gpus=16, num_nodes=2)


def test_check_window_refuses_a_window_beyond_the_trace() -> None:
    check_window(Failure((1,), 5), num_windows=6)
    with pytest.raises(InputError, match="beyond the trace"):
        check_window(Failure((1,), 6), num_windows=6)


G, P, N = 8, 320, 2  # a rank loss leaves 280 slots for 256 experts, a node loss 160


@pytest.fixture
def drift_trace(tmp_path: Path, sources: dict[str, np.ndarray]) -> Path:
    trace = make_trace(sources, TraceGenConfig(kind="phase", windows=8, seed=1))
    path = tmp_path / "phase.npz"
    trace.save(path)
    return path


def _simulate(trace: Path, *extra: str) -> list[str]:
    return [
        "simulate",
        "--trace",
        str(trace),
        "--gpus",
        str(G),
        "--slots",
        str(P),
        "--nodes",
        str(N),
        "--policy",
        "static",
        "--json",
        *extra,
    ]


def test_cli_failure_planned_beats_repair_and_moves_less_than_scratch(
    drift_trace: Path, capsys
) -> None:
    assert main(_simulate(drift_trace, "--fail", "3@4")) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    failure = out["failure"]
    assert failure["lost"] == [3] and failure["window"] == 4 and failure["survivors"] == G - 1
    for way in FAILURE_WAYS:
        assert set(failure[way]) == {"balancedness_after", "slots_moved", "relative_throughput"}
    planned, repair, scratch = failure["planned"], failure["repair"], failure["scratch"]
    assert planned["balancedness_after"] > repair["balancedness_after"]
    assert planned["relative_throughput"] > repair["relative_throughput"]
    assert planned["slots_moved"] < scratch["slots_moved"] / 2
    assert 0 < repair["slots_moved"] <= planned["slots_moved"]  # the repair refills the fewest


def test_cli_node_loss_without_room_says_so(drift_trace: Path, capsys) -> None:
    # G=8 in 2 nodes, 40 slots a GPU: a lost node leaves 160 slots for 256 experts
    assert main(_simulate(drift_trace, "--fail-node", "1@2")) == 0
    failure = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["failure"]
    assert failure["lost"] == [4, 5, 6, 7] and failure["feasible"] is False
    assert failure["planned"]["balancedness_after"] is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fail", "8@1"], "rank 8 is out of range"),
        (["--fail", "1@8"], "beyond the trace"),
        (["--fail", "1-3"], "expected RANK@WINDOW"),
        (["--fail-node", "2@1"], "node 2 is out of range"),
    ],
)
def test_cli_bad_failure_is_one_line_and_exit_2(
    drift_trace: Path, capsys, extra: list[str], message: str
) -> None:
    assert main(_simulate(drift_trace, *extra)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing replayed
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
