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
