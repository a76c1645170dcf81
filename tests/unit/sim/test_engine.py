"""Simulator: policy ordering on a small real-data trace, and the accounting behind it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rebalancer.cli import main
from rebalancer.controller.decide import PolicyConfig
from rebalancer.errors import InputError
from rebalancer.sim import (
    POLICIES,
    CostModel,
    PeriodicConfig,
    SimConfig,
    TraceGenConfig,
    make_trace,
    simulate,
)
from rebalancer.sim.trace import Trace
from rebalancer.wire.shape import ClusterShape

G, P, N = 8, 288, 2


def _shape(trace: Trace, num_slots: int = P, num_gpus: int = G, num_nodes: int = N) -> ClusterShape:
    """The simulated deployment of `trace`'s layers and experts."""
    return ClusterShape(
        num_layers=trace.num_layers,
        num_logical=trace.num_experts,
        num_slots=num_slots,
        num_gpus=num_gpus,
        num_nodes=num_nodes,
    )


def _config(trace: Trace, start: str = "trivial", **policy: object) -> SimConfig:
    return SimConfig(
        shape=_shape(trace),
        policy=PolicyConfig(max_moved_fraction=1.0).with_settings(policy),
        periodic=PeriodicConfig(period_steps=400, fit_steps=400),
        start=start,
    )


def _phase_trace(sources: dict[str, np.ndarray]) -> Trace:
    cfg = TraceGenConfig(
        kind="phase",
        windows=24,
        tokens_per_window=8192,
        phase_min_windows=6,
        phase_max_windows=10,
        seed=3,
    )
    return make_trace(sources, cfg)


@pytest.fixture(scope="module")
def phase_results(sources: dict[str, np.ndarray]) -> dict:
    trace = _phase_trace(sources)
    return simulate(trace, _config(trace), POLICIES)


def test_oracle_bounds_every_policy(phase_results: dict) -> None:
    oracle = phase_results["oracle"]
    for name, res in phase_results.items():
        assert res.relative_throughput <= oracle.relative_throughput + 1e-12, name
        assert res.mean_balancedness <= oracle.mean_balancedness + 1e-12, name
        assert 0 < res.relative_throughput <= 1.0 and 0 < res.mean_balancedness <= 1.0


def test_none_is_the_floor_of_static(phase_results: dict) -> None:
    assert phase_results["none"].mean_balancedness <= phase_results["static"].mean_balancedness
    assert phase_results["none"].relative_throughput <= phase_results["static"].relative_throughput


def test_frozen_policies_move_nothing(phase_results: dict) -> None:
    for name in ("none", "static"):
        res = phase_results[name]
        assert (res.rebalances, res.slots_moved, res.bytes_moved, res.stall_seconds) == (0, 0, 0, 0)


def test_periodic_stalls_every_period(phase_results: dict) -> None:
    res = phase_results["periodic"]
    # 400 steps of 50 ms in 5 s windows: a refit every 4 windows, none after the last one.
    assert res.rebalances == 5 and res.rebalance_windows == [4, 8, 12, 16, 20]
    assert res.stall_seconds >= 5 * CostModel().periodic_stall_seconds


def test_adaptive_runs_the_controller_decisions(phase_results: dict) -> None:
    res = phase_results["adaptive"]
    assert res.decisions.get("rebalance", 0) == res.rebalances > 0
    assert sum(res.decisions.values()) <= res.windows
    # One commit pause per plan (staged experts into live slots + map swap): milliseconds.
    assert 0 < res.stall_seconds <= res.rebalances * 0.05
    # It pays for what it moves: transfers beside serving cost overlap time.
    assert res.overlap_seconds > 0 and res.bytes_moved > 0
    assert res.relative_throughput > phase_results["none"].relative_throughput


def test_adaptive_from_the_static_fit_beats_it(sources: dict[str, np.ndarray]) -> None:
    trace = _phase_trace(sources)
    res = simulate(trace, _config(trace, "static"), ["static", "adaptive"])
    assert res["adaptive"].rebalances > 0
    assert res["adaptive"].relative_throughput > res["static"].relative_throughput


@pytest.mark.parametrize(("start", "frozen"), [("trivial", "none"), ("static", "static")])
def test_a_paused_controller_keeps_its_start(
    sources: dict[str, np.ndarray], start: str, frozen: str
) -> None:
    trace = make_trace(sources, TraceGenConfig(kind="mix", windows=8, seed=1))
    res = simulate(trace, _config(trace, start, paused=True), [frozen, "adaptive"])
    assert res["adaptive"].rebalances == 0
    assert res["adaptive"].decisions == {"skip_paused": 8}
    assert res["adaptive"].balancedness_per_window == pytest.approx(
        res[frozen].balancedness_per_window
    )
    assert res["adaptive"].relative_throughput == pytest.approx(res[frozen].relative_throughput)


def test_changing_policies_start_where_asked(sources: dict[str, np.ndarray]) -> None:
    trace = make_trace(sources, TraceGenConfig(kind="mix", windows=4, seed=1))
    cold = simulate(trace, _config(trace, "trivial"), ["none", "static", "periodic", "follow"])
    warm = simulate(trace, _config(trace, "static"), ["periodic", "follow"])
    # Window 0 is served before any refit: on the start placement.
    for name in ("periodic", "follow"):
        first_cold = cold[name].balancedness_per_window[0]
        assert first_cold == pytest.approx(cold["none"].balancedness_per_window[0])
        first_warm = warm[name].balancedness_per_window[0]
        assert first_warm == pytest.approx(cold["static"].balancedness_per_window[0])
    assert cold["none"].balancedness_per_window[0] < cold["static"].balancedness_per_window[0]
    with pytest.raises(InputError, match="unknown start 'warm'"):
        simulate(trace, _config(trace, "warm"), ["none"])


def test_constant_traffic_on_a_fitted_placement_is_left_alone() -> None:
    rng = np.random.default_rng(0)
    window = (rng.pareto(1.3, size=(3, 32)) * 100 + 5).round().astype(np.int64)
    trace = Trace(np.repeat(window[None], 12, axis=0))
    cfg = SimConfig(
        shape=_shape(trace, num_slots=40, num_gpus=4, num_nodes=1),
        policy=PolicyConfig(max_moved_fraction=1.0),
        start="static",
    )
    res = simulate(trace, cfg, ["static", "adaptive", "follow", "oracle"])
    assert res["adaptive"].rebalances == 0  # static already fits: nothing is worth moving
    # The same counts every window: after its first window, follow is the oracle.
    follow, oracle = res["follow"].balancedness_per_window, res["oracle"].balancedness_per_window
    assert follow[1:] == pytest.approx(oracle[1:])
    assert follow[0] == pytest.approx(res["static"].balancedness_per_window[0])


def test_cli_all_policies_json(tmp_path: Path, sources: dict[str, np.ndarray], capsys) -> None:
    trace = make_trace(sources, TraceGenConfig(kind="burst", windows=6, seed=2))
    trace.save(tmp_path / "b.npz")
    args = ["simulate", "--gpus", str(G), "--slots", str(P), "--nodes", str(N)]
    args += [
        "--trace",
        str(tmp_path / "b.npz"),
        "--policy",
        "all",
        "--plot",
        str(tmp_path / "b.png"),
    ]
    assert main(args) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(last) == set(POLICIES)
    for name, summary in last.items():
        for key in (
            "windows",
            "mean_balancedness",
            "relative_throughput",
            "rebalances",
            "slots_moved",
            "bytes_moved",
        ):
            assert key in summary, (name, key)
    assert (tmp_path / "b.png").stat().st_size > 1000
    assert main(args[:-4] + ["--policy", "sometimes"]) == 2
    assert main(args[:-4] + ["--policy", "none", "--set", "decay=7"]) == 2
    assert main(args[:-4] + ["--policy", "adaptive", "--start", "warm"]) == 2
    assert "unknown start 'warm'" in capsys.readouterr().err


def test_simulate_plot_into_a_missing_folder_fails_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: `simulate --plot` into a missing folder failed only after the replay."""
    import rebalancer.sim

    def replayed(*args: object, **kwargs: object) -> None:
        raise AssertionError("the replay started")

    monkeypatch.setattr(rebalancer.sim, "simulate", replayed)
    Trace(np.ones((4, 2, 8), dtype=np.int64)).save(tmp_path / "t.npz")
    plot = tmp_path / "missing" / "b.png"
    argv = [
        "simulate",
        "--gpus",
        "2",
        "--slots",
        "8",
        "--trace",
        str(tmp_path / "t.npz"),
        "--plot",
        str(plot),
    ]
    assert main(argv) == 2
    assert (
        capsys.readouterr().err
        == f"rebalancer simulate: error: --plot {plot}: folder {plot.parent} does not exist\n"
    )


def test_adaptive_decisions_replay_through_a_fresh_policy_loop(
    sources: dict[str, np.ndarray],
) -> None:
    """The simulator's adaptive policy is the controller's PolicyLoop, nothing else."""
    from rebalancer.controller.policy_loop import PolicyLoop

    trace = make_trace(
        sources,
        TraceGenConfig(kind="phase", windows=16, phase_min_windows=4, phase_max_windows=6, seed=5),
    )
    config = _config(trace)
    res = simulate(trace, config, ["adaptive"])["adaptive"]
    assert res.rebalances > 0
    loop = PolicyLoop(config.shape, config.policy)
    logged = iter(res.decision_log)
    entry = next(logged)
    for w in range(trace.num_windows):
        if entry is None or entry["window"] != w:
            loop.observe(trace.counts[w])  # a window folded with no decision due
            continue
        again = loop.on_window(
            trace.counts[w], entry["current"], now=entry["now"], in_flight=entry["in_flight"]
        )
        assert again is not None
        first = entry["decision"]
        assert (again.outcome, again.reason) == (first.outcome, first.reason)
        if first.candidate is not None:
            np.testing.assert_array_equal(again.candidate, first.candidate)
        if again.take:
            loop.started(entry["now"])  # the simulator starts every take's plan
        entry = next(logged, None)
    assert entry is None


def test_plans_that_cannot_prepare_in_time_abort(sources: dict[str, np.ndarray]) -> None:
    """Plans go through the controller's coordinator: a prepare timeout aborts them."""
    cfg = TraceGenConfig(kind="phase", windows=16, phase_min_windows=4, phase_max_windows=6, seed=5)
    trace = make_trace(sources, cfg)
    # 1 ms to prepare is never enough to move an expert: every plan aborts.
    res = simulate(trace, _config(trace, prepare_timeout_seconds=0.001), ["none", "adaptive"])
    adaptive = res["adaptive"]
    assert adaptive.rebalances > 0 and adaptive.plans_aborted >= adaptive.rebalances - 1
    assert adaptive.summary()["plans_aborted"] == adaptive.plans_aborted
    # The old maps kept serving: the start placement's balance, and no swap.
    assert adaptive.balancedness_per_window == pytest.approx(res["none"].balancedness_per_window)
    assert adaptive.stall_seconds == 0.0
    assert adaptive.relative_throughput <= res["none"].relative_throughput
    ok = simulate(trace, _config(trace), ["adaptive"])["adaptive"]
    assert ok.plans_aborted == 0


@pytest.mark.parametrize("slots", [8, 16])
def test_real_mixtral_trace_is_not_chased(slots: int, mixtral_path: Path) -> None:
    """32 routings per layer and window (the GSM8K trace in 16-token windows): the gate
    must not move weights for sampling noise, and with one expert per GPU nothing can
    balance better than anything else."""
    from rebalancer.sim import load_trace
    from rebalancer.sim.cost import MIXTRAL_8X7B_EXPERT_BYTES

    trace = load_trace(mixtral_path, tokens_per_window=16)
    shape = replace(
        _shape(trace, num_slots=slots, num_gpus=8, num_nodes=1),
        expert_bytes=MIXTRAL_8X7B_EXPERT_BYTES,
    )
    cfg = SimConfig(shape=shape)
    res = simulate(trace, cfg, ["none", "static", "adaptive", "oracle"])
    adaptive = res["adaptive"]
    assert adaptive.rebalances == 0 and adaptive.bytes_moved == 0
    assert adaptive.decisions.get("skip_gain", 0) >= trace.num_windows - 2
    assert adaptive.balancedness_per_window == pytest.approx(res["none"].balancedness_per_window)
    for name, r in res.items():
        assert r.relative_throughput <= res["oracle"].relative_throughput + 1e-12, name
    if slots == 8:
        assert len({round(r.mean_balancedness, 9) for r in res.values()}) == 1


def test_the_simulator_charges_what_the_gate_predicted(sources: dict[str, np.ndarray]) -> None:
    """One cost model: every plan the adaptive policy starts is charged (bytes, transfer
    time, commit pause + swap) with the parameters and functions its decision used."""
    from rebalancer.controller.cost import plan_cost
    from rebalancer.placement import transfers

    trace = _phase_trace(sources)
    # Non-default links, so a second default anywhere would show.
    config = _config(trace, link_bandwidth_gbps=3.0, intra_node_gbps=40.0, commit_gbps=90.0)
    res = simulate(trace, config, ["adaptive"])["adaptive"]
    taken = [e for e in res.decision_log if e["decision"].take]
    assert taken
    pauses = 0.0
    for entry in taken:
        d = entry["decision"]
        rows = np.asarray(transfers(entry["current"], d.candidate, G, N))
        c = plan_cost(rows, G, N, config.shape.expert_bytes, config.params)
        assert (d.migration_cost_seconds, d.transfer_seconds, d.bytes_to_move) == (
            c.seconds,
            c.transfer_seconds,
            c.bytes_between_gpus,
        )
        if entry["window"] < trace.num_windows - 1:  # a plan of the last window never lands
            pauses += c.commit_pause_seconds + c.swap_seconds
    assert res.bytes_moved == sum(e["decision"].bytes_to_move for e in taken)
    assert res.plans_aborted == 0
    # The stalls are the commit pauses (copy + swap) of the plans that landed.
    assert res.stall_seconds == pytest.approx(pauses)


def test_cli_timing_and_migration_cost_keys(
    tmp_path: Path, sources: dict[str, np.ndarray], capsys
) -> None:
    trace = make_trace(sources, TraceGenConfig(kind="phase", windows=4, seed=2))
    trace.save(tmp_path / "p.npz")
    base = [
        "simulate",
        "--gpus",
        str(G),
        "--slots",
        str(P),
        "--nodes",
        str(N),
        "--trace",
        str(tmp_path / "p.npz"),
        "--policy",
        "adaptive",
    ]
    assert main(base) == 0
    head = capsys.readouterr().out.splitlines()[0]
    # Derived for the trace's 5 s windows: settling binds.
    assert "adaptive timing (trace): min_interval_seconds=7.9, decision_period_seconds=5" in head
    assert main([*base, "--timing", "defaults"]) == 0
    default = PolicyConfig()
    assert (
        f"min_interval_seconds={default.min_interval_seconds:g}, "
        f"decision_period_seconds={default.decision_period_seconds:g}"
    ) in capsys.readouterr().out
    assert main([*base, "--set", "min_interval_seconds=3"]) == 0
    assert "min_interval_seconds=3, decision_period_seconds=5" in capsys.readouterr().out
    # A migration-cost key of --cost sets the policy's field: the gate sees it too.
    assert main([*base, "--json", "--cost", "commit_gbps=1e9", "--cost", "inter_node_gbps=5"]) == 0
    assert (
        main([*base, "--json", "--set", "commit_gbps=1e9", "--set", "link_bandwidth_gbps=5"]) == 0
    )
    first, second = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines())
    assert first == second
    assert main([*base, "--cost", "nonsense=1"]) == 2
    assert "inter_node_gbps" in capsys.readouterr().err


def test_a_shape_that_is_not_the_traces_deployment_is_refused() -> None:
    """The shape is the trace's layers and experts; its expert bytes are checked as a
    Register's are."""
    trace = Trace(np.ones((2, 3, 16), dtype=np.int64))
    config = SimConfig(shape=_shape(trace, num_slots=16, num_gpus=4, num_nodes=1))
    simulate(trace, config, ["none"])
    for other, message in (
        (replace(config.shape, num_layers=4), "shape has 4 layers x 16 experts, the trace 3 x 16"),
        (replace(config.shape, num_logical=8), "shape has 3 layers x 8 experts, the trace 3 x 16"),
        (replace(config.shape, expert_bytes=-1), r"expert_bytes must be in \[0, 2\*\*40\]"),
    ):
        with pytest.raises(InputError, match=message):
            simulate(trace, replace(config, shape=other), ["none"])
