"""No `*_created` series in either exposition (issue 34): prometheus_client adds one to the
counters and histograms it keeps itself and none to those a collector reads at scrape
time, so some counters had one and the others not. Both processes that export metrics
(the controller, the sidecar) leave them out, for every counter alike."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.metrics import ControllerMetrics
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.sidecar.config import SidecarConfig
from rebalancer.sidecar.metrics import SidecarMetrics
from rebalancer.sidecar.pod import Pod
from rebalancer.sidecar.upstream import Upstream
from rebalancer.wire.link import Link
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=2, num_logical=4, num_slots=6, num_gpus=2, expert_bytes=10)


def test_the_controllers_exposition_has_no_created_series(tmp_path: Path) -> None:
    ctl = Controller(Store(tmp_path / "c.sqlite"), PolicyConfig(paused=True))
    ctl.register("d", 0, SHAPE, 0, None, "", "")
    metrics = ControllerMetrics(ctl)
    metrics.aborts.inc("d", "timeout")  # an event counted
    metrics.phase_seconds.labels("prepare").observe(0.5)
    text = metrics.render().decode()
    assert 'rebalancer_plan_aborts_total{deployment="d",reason="timeout"} 1.0' in text
    assert "_created" not in text, [line for line in text.splitlines() if "_created" in line][:5]


def test_the_sidecars_exposition_has_no_created_series() -> None:
    config = SidecarConfig(link=Link("c:1"), ranks=(0, 1))
    pod = Pod(config)
    metrics = SidecarMetrics(pod, Upstream(config, pod))
    metrics.plans.labels("committed").inc()
    metrics.phase_seconds.labels("prepare").observe(0.5)
    text = generate_latest(metrics.registry).decode()
    assert 'rebalancer_sidecar_plans_total{outcome="committed"} 1.0' in text
    assert "_created" not in text, [line for line in text.splitlines() if "_created" in line][:5]
