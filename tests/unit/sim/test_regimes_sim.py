"""The regimes policy in the simulator (`--policy regimes`, in `all`): the same loop,
coordinator and costs as adaptive; on a phase trace whose workloads come back it
recognises the returns and serves them at least as well as adaptive, moving no more."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rebalancer.cli import main as cli
from rebalancer.controller.regimes import RegimeConfig
from rebalancer.sim import POLICIES, SimConfig, TraceGenConfig, make_trace, simulate


def _trace(sources: dict[str, np.ndarray], windows: int = 60, seed: int = 5):  # type: ignore[no-untyped-def]
    two = dict(list(sources.items())[:3])  # three workloads over 60 windows: they come back
    return make_trace(
        two,
        TraceGenConfig(
            kind="phase",
            windows=windows,
            tokens_per_window=16384,
            phase_min_windows=6,
            phase_max_windows=9,
            window_seconds=5.0,
            seed=seed,
        ),
    )


def test_regimes_is_a_policy_of_all() -> None:
    assert "regimes" in POLICIES


def test_returning_phases_are_recognised_and_served_no_worse_than_adaptive(
    sources: dict[str, np.ndarray],
) -> None:
    trace = _trace(sources)
    config = SimConfig.for_trace(trace, num_slots=288, num_gpus=8, num_nodes=2)
    results = simulate(trace, config, ["adaptive", "regimes"])
    adaptive, regimes = results["adaptive"], results["regimes"]
    loads = [entry["decision"].load for entry in regimes.decision_log]
    assert all(loads) and not any(entry["decision"].load for entry in adaptive.decision_log)
    assert any("recognised" in load for load in loads)
    assert regimes.relative_throughput >= adaptive.relative_throughput - 0.002
    assert regimes.slots_moved <= 1.2 * adaptive.slots_moved
    library = regimes.decision_log[-1]["decision"].state
    assert 2 <= len(library.regimes) <= 16 and library.windows == trace.num_windows


def test_simulate_cli_runs_the_regimes_policy(
    sources: dict[str, np.ndarray], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.npz"
    _trace(sources, windows=12).save(path)
    code = cli(
        [
            "simulate",
            "--trace",
            str(path),
            "--gpus",
            "8",
            "--slots",
            "288",
            "--nodes",
            "2",
            "--policy",
            "regimes",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["policy"] == "regimes" and out["windows"] == 12
    assert sum(out["decisions"].values()) > 0


def test_from_the_trivial_placement_regimes_moves_after_the_first_window_adaptive_after_two(
    sources: dict[str, np.ndarray],
) -> None:
    trace = _trace(sources, windows=16)
    config = SimConfig.for_trace(trace, num_slots=288, num_gpus=8, num_nodes=2)
    results = simulate(trace, config, ["adaptive", "regimes"])
    adaptive, regimes = results["adaptive"], results["regimes"]

    def first_take(result) -> int:  # type: ignore[no-untyped-def]
        return min(e["window"] for e in result.decision_log if e["decision"].take)

    assert first_take(regimes) == 0 and first_take(adaptive) == 1
    # The second window is served (in part) by the new placement, not the trivial one.
    assert regimes.balancedness_per_window[1] > adaptive.balancedness_per_window[1] + 0.05
    # Every plan it started is in its library's tally, the extra ones within their share.
    library = regimes.decision_log[-1]["decision"].state
    assert library.slots_main + library.slots_extra == regimes.slots_moved
    assert library.slots_extra <= RegimeConfig().extra_slots_share * library.slots_main
