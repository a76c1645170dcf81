"""The dashboard and the alerts on a real Prometheus over a live run, with real faults.

A Prometheus server (Debian's, the package promtool comes from) scrapes, every second, a
live fleet (rebalancer/launch/fleet.py): `rebalancer serve`, the demo's 2 sidecars with
their /metrics, and the demo's 4 CPU workers serving through them. Its rules are the
shipped deploy/prometheus/alerts.yml with every `for:` shortened to FOR, evaluated every
second: only `for` is changed (the test checks it), so expressions, labels and
annotations are the shipped ones.

1. Every query of every dashboard panel, the sidecars' too, is answered by Prometheus
   (query_range over the run, Grafana's variables as Grafana sets them) with data, and
   the picture is drawn from those answers (rebalancer/launch/dashboard.py).
2. The engines die behind live sidecars (SIGKILL of every worker; the sidecars keep their
   streams to the controller): RebalancerRanksDisconnected fires; the engines start
   again and it resolves.
3. The controller is killed (SIGKILL): RebalancerControllerAbsent fires; the controller
   starts again on its store and it resolves.

Every process (Prometheus, controller, sidecars, workers) is reaped on the way out,
whatever happened. Waits are for events, each bounded.
"""

from __future__ import annotations

import calendar
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rebalancer.launch.config import DemoConfig
from rebalancer.launch.dashboard import Query, ask, dashboard_queries, draw, has_data
from rebalancer.launch.fleet import Fleet
from rebalancer.launch.instant import PoolMember
from rebalancer.launch.prometheus import Prometheus
from tests.unit.deploy.conftest import DASHBOARD, PROMETHEUS, load_all

pytestmark = pytest.mark.slow

FOR = "2s"  # every alert's `for:` in the test copy of the rules (the shipped ones are minutes)
DEPLOYMENT = "demo"


def shortened_rules(folder: Path) -> Path:
    """The shipped alert rules with every `for:` set to FOR; nothing else differs."""
    shipped = (PROMETHEUS / "alerts.yml").read_text()
    text, count = re.subn(r"^(\s+)for: \S+$", rf"\g<1>for: {FOR}", shipped, flags=re.M)
    (doc,) = load_all(shipped)
    (copy,) = load_all(text)
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert count == sum("for" in r for r in rules) > 0

    def without_for(d: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k != "for"} for g in d["groups"] for r in g["rules"]]

    assert without_for(copy) == without_for(doc)  # only `for` changed
    assert all(r["for"] == FOR for g in copy["groups"] for r in g["rules"] if "for" in r)
    path = folder / "alerts.yml"
    path.write_text(text)
    return path


def wait_for(check: Callable[[], Any], seconds: float, what: str, every: float = 0.5) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:.0f} s waiting for {what}")
        time.sleep(every)


@pytest.fixture
def live(tmp_path: Path, prometheus: str) -> Iterator[tuple[Prometheus, Fleet]]:
    """Prometheus with the test copy of the rules, scraping a live fleet; all reaped after."""
    # Workers that outlast the test (it kills them); paced so that 2 cores hold the rest.
    fleet = Fleet(
        tmp_path / "fleet", DemoConfig(steps=10**6, timeout_seconds=900.0), ["--step-sleep", "0.02"]
    )
    server = Prometheus(
        tmp_path / "prometheus",
        fleet.targets(),
        [shortened_rules(tmp_path)],
        scrape_interval=1.0,
        evaluation_interval=1.0,
        binary=prometheus,
    )
    with server, fleet, PoolMember(fleet.address, "live-pooled", "live-pool"):
        yield server, fleet


def rule(prom: Prometheus, name: str) -> dict[str, Any]:
    return prom.alert_rules()[name]


def firing_since(prom: Prometheus, name: str, since: float) -> dict[str, Any] | None:
    """The alert `name` firing, active since `since` or later (caused by the fault), or None."""
    for alert in rule(prom, name)["alerts"]:
        stamp = calendar.timegm(
            time.strptime(alert["activeAt"][:19], "%Y-%m-%dT%H:%M:%S")
        )  # RFC 3339, UTC
        if alert["state"] == "firing" and stamp >= math.floor(since) - 1:
            return dict(alert)
    return None


def inactive(prom: Prometheus, name: str) -> bool:
    return bool(rule(prom, name)["state"] == "inactive")


def test_every_dashboard_query_answers_and_alerts_fire_and_resolve_on_real_faults(
    live: tuple[Prometheus, Fleet], tmp_path: Path
) -> None:
    prom, fleet = live
    start = time.time()
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len({q.panel for q in queries}) == sum(p["type"] != "row" for p in dashboard["panels"])
    assert any("rebalancer_sidecar_" in q.expr for q in queries)
    shipped = {
        r["alert"]
        for g in load_all((PROMETHEUS / "alerts.yml").read_text())[0]["groups"]
        for r in g["rules"]
    }
    assert set(prom.alert_rules()) == shipped  # Prometheus loaded the rules file

    # 1. Every panel's every query answers with data (a plan committed, sidecars relayed it).
    answers: dict[Query, list[dict[str, Any]]] = {}

    def empty() -> list[str]:
        return [
            f"{q.panel} {q.ref}: {q.expr}" for q, answer in answers.items() if not has_data(answer)
        ]

    def all_answer() -> bool:
        nonlocal answers
        answers = ask(prom, queries, DEPLOYMENT, start, time.time(), 1.0)
        return not empty()

    try:
        wait_for(all_answer, 150, "every dashboard query to answer", every=3.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {empty()}") from None
    report = draw(dashboard, answers, start, time.time(), 1.0, tmp_path / "dashboard.png", "live")
    assert (tmp_path / "dashboard.png").stat().st_size > 50_000
    assert len(report) == len({q.panel for q in queries})

    # 2. The engines die behind live sidecars: RebalancerRanksDisconnected fires, then
    # resolves once they are back. (At start it may have fired while the pods registered.)
    wait_for(
        lambda: inactive(prom, "RebalancerRanksDisconnected"),
        60,
        "RebalancerRanksDisconnected inactive",
    )
    killed = time.time()
    fleet.kill_engines()
    alert = wait_for(
        lambda: firing_since(prom, "RebalancerRanksDisconnected", killed),
        60,
        "RebalancerRanksDisconnected firing",
    )
    assert alert["labels"]["deployment"] == DEPLOYMENT
    # ... behind live sidecars: each still up and linked to the controller, and what they
    # see (no rank) is what the controller counts.
    wait_for(
        lambda: prom.query(f'rebalancer_connected_ranks{{deployment="{DEPLOYMENT}"}} == 0'),
        30,
        "the controller counting no rank",
    )
    up = prom.query("rebalancer_sidecar_upstream_up")
    assert len(up) == 2 and all(float(s["value"][1]) == 1.0 for s in up)
    assert all(
        float(s["value"][1]) == 0.0 for s in prom.query("rebalancer_sidecar_ranks_connected")
    )
    fleet.start_engines()
    wait_for(
        lambda: inactive(prom, "RebalancerRanksDisconnected"),
        120,
        "RebalancerRanksDisconnected resolved",
    )
    assert prom.query(f'rebalancer_connected_ranks{{deployment="{DEPLOYMENT}"}} == 4')

    # 3. The controller is killed: RebalancerControllerAbsent fires; restarted, it resolves.
    wait_for(
        lambda: inactive(prom, "RebalancerControllerAbsent"),
        30,
        "RebalancerControllerAbsent inactive",
    )
    killed = time.time()
    fleet.kill_controller()
    wait_for(
        lambda: firing_since(prom, "RebalancerControllerAbsent", killed),
        60,
        "RebalancerControllerAbsent firing",
    )
    fleet.start_controller()
    wait_for(
        lambda: inactive(prom, "RebalancerControllerAbsent"),
        60,
        "RebalancerControllerAbsent resolved",
    )
    assert prom.query("rebalancer_build_info")
