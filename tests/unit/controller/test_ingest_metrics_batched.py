"""The per-window metrics taken in batches (issue 32): what a scrape shows of the ingest
histogram and byte counters is what prometheus_client's own Histogram and Counter show for
the same windows, every window counted once, across scrapes and from several threads."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.metrics import INGEST_BUCKETS, ControllerMetrics
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=2, num_logical=4, num_slots=6, num_gpus=2, expert_bytes=10)


def _lines(text: str, *names: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith(names))


def test_a_scrape_shows_what_prometheus_clients_own_metrics_would(tmp_path: Path) -> None:
    ctl = Controller(Store(tmp_path / "c.sqlite"), PolicyConfig(paused=True))
    ctl.register("a", 0, SHAPE, 0, None, "", "")
    ctl.register("b", 0, SHAPE, 0, None, "", "")
    metrics = ControllerMetrics(ctl)
    reference = CollectorRegistry()
    hist = Histogram("rebalancer_ingest_seconds", "x", registry=reference, buckets=INGEST_BUCKETS)
    byts = Counter("rebalancer_ingest_bytes", "x", ["deployment"], registry=reference)
    byts.labels("a"), byts.labels("b")
    rng = np.random.default_rng(0)
    scraped = []
    for batch in range(3):
        for _ in range(500):
            seconds = float(
                rng.choice([1e-5, 5e-5, 0.1, 0.5]) if rng.random() < 0.2 else rng.exponential(2e-3)
            )
            name, nbytes = ("a", 4096) if rng.random() < 0.7 else ("b", 64)
            metrics.on_ingest(name, nbytes, seconds)
            hist.observe(seconds)
            byts.labels(name).inc(nbytes)
        scraped.append(metrics.render().decode())
        names = (
            "rebalancer_ingest_seconds_bucket",
            "rebalancer_ingest_seconds_count",
            "rebalancer_ingest_bytes_total",
        )
        ours, theirs = (
            _lines(scraped[-1], *names),
            _lines(generate_latest(reference).decode(), *names),
        )
        assert ours == theirs and len(ours) == len(INGEST_BUCKETS) + 1 + 1 + 2, batch
        got = next(
            line
            for line in scraped[-1].splitlines()
            if line.startswith("rebalancer_ingest_seconds_sum")
        )
        assert abs(float(got.split()[1]) - hist._sum.get()) < 1e-9
    ctl.store.close()


def test_windows_counted_once_while_scrapes_run_beside(tmp_path: Path) -> None:
    ctl = Controller(Store(tmp_path / "c.sqlite"), PolicyConfig(paused=True))
    ctl.register("a", 0, SHAPE, 0, None, "", "")
    metrics = ControllerMetrics(ctl)
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            metrics.render()

    scrapers = [threading.Thread(target=scrape) for _ in range(2)]
    for t in scrapers:
        t.start()
    try:
        for _ in range(20000):
            metrics.on_ingest("a", 8, 1e-4)
    finally:
        stop.set()
        for t in scrapers:
            t.join()
    text = metrics.render().decode()
    assert "rebalancer_ingest_seconds_count 20000.0" in text
    assert 'rebalancer_ingest_bytes_total{deployment="a"} 160000.0' in text
    ctl.store.close()


def test_the_queue_stays_bounded_when_nobody_scrapes(tmp_path: Path) -> None:
    """A controller whose metrics nobody scrapes keeps folding the queued window times into
    the buckets: the queue never holds more than FOLD_EVERY, and the next scrape still shows
    every window."""
    from rebalancer.controller.metrics import FOLD_EVERY

    ctl = Controller(Store(tmp_path / "c.sqlite"), PolicyConfig(paused=True))
    ctl.register("a", 0, SHAPE, 0, None, "", "")
    metrics = ControllerMetrics(ctl)
    windows = 3 * FOLD_EVERY + 7
    for _ in range(windows):
        metrics.on_ingest("a", 8, 1e-3)
        assert len(metrics._ingest._times) < FOLD_EVERY
    text = metrics.render().decode()
    assert f"rebalancer_ingest_seconds_count {float(windows)}" in text
    assert 'rebalancer_ingest_bytes_total{deployment="a"} ' + str(float(8 * windows)) in text
