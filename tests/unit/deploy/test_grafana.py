"""deploy/grafana/rebalancer.json: a dashboard on the templated data source, whose every
query is valid PromQL selecting only series a live controller or sidecar exposes (names
with their _total / _bucket / _sum / _count suffixes, scraped: tests/unit/deploy/live.py),
and which shows every metric family they expose."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rebalancer.launch.dashboard import grafana_to_promql
from tests.unit.deploy.conftest import DASHBOARD, PROCESS_PREFIX, base_name
from tests.unit.deploy.promql import metric_names

DS_UID = "${DS_PROMETHEUS}"
DEPLOYMENT_QUERY = "label_values(rebalancer_placement_version, deployment)"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and query annotation."""
    out = [
        (f"panel {p['title']!r} {t['refId']}", t["expr"])
        for p in _panels(dashboard)
        for t in p.get("targets", [])
    ]
    out += [
        (f"annotation {a['name']!r}", a["expr"])
        for a in dashboard["annotations"]["list"]
        if "expr" in a
    ]
    return out


def test_templating(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    dep = variables["deployment"]
    assert dep["type"] == "query"
    assert dep["datasource"]["uid"] == DS_UID
    query = dep["query"]["query"] if isinstance(dep["query"], dict) else dep["query"]
    assert query == DEPLOYMENT_QUERY
    assert dep.get("definition", query) == DEPLOYMENT_QUERY
    assert dep["multi"] and dep["includeAll"]


def test_panels_use_the_templated_datasource(dashboard: dict[str, Any]) -> None:
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len(panels) >= 12
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": DS_UID}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == DS_UID, p["title"]
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
    for a in dashboard["annotations"]["list"]:
        if "expr" in a:
            assert a["datasource"]["uid"] == DS_UID


def test_per_deployment_metrics_follow_the_variable(dashboard: dict[str, Any]) -> None:
    # Every series labelled by deployment is filtered by $deployment (a sidecar's through
    # its info series' deployment label); the two histograms without that label (ingest
    # latency, plan phases), the store's errors, build info, the shard and the event loop
    # are controller-wide, and a replica pool's series are the pool's, over all its members
    # (its members' divergence too: which members of a pool follow it is a view of the
    # pool, not of a deployment).
    global_metrics = {
        "rebalancer_ingest_seconds",
        "rebalancer_plan_phase_seconds",
        "rebalancer_build_info",
        "rebalancer_store_errors",
        "rebalancer_pool_members",
        "rebalancer_pool_diverged_members",
        "rebalancer_pool_members_at_target",
        "rebalancer_pool_members_moving",
        "rebalancer_pool_placement_version",
        "rebalancer_pool_balancedness",
        "rebalancer_pool_decisions",
        "rebalancer_pool_divergences",
        "rebalancer_pool_member_diverged",
        "rebalancer_rank_windows_folded",
        "rebalancer_event_loop_busy_seconds",
        "rebalancer_event_loop_iteration_seconds",
        "rebalancer_decision_worker_busy_seconds",
        "rebalancer_decision_spacing_seconds",
        "rebalancer_decision_cpu_share",
        "rebalancer_shard_info",
        "rebalancer_shards",
    }
    for where, expr in _queries(dashboard):
        names = {base_name(n) for n in metric_names(expr)}
        if names - global_metrics:
            assert 'deployment=~"$deployment"' in expr, f"{where}: {expr}"


def test_queries_select_only_exported_metrics(
    dashboard: dict[str, Any], exported_metrics: set[str]
) -> None:
    used = set()
    for where, expr in _queries(dashboard):
        names = metric_names(grafana_to_promql(expr))
        assert names, f"{where}: no metric in {expr!r}"
        unknown = names - exported_metrics
        assert not unknown, f"{where}: no live controller or sidecar exposes {sorted(unknown)}"
        used |= {base_name(n) for n in names}
    assert DEPLOYMENT_QUERY.split("(")[1].split(",")[0] in exported_metrics
    # The other way round: a family exposed but nowhere on the dashboard is a gap.
    families = {base_name(n) for n in exported_metrics if not n.startswith(PROCESS_PREFIX)}
    assert families - used == set(), f"exported but not on the dashboard: {sorted(families - used)}"


def test_names_are_checked_with_their_suffixes(exported_metrics: set[str]) -> None:
    # A counter is selected as name_total, a histogram by its _bucket/_sum/_count: the
    # bare family name selects nothing, so the check above would catch it.
    assert {
        "rebalancer_plans_total",
        "rebalancer_ingest_seconds_bucket",
        "rebalancer_ingest_seconds_count",
        "rebalancer_build_info",
        "rebalancer_sidecar_plans_total",
    } <= exported_metrics
    assert (
        not {"rebalancer_plans", "rebalancer_ingest_seconds", "rebalancer_build"} & exported_metrics
    )


def test_required_views(dashboard: dict[str, Any]) -> None:
    exprs = " ".join(expr for _, expr in _queries(dashboard))
    assert "histogram_quantile(0.99, sum by (le) (rate(rebalancer_ingest_seconds_bucket" in exprs
    for by in (
        "outcome) (increase(rebalancer_decisions_total",
        "trigger) (increase(rebalancer_rebalances_total",
        "reason) (increase(rebalancer_plan_aborts_total",
        "rebalancer_plan_phase_seconds_bucket",
        "rate(rebalancer_ingest_bytes_total",
        "rate(rebalancer_windows_ingested_total",
        "rebalancer_migrated_slots_total",
        "rebalancer_migrated_bytes_total",
        "rebalancer_last_plan_stall_seconds",
        "rebalancer_store_errors_total",
        "rebalancer_streams",
    ):
        assert by in exprs, by
    panels = {p["title"]: p for p in _panels(dashboard)}
    # One overview row per deployment: a row repeated over the deployment variable.
    (overview,) = [p for p in dashboard["panels"] if p["type"] == "row" and p.get("repeat")]
    assert overview["repeat"] == "deployment"
    for title in (
        "Balancedness now",
        "Balancedness over layers",
        "Plans and aborts",
        "Stall and duration per plan",
        "Weights moved",
        "Decision outcomes",
        "Windows per second",
        "Ingest latency per window",
        "Streams and ranks",
        "Store errors",
    ):
        assert title in panels, title
    stats = {t["expr"] for t in panels["Balancedness over layers"]["targets"]}
    assert (
        'rebalancer_balancedness{deployment=~"$deployment",source="actual"}' in stats
    )  # min/p50/p90/avg
    heatmap = panels["Load imbalance per layer"]
    assert (
        heatmap["type"] == "heatmap"
        and "rebalancer_layer_imbalance" in heatmap["targets"][0]["expr"]
    )
    assert "per_layer_metrics = true" in heatmap["description"]


def test_queries_are_valid_promql(dashboard: dict[str, Any], promtool: str, tmp_path: Path) -> None:
    # promtool parses every expression of a recording-rule file: a syntax error fails it.
    rules = [
        {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)}
        for i, (_, expr) in enumerate(_queries(dashboard))
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
