"""deploy/prometheus: the rules load and their unit tests pass under promtool, every
alert is exercised, and every expression (and every series of its unit tests) selects
only series a live controller exposes, suffixes included (tests/unit/deploy/live.py)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.unit.deploy.conftest import PROMETHEUS, documents
from tests.unit.deploy.promql import metric_names

REQUIRED = {
    "RebalancerBalancednessLow",
    "RebalancerPlansAborting",
    "RebalancerRanksDisconnected",
    "RebalancerIngestLatencyHigh",
    "RebalancerNoWindowsIngested",
    "RebalancerPlanStuck",
    "RebalancerStoreErrors",
}


def _rules() -> list[dict[str, Any]]:
    (doc,) = documents(PROMETHEUS / "alerts.yml")
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _tests() -> dict[str, Any]:
    (doc,) = documents(PROMETHEUS / "alerts_test.yml")
    return doc


def test_promtool_check_rules(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "check", "rules", "alerts.yml"],
        cwd=PROMETHEUS,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(_rules())} rules found" in result.stdout + result.stderr


def test_promtool_test_rules(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"],
        cwd=PROMETHEUS,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_the_alerts_we_page_on() -> None:
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "alert names are unique"
    assert REQUIRED <= set(names)
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_every_alert_is_exercised_firing_and_silent() -> None:
    doc = _tests()
    assert doc["rule_files"] == ["alerts.yml"]
    fires: set[str] = set()
    silent: set[str] = set()
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else silent).add(check["alertname"])
    names = {r["alert"] for r in _rules()}
    assert fires == names, f"never seen firing: {names - fires}"
    assert silent == names, (
        f"never seen silent (before `for`, or on a healthy series): {names - silent}"
    )


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_alert_selects_only_exported_metrics(
    rule: dict[str, Any], exported_metrics: set[str]
) -> None:
    names = metric_names(rule["expr"])
    assert names, f"no metric found in {rule['expr']!r}"
    unknown = names - exported_metrics
    assert not unknown, f"{rule['alert']}: not exported by the controller: {sorted(unknown)}"


def test_alert_test_series_are_exported_metrics(exported_metrics: set[str]) -> None:
    for case in _tests()["tests"]:
        for series in case["input_series"]:
            name = series["series"].split("{", 1)[0]
            assert name in exported_metrics, f"{case['name']}: {name}"
