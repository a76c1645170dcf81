"""Replicas in the simulator: a pool that learns from every member's windows against
members that learn alone, and a member that joins warm or trivial (rebalancer.sim.replicas).

On four real DeepSeek-V3 layers (the sim fixtures' `sources`), a phase trace, and replica
windows small enough that one member's counts are mostly sampling noise."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from rebalancer.cli import main
from rebalancer.controller.decide import PolicyConfig
from rebalancer.errors import InputError
from rebalancer.sim import SimConfig, TraceGenConfig, make_trace
from rebalancer.sim.replicas import ReplicaConfig, sample_replicas, simulate_replicas
from rebalancer.sim.trace import Trace
from rebalancer.wire.shape import ClusterShape

G, P = 8, 288


def _config(trace: Trace) -> SimConfig:
    shape = ClusterShape(
        num_layers=trace.num_layers, num_logical=trace.num_experts, num_slots=P, num_gpus=G
    )
    return SimConfig(shape=shape, policy=PolicyConfig(max_moved_fraction=1.0))


@pytest.fixture(scope="module")
def trace(sources: dict[str, np.ndarray]) -> Trace:
    return make_trace(
        sources,
        TraceGenConfig(
            kind="phase",
            windows=40,
            tokens_per_window=8192,
            phase_min_windows=8,
            phase_max_windows=14,
            seed=5,
        ),
    )


def test_replica_windows_are_independent_draws_of_the_window_routing(trace: Trace) -> None:
    counts = sample_replicas(trace, 3, 100, 8, np.random.default_rng(1))
    assert counts.shape == (3, *trace.counts.shape) and counts.dtype == np.int64
    assert (counts.sum(axis=3) == 800).all()  # every replica window: 100 tokens x 8 picks per layer
    assert not np.array_equal(counts[0], counts[1])
    np.testing.assert_array_equal(
        counts, sample_replicas(trace, 3, 100, 8, np.random.default_rng(1))
    )
    # Drawn from each window's own routing: an expert no token of a window picked stays empty.
    skewed = Trace(np.array([[[0, 5, 5]], [[9, 0, 1]]]))
    draws = sample_replicas(skewed, 4, 50, 2, np.random.default_rng(0))
    assert (draws[:, 0, 0, 0] == 0).all() and (draws[:, 1, 0, 1] == 0).all()
    assert (draws[:, 1, 0, 0] > draws[:, 1, 0, 2]).all()


def test_a_pool_of_one_is_the_deployment_alone(trace: Trace) -> None:
    out = simulate_replicas(trace, _config(trace), ReplicaConfig(replicas=1, tokens_per_window=64))
    assert out["pooled"] == out["per_deployment"]


@pytest.fixture(scope="module")
def pool_of_eight(trace: Trace) -> dict:
    return simulate_replicas(
        trace, _config(trace), ReplicaConfig(replicas=8, tokens_per_window=64, seed=2)
    )


def test_a_pool_learns_from_every_member_and_serves_better_than_each_alone(
    pool_of_eight: dict,
) -> None:
    pooled, alone = pool_of_eight["pooled"], pool_of_eight["per_deployment"]
    assert pooled["members"] == alone["members"] == 8
    assert pooled["relative_throughput"] > alone["relative_throughput"]
    assert pooled["mean_balancedness"] > alone["mean_balancedness"]


def test_a_warm_member_starts_at_the_pools_balance_and_a_trivial_one_below(
    pool_of_eight: dict,
) -> None:
    out = pool_of_eight
    assert out["join_window"] == 20
    assert out["warm_first_window_ratio"] >= 0.97
    assert out["trivial_first_window_ratio"] < out["warm_first_window_ratio"] - 0.1
    assert len(out["warm_first_windows"]) == len(out["trivial_first_windows"]) == 5


@pytest.mark.parametrize(
    "bad, message",
    [
        (ReplicaConfig(replicas=0), "replicas must be >= 1"),
        (ReplicaConfig(replicas=2, tokens_per_window=0), "tokens_per_window must be >= 1"),
        (ReplicaConfig(replicas=2, join_window=40), r"join_window must be in \[1, 39\], got 40"),
    ],
)
def test_bad_replica_settings_are_refused(trace: Trace, bad: ReplicaConfig, message: str) -> None:
    with pytest.raises(InputError, match=message):
        simulate_replicas(trace, _config(trace), bad)


def test_cli_carries_the_replica_figures(tmp_path: Path, trace: Trace, capsys) -> None:
    short = dataclasses.replace(trace, counts=trace.counts[:12])
    short.save(tmp_path / "t.npz")
    args = [
        "simulate",
        "--trace",
        str(tmp_path / "t.npz"),
        "--gpus",
        str(G),
        "--slots",
        str(P),
        "--policy",
        "none",
    ]
    assert main([*args, "--replicas", "2", "--replica-tokens", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["policy"] == "none"
    replicas = out["replicas"]
    for key in ("relative_throughput", "slots_moved", "mean_balancedness"):
        assert key in replicas["pooled"] and key in replicas["per_deployment"]
    assert 0 < replicas["warm_first_window_ratio"] and replicas["tokens_per_window"] == 64
    assert main([*args, "--replica-tokens", "64"]) == 2
    assert (
        "--replica-tokens, --replica-top-k and --join-window need --replicas"
        in capsys.readouterr().err
    )
