"""A scrape of a large fleet written as text on the controller's event loop, in slices (issue
32: one whole scrape of 2,048 deployments through prometheus_client took 6 s on a thread
beside the loop and held windows for seconds). The metrics server's thread hands the scrape
to the loop; the loop runs other callbacks between slices; the text is what Prometheus
reads; a failed scrape is a 503 with one line, and the server serves on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rebalancer.controller import exposition
from rebalancer.controller import metrics as metrics_module
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.loop_busy import timed_loop
from rebalancer.controller.metrics import ControllerMetrics
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=2, num_logical=4, num_slots=6, num_gpus=2, expert_bytes=10)
FLEET = 40


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Controller]:
    ctl = Controller(Store(tmp_path / "c.sqlite"), PolicyConfig(paused=True))
    for i in range(FLEET):
        _, dep = ctl.register(
            f"d{i}", frozenset({0, 1}), SHAPE, 0, None, f"w{i}", f"p{i}", pool=f"pool{i // 8}"
        )
        for seq in range(2):
            ctl.ingest(dep, frozenset({0, 1}), seq, 0, np.full((2, 4), i + 1, np.uint32), None)
    yield ctl
    ctl.store.close()


def _fleet_lines(text: str) -> list[str]:
    """The samples of deployments and pools (the process's own figures move between scrapes)."""
    return sorted(line for line in text.splitlines() if 'deployment="' in line or 'pool="' in line)


def test_a_scrape_on_the_loop_lets_other_callbacks_run_between_slices(
    fleet: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_module, "SLICE_SECONDS", 0.0)  # a slice per deployment or pool
    turns = 0
    seen: list[int] = []  # the other task's turns as each deployment's series are read
    read = metrics_module._FleetSeries._balancedness

    def recording(self, *args):  # type: ignore[no-untyped-def]
        seen.append(turns)
        return read(self, *args)

    monkeypatch.setattr(metrics_module._FleetSeries, "_balancedness", recording)

    async def main() -> tuple[bytes, list[int], bytes]:
        nonlocal turns
        metrics = ControllerMetrics(fleet)
        done = False

        async def beside() -> None:  # what a window's callback would be
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        other = asyncio.create_task(beside())
        await asyncio.sleep(0)
        sliced = await metrics.render_sliced()
        done = True
        await other
        return sliced, list(seen), metrics.render()

    sliced, between, whole = asyncio.run(main())
    assert len(between) == FLEET
    # The other task ran between every two deployments' series.
    assert all(b > a for a, b in zip(between, between[1:], strict=False)), between
    assert _fleet_lines(sliced.decode()) == _fleet_lines(whole.decode())
    assert len(_fleet_lines(whole.decode())) > 30 * FLEET


def test_a_restricted_scrape_writes_no_sample_it_was_not_asked_for(
    fleet: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape of the process's own figures (`name[]=`, as the bench and a busy
    dashboard ask) writes none of the per-deployment samples: at 2,048 deployments the
    event counters alone are about 40,000 lines."""
    metrics = ControllerMetrics(fleet)
    written = 0
    add = exposition.Family.add

    def counted(self, *args):  # type: ignore[no-untyped-def]
        nonlocal written
        written += 1
        return add(self, *args)

    monkeypatch.setattr(exposition.Family, "add", counted)
    text = metrics.render([f"{metrics_module.RANK_WINDOWS_FOLDED}_total"]).decode()
    assert f"{metrics_module.RANK_WINDOWS_FOLDED}_total " in text and written == 0
    text = metrics.render(["rebalancer_plan_aborts_total"]).decode()
    assert written == FLEET * len(metrics_module.ABORT_REASONS)
    assert text.count("rebalancer_plan_aborts_total{") == written


def test_the_servers_thread_hands_the_scrape_to_the_loop(
    fleet: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scrape` (the metrics server's thread) writes the series on the loop where they
    change, never on its own thread beside it."""
    seen: set[int] = set()
    read = metrics_module._FleetSeries._balancedness

    def recording(self, *args):  # type: ignore[no-untyped-def]
        seen.add(threading.get_ident())
        return read(self, *args)

    monkeypatch.setattr(metrics_module._FleetSeries, "_balancedness", recording)

    async def main() -> tuple[bytes, int]:
        metrics = ControllerMetrics(fleet)
        text = await asyncio.to_thread(metrics.scrape)
        return text, threading.get_ident()

    with asyncio.Runner(loop_factory=timed_loop) as runner:
        text, loop_thread = runner.run(main())
    assert seen == {loop_thread}
    assert b'rebalancer_placement_version{deployment="d39"} 0.0' in text


def test_the_text_is_what_prometheus_reads(fleet: Controller) -> None:
    metrics = ControllerMetrics(fleet)
    metrics.aborts.inc("d3", "timeout", amount=2)
    metrics.decision_gain.set("d3", "skip", value=1e7)
    text = metrics.render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    aborts = families["rebalancer_plan_aborts"]
    assert aborts.type == "counter"
    assert {
        (s.labels["deployment"], s.labels["reason"]): s.value
        for s in aborts.samples
        if s.labels["deployment"] == "d3"
    } == {("d3", r): (2.0 if r == "timeout" else 0.0) for r in metrics_module.ABORT_REASONS}
    folded = families["rebalancer_windows_folded"]
    assert {s.labels["deployment"]: s.value for s in folded.samples} == {
        f"d{i}": 2.0 for i in range(FLEET)
    }
    assert families["rebalancer_pool_members"].type == "gauge"
    assert 'rebalancer_decision_predicted_gain_seconds{deployment="d3",outcome="skip"} 1e+07' in (
        text
    )
    # Every family once, with its help and type, and every sample line under its own family.
    assert text.count("# TYPE rebalancer_windows_folded_total counter\n") == 1


def test_label_values_and_help_are_escaped() -> None:
    family = exposition.gauge("x", "help with \\ and\nnewline", ("deployment",))
    family.add(('a"b\\c\nd',), 0.5)
    text = family.text()
    assert text == (
        "# HELP x help with \\\\ and\\nnewline\n"
        "# TYPE x gauge\n"
        'x{deployment="a\\"b\\\\c\\nd"} 0.5\n'
    )
    (parsed,) = text_string_to_metric_families(text)
    assert parsed.samples[0].labels == {"deployment": 'a"b\\c\nd'}
    member = exposition.gauge("m", "h", ("pool", "deployment"))
    member.add(("fleet", "m1"), 1)
    assert member.lines == ['m{deployment="m1",pool="fleet"} 1.0\n']  # sorted, as the client


def test_the_server_answers_gzip_a_restriction_and_a_failed_scrape() -> None:
    asked: list[object] = []

    def scrape(names: exposition.Names) -> bytes:
        asked.append(names)
        if names is not None and "boom" in names:
            raise RuntimeError("the loop stopped")
        if names is not None and "cancelled" in names:  # the loop closed with it handed over
            raise concurrent.futures.CancelledError()
        return b"x_total 1.0\n"

    server, thread = exposition.serve("127.0.0.1", 0, scrape)
    base = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        zipped = urllib.request.Request(
            base + "?name[]=x_total", headers={"Accept-Encoding": "gzip"}
        )
        with urllib.request.urlopen(zipped, timeout=5) as reply:
            assert reply.headers["Content-Encoding"] == "gzip"
            assert reply.headers["Content-Type"] == exposition.CONTENT_TYPE
            assert gzip.decompress(reply.read()) == b"x_total 1.0\n"
        assert asked == [frozenset({"x_total"})]
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(base + "?name[]=boom", timeout=5)
        assert failed.value.code == 503
        assert failed.value.read() == b"metrics unavailable: the scrape did not finish\n"
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(base + "?name[]=cancelled", timeout=5)
        assert failed.value.code == 503
        with urllib.request.urlopen(base, timeout=5) as reply:  # and serves on
            assert reply.read() == b"x_total 1.0\n" and asked[-1] is None
    finally:
        server.shutdown()
        server.server_close()
    thread.join(5)
    assert not thread.is_alive()
