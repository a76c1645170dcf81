"""bench.ingest counts rank windows as the controller folded them (issue 32): from the
controller's process-wide counter, or from an older controller's per-deployment one (x 32
rank windows), read by a scrape restricted to the names asked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from bench.ingest import FOLDED, LOOP_BUSY, RANKS_PER_DEPLOYMENT, read_counts, scrape


@pytest.fixture
def served() -> Iterator[tuple[CollectorRegistry, int]]:
    registry = CollectorRegistry(auto_describe=True)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield registry, server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_process_wide_counters(served: tuple[CollectorRegistry, int]) -> None:
    registry, port = served
    Counter("rebalancer_rank_windows_folded", "x", registry=registry).inc(4096)
    Counter("rebalancer_event_loop_busy_seconds", "x", registry=registry).inc(1.5)
    Counter("rebalancer_windows_folded", "x", ["deployment"], registry=registry).labels("a").inc(7)
    _, got = read_counts(port)
    assert got == {FOLDED: 4096.0, LOOP_BUSY: 1.5}


def test_an_older_controller_counts_by_deployment(served: tuple[CollectorRegistry, int]) -> None:
    registry, port = served
    folded = Counter("rebalancer_windows_folded", "x", ["deployment"], registry=registry)
    folded.labels("dsv3-0").inc(3)
    folded.labels("dsv3-1").inc(5)
    _, got = read_counts(port)
    assert got == {FOLDED: RANKS_PER_DEPLOYMENT * 8.0}
    assert scrape(port, ("rebalancer_windows_folded_total",), labelled=True) == {
        'rebalancer_windows_folded_total{deployment="dsv3-0"}': 3.0,
        'rebalancer_windows_folded_total{deployment="dsv3-1"}': 5.0,
    }


def test_the_long_loop_iterations_between_two_readings(
    served: tuple[CollectorRegistry, int],
) -> None:
    """The iterations over 50 ms and the bound the longest stayed within, counted between
    the readings only; none from a controller without the histogram."""
    from prometheus_client import Histogram

    from bench.ingest import long_iterations
    from rebalancer.controller.loop_busy import ITERATION_BUCKETS

    registry, port = served
    _, bare = read_counts(port)
    iterations = Histogram(
        "rebalancer_event_loop_iteration_seconds", "x", buckets=ITERATION_BUCKETS, registry=registry
    )
    for seconds in (0.3, 0.002):  # before the first reading: not counted
        iterations.observe(seconds)
    _, before = read_counts(port)
    for seconds in (0.0005, 0.004, 0.04, 0.07, 0.2):
        iterations.observe(seconds)
    _, after = read_counts(port)
    assert long_iterations(before, after) == (2.0, 250.0)
    assert all(x != x for x in long_iterations(bare, after))  # NaN: no histogram before
