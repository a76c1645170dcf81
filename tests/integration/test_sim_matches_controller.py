"""The live controller and the simulator take the same decisions on the same input.

The simulator's adaptive policy is `PolicyLoop.on_window` (tests/unit/sim shows its
decision log replays through a fresh PolicyLoop). Here the real Controller ingests
the same windows, rank by rank, and its decisions, computed through
`PolicyLoop.prepare_decision` off the event loop, must equal the loop's one for one."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.controller.decide import Decision, PolicyConfig
from rebalancer.controller.policy_loop import PolicyLoop
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.errors import InputError
from rebalancer.placement import trivial_placement
from rebalancer.sim import TraceGenConfig, deepseek_v3_sources, make_trace
from rebalancer.wire.shape import ClusterShape

G, P = 8, 264


def test_same_windows_same_decisions() -> None:
    try:
        sources = {k: v[10:14] for k, v in deepseek_v3_sources().items()}
    except InputError:
        pytest.skip("shared routing data not present")
    trace = make_trace(
        sources,
        TraceGenConfig(kind="phase", windows=24, phase_min_windows=4, phase_max_windows=6, seed=3),
    )
    L, E = trace.counts.shape[1:]
    shape = ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, num_nodes=2)
    policy = PolicyConfig(decision_period_seconds=2.0, min_interval_seconds=4.0, min_windows=2)
    current = trivial_placement(L, E, P, G)

    # The simulator's side: the bare loop, one window per virtual second (no plan starts,
    # as none can on the controller's side: neither counts a rebalance).
    loop = PolicyLoop(shape, policy)
    expected: list[tuple[int, Decision]] = []
    for w in range(trace.num_windows):
        d = loop.on_window(trace.counts[w], current, now=float(w))
        if d is not None:
            expected.append((w, d))

    # The controller's side: G ranks send their windows; rank 0 carries the counts.
    clock = [0.0]
    got: list[tuple[int, Decision]] = []

    def background(fn, done):  # type: ignore[no-untyped-def]
        result = fn()
        if isinstance(result, Decision):  # not a contingency set (the worker plans those too)
            got.append((int(clock[0]), result))
        done(result)

    controller = Controller(
        Store(":memory:"), policy, clock=lambda: clock[0], background=background
    )
    for rank in range(G):
        _, dep = controller.register("d", rank, shape, 0, current, f"w{rank}")
    for w in range(trace.num_windows):
        clock[0] = float(w)
        for rank in range(G):
            counts = trace.counts[w] if rank == 0 else np.zeros_like(trace.counts[w])
            controller.ingest(dep, rank, w, 0, counts, None)

    assert len(expected) >= 3 and any(d.take for _, d in expected)
    assert [w for w, _ in got] == [w for w, _ in expected]
    for (_, a), (_, b) in zip(expected, got, strict=True):
        assert (a.outcome, a.reason) == (b.outcome, b.reason)
        if a.candidate is not None:
            np.testing.assert_array_equal(a.candidate, b.candidate)
    # What the controller recorded: the same outcomes (a take it could not start is
    # stored as skip_ranks, since no rank has a stream open here).
    stored = [r["outcome"] for r in reversed(controller.store.decisions("d", 100))]
    assert stored == [("skip_ranks" if d.take else d.outcome) for _, d in expected]
