"""The per-step model: dispatch modes on steps drawn from real DeepSeek-V3 routing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rebalancer.cli import main
from rebalancer.errors import InputError
from rebalancer.placement.metrics import (
    dispatch_allocation,
    expected_gpu_loads,
    gpu_replicas,
    round_allocation,
    split_allocation,
    waterfill,
)
from rebalancer.sim import SimConfig, TraceGenConfig, make_trace, simulate
from rebalancer.sim.steps import (
    StepConfig,
    attach_step_balance,
    decide_under_modes,
    sample_step,
    step_balance,
)
from rebalancer.wire.dispatch import WATERFILL_UNITS, waterfill_tables
from rebalancer.wire.shape import ClusterShape

G, P = 8, 40


@pytest.fixture(scope="module")
def sources(sources: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The conftest's four real layers, the first 32 experts: the real skew at a small shape."""
    return {name: counts[:, :32] for name, counts in sources.items()}


@pytest.mark.parametrize("passes", [1, 4, 8])
def test_waterfill_keeps_every_token_on_a_gpu_holding_its_expert(passes: int) -> None:
    rng = np.random.default_rng(passes)
    L, X = 3, 12
    replicas = (rng.random((L, X, G)) < 0.3).astype(np.int64)
    replicas[:, :, 0] |= replicas.sum(axis=2) == 0
    tables = waterfill_tables(replicas)
    held = tables[:, 0] > 0
    demand = rng.integers(0, 500, size=(L, X))
    start = demand[..., None] * tables[:, 2] // tables[:, 3]  # the split of all-remote tokens
    base = rng.integers(0, 300, size=(L, G)) * WATERFILL_UNITS
    share = waterfill(demand * WATERFILL_UNITS, start, tables[:, 1], base, passes)
    assert share.dtype == np.int64 and (share[~held] == 0).all() and (share >= 0).all()
    # floors lose under a unit per (expert, GPU) and step of the fill
    lost = demand * WATERFILL_UNITS - share.sum(axis=2)
    assert (lost >= 0).all() and (lost <= 2 * G * (passes + 1)).all()
    assert (lost < WATERFILL_UNITS).all()  # under a token per expert: rounding absorbs it
    peak = (base + share.sum(axis=1)).max(axis=1)
    start_peak = (base + start.sum(axis=1)).max(axis=1)
    assert (peak <= start_peak).all()  # never worse
    assert (peak < start_peak).any()  # and better somewhere
    whole = round_allocation(share, demand, tables[:, 4])
    np.testing.assert_array_equal(whole.sum(axis=2), demand)
    assert (whole[~held] == 0).all() and (whole >= 0).all()


def test_expected_loads_scale_to_integer_units_and_back(sources: dict[str, np.ndarray]) -> None:
    """The controller's prediction fills fractional loads in integer units, scaled per
    layer: the total is kept, and the result does not depend on the load's scale."""
    counts = sum(sources.values())
    from rebalancer.placement import compute_placement

    ph = np.asarray(compute_placement(counts, P, G, algorithm="greedy").phy2log)
    split = expected_gpu_loads(ph, counts, G, "split", counts.sum(axis=1) / 8)
    for mode in ("load", "load+shared"):
        exp = expected_gpu_loads(ph, counts, G, mode, counts.sum(axis=1) / 8)
        np.testing.assert_allclose(exp.sum(axis=1), counts.sum(axis=1) * 9 / 8, rtol=1e-6)
        assert (exp.max(axis=1) <= split.max(axis=1) * (1 + 1e-9)).all()
        tiny = expected_gpu_loads(ph, counts / 3e6, G, mode, counts.sum(axis=1) / 8 / 3e6)
        np.testing.assert_allclose(tiny * 3e6, exp, rtol=1e-6)
    empty = expected_gpu_loads(
        ph, np.zeros_like(counts), G, "load+shared", np.zeros(counts.shape[0])
    )
    assert (empty == 0).all()


def test_modes_order_on_real_routing(sources: dict[str, np.ndarray]) -> None:
    counts = sum(sources.values())
    from rebalancer.placement import compute_placement

    ph = np.asarray(compute_placement(counts, P, G, algorithm="greedy").phy2log)
    rng = np.random.default_rng(1)
    step = sample_step(rng, counts / counts.sum(axis=1, keepdims=True), G, 64, 8)
    assert step.shape == (4, G, 32) and (step.sum(axis=2) == 64 * 8).all()
    shared = np.full((4, G), 64)
    rep = gpu_replicas(ph, 32, G)
    peaks = {
        m: dispatch_allocation(step, rep, m, shared).sum(axis=1).max(axis=1).sum()
        for m in ("split", "load", "load+shared")
    }
    assert peaks["load+shared"] < peaks["load"] < peaks["split"]
    np.testing.assert_allclose(split_allocation(step, rep).sum(axis=(1, 2)), step.sum(axis=(1, 2)))
    # The controller's view (average load): dispatch by load never predicts worse.
    exp = {
        m: expected_gpu_loads(ph, counts, G, m, counts.sum(axis=1) / 8).max(axis=1).sum()
        for m in ("split", "load", "load+shared")
    }
    assert exp["load+shared"] <= exp["load"] <= exp["split"]


def test_step_balance_per_policy_and_mode(sources: dict[str, np.ndarray]) -> None:
    trace = make_trace(
        sources, TraceGenConfig(kind="phase", windows=8, seed=3, tokens_per_window=4096)
    )
    config = SimConfig(
        shape=ClusterShape(
            num_layers=trace.num_layers, num_logical=trace.num_experts, num_slots=P, num_gpus=G
        )
    )
    results = simulate(trace, config, ["static", "adaptive"])
    steps = StepConfig(batch_tokens=(64, 4096), sampled_windows=4)
    attach_step_balance(results, trace, G, steps)
    for r in results.values():
        assert len(r.placements) == trace.num_windows
        for batch in ("64", "4096"):
            modes = r.dispatch[batch]
            assert modes["split"]["vs_split"] == 1.0
            assert modes["load"]["vs_split"] >= 1.0
            assert modes["load+shared"]["vs_split"] >= modes["load"]["vs_split"]
            for figures in modes.values():
                assert 0 < figures["relative_step_throughput"] <= 1.0
                assert figures["steps"] == 4
        # Larger batches average out the per-step noise: split is closer to its ideal.
        assert (
            r.dispatch["4096"]["split"]["relative_step_throughput"]
            > r.dispatch["64"]["split"]["relative_step_throughput"]
        )
    again = step_balance(trace, results["static"].placements, G, steps)
    assert again == results["static"].dispatch  # the same draws: deterministic


def test_adaptive_decides_under_each_mode(sources: dict[str, np.ndarray]) -> None:
    """The adaptive policy deciding under a load mode judges placements by the water-filled
    balance (`predicted_balance`), so it sees less to gain and plans no more than under
    split; each mode's figures then come from the placements of its own run."""
    trace = make_trace(
        sources, TraceGenConfig(kind="phase", windows=12, seed=5, tokens_per_window=4096)
    )
    config = SimConfig(
        shape=ClusterShape(
            num_layers=trace.num_layers, num_logical=trace.num_experts, num_slots=P, num_gpus=G
        )
    )
    steps = StepConfig(batch_tokens=(64,), sampled_windows=6)
    decided = decide_under_modes(trace, config, steps)
    assert set(decided) == {"split", "load", "load+shared"}
    plain = simulate(trace, config, ["adaptive"])["adaptive"]
    assert (
        decided["split"].rebalances == plain.rebalances
    )  # split is what the plain run decides under
    for got, want in zip(decided["split"].placements, plain.placements, strict=True):
        np.testing.assert_array_equal(got, want)
    assert decided["load+shared"].rebalances <= decided["split"].rebalances
    assert decided["load"].rebalances <= decided["split"].rebalances
    results = {"adaptive": plain}
    attach_step_balance(results, trace, G, steps, decided)
    by_mode = {m: r.placements for m, r in decided.items()}
    assert plain.dispatch == step_balance(trace, by_mode, G, steps)
    assert plain.summary()["decided_under_mode"]["split"]["rebalances"] == plain.rebalances
    only_split = step_balance(
        trace, dict.fromkeys(steps.modes, decided["split"].placements), G, steps
    )
    assert (
        only_split["64"]["split"] == plain.dispatch["64"]["split"]
    )  # split's own run is the baseline
    with pytest.raises(InputError, match="no placements for dispatch mode 'load'"):
        step_balance(trace, {"split": plain.placements}, G, steps)


def test_step_config_refuses_bad_values() -> None:
    for bad in (
        StepConfig(batch_tokens=()),
        StepConfig(batch_tokens=(0,)),
        StepConfig(modes=("even",)),
        StepConfig(sampled_windows=0),
        StepConfig(waterfill_passes=0),
        StepConfig(waterfill_passes=True),
    ):  # type: ignore[arg-type]
        with pytest.raises(InputError):
            bad.validate()


def test_cli_dispatch_json(tmp_path: Path, sources: dict[str, np.ndarray], capsys) -> None:
    make_trace(sources, TraceGenConfig(kind="mix", windows=4, seed=4, tokens_per_window=4096)).save(
        tmp_path / "m.npz"
    )
    base = ["simulate", "--trace", str(tmp_path / "m.npz"), "--gpus", str(G), "--slots", str(P)]
    args = [
        *base,
        "--policy",
        "static,adaptive",
        "--dispatch",
        "all",
        "--batch-tokens",
        "128",
        "--step-windows",
        "2",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "load+shared" in out  # the table
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last["adaptive"]["dispatch"]["128"]) == {"split", "load", "load+shared"}
    assert set(last["adaptive"]["decided_under_mode"]) == {"split", "load", "load+shared"}
    assert main([*base, "--batch-tokens", "128"]) == 2
    assert "need --dispatch" in capsys.readouterr().err
    assert main([*base, "--dispatch", "hash"]) == 2
    assert main([*base, "--dispatch", "load", "--batch-tokens", "x"]) == 2
