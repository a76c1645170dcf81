"""The Prometheus Operator objects and the Grafana dashboard ConfigMap (components/monitoring,
rendered in the prod overlay): one source each (alerts.yml, rebalancer.json), valid against
the operator's schemas (@kubernetes-models/prometheus-operator, pinned; unknown fields
fail), the rendered rules pass promtool's checks and unit tests, and the monitors select
what the manifests expose."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy.conftest import (
    COMPONENTS,
    DASHBOARD,
    OVERLAYS,
    PROMETHEUS,
    ROOT,
    documents,
    kustomize,
)
from tests.unit.deploy.prometheusrule import OUTPUT, render

CHECK = ROOT / "tests" / "unit" / "deploy" / "operator" / "check.mjs"
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


@pytest.fixture(scope="module")
def rendered(kubectl: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in kustomize(kubectl, OVERLAYS / "prod")}


def operator_check(
    models: Path, objects: list[dict[str, Any]], tmp_path: Path
) -> dict[str, list[str]]:
    path = tmp_path / "objects.json"
    path.write_text(json.dumps(objects))
    result = subprocess.run(
        ["node", str(CHECK), str(models), str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return {f"{r['kind']}/{r['name']}": r["errors"] for r in json.loads(result.stdout)}


def test_prometheusrule_is_generated_from_alerts_yml() -> None:
    assert OUTPUT.read_text() == render(), "stale: run python -m tests.unit.deploy.prometheusrule"
    (rule,) = documents(OUTPUT)
    (alerts,) = documents(PROMETHEUS / "alerts.yml")
    assert rule["spec"]["groups"] == alerts["groups"]


def test_rendered_prometheusrule_and_dashboard_are_their_sources(
    rendered: dict[tuple[str, str], dict[str, Any]],
) -> None:
    (alerts,) = documents(PROMETHEUS / "alerts.yml")
    assert rendered[("PrometheusRule", "rebalancer")]["spec"]["groups"] == alerts["groups"]
    dashboard = rendered[("ConfigMap", "rebalancer-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"] == {"rebalancer.json": DASHBOARD.read_text()}, (
        "byte for byte the JSON file"
    )
    assert {k for k, _ in rendered} >= OPERATOR_KINDS


def test_operator_objects_match_the_operator_schemas(
    rendered: dict[tuple[str, str], dict[str, Any]], operator_models: Path, tmp_path: Path
) -> None:
    objects = [o for (kind, _), o in rendered.items() if kind in OPERATOR_KINDS]
    assert {o["kind"] for o in objects} == OPERATOR_KINDS
    errors = operator_check(operator_models, objects, tmp_path)
    assert errors and all(not e for e in errors.values()), errors


def test_the_operator_check_catches_what_it_should(
    rendered: dict[tuple[str, str], dict[str, Any]], operator_models: Path, tmp_path: Path
) -> None:
    monitor = json.loads(json.dumps(rendered[("PodMonitor", "rebalancer-sidecars")]))
    monitor["spec"]["podMetricsEndpoints"][0]["prot"] = "rb-metrics"  # a typo
    rule = json.loads(json.dumps(rendered[("PrometheusRule", "rebalancer")]))
    rule["spec"]["groups"][0]["rules"][0]["for"] = 5  # not a duration string
    errors = operator_check(operator_models, [monitor, rule], tmp_path)
    assert errors["PodMonitor/rebalancer-sidecars"] == [
        "unknown field spec.podMetricsEndpoints[0].prot"
    ]
    assert any("for" in e for e in errors["PrometheusRule/rebalancer"]), errors


def test_promtool_on_the_rendered_rules(
    rendered: dict[tuple[str, str], dict[str, Any]], promtool: str, tmp_path: Path
) -> None:
    spec = rendered[("PrometheusRule", "rebalancer")]["spec"]
    (tmp_path / "alerts.yml").write_text(
        json.dumps(spec)
    )  # the rule file Prometheus gets; JSON is YAML
    check = subprocess.run(
        [promtool, "check", "rules", "alerts.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    count = sum(len(g["rules"]) for g in spec["groups"])
    assert f"{count} rules found" in check.stdout + check.stderr
    # The unit tests of alerts.yml, against the rendered rules.
    (tests,) = documents(PROMETHEUS / "alerts_test.yml")
    assert tests["rule_files"] == ["alerts.yml"]
    (tmp_path / "alerts_test.yml").write_text(json.dumps(tests))
    unit = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout + unit.stderr


def test_servicemonitor_selects_the_controller_service(
    rendered: dict[tuple[str, str], dict[str, Any]],
) -> None:
    monitor = rendered[("ServiceMonitor", "rebalancer")]
    service = rendered[("Service", "rebalancer")]
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


def test_podmonitor_selects_the_sidecars() -> None:
    (monitor,) = documents(COMPONENTS / "monitoring" / "podmonitor.yaml")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}, (
        "sidecars live in the inference namespaces"
    )
    (patch,) = documents(COMPONENTS / "sidecar" / "pod-patch.yaml")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= patch["metadata"]["labels"].items()
    (sidecar,) = patch["spec"]["initContainers"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in sidecar["ports"]}
