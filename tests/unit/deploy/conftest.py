"""Fixtures of the deploy tests: the files under deploy/, promtool, and the metric
names a real controller exports (scraped, not copied from the code)."""

from __future__ import annotations

import os
import re
import shutil
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy.yamlish import load_all

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "rebalancer.json"
CONTROLLER_TOML = DEPLOY / "controller.toml"

# Histogram and counter series carry these after the family's base name.
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def base_name(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def manifest_files() -> list[Path]:
    return sorted(KUBERNETES.rglob("*.yaml")) + sorted(KUBERNETES.rglob("*.yml"))


def documents(path: Path) -> list[Any]:
    return load_all(path.read_text())


@pytest.fixture(scope="session")
def controller_toml() -> dict[str, Any]:
    return tomllib.loads(CONTROLLER_TOML.read_text())


@pytest.fixture(scope="session")
def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, over every manifest applied by `kubectl apply -f deploy/kubernetes/`."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in documents(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{path.name}: {key} defined twice"
            out[key] = doc
    return out


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing in CI (.ci/run provides it)")
        pytest.skip("promtool not installed (.ci/run provides it)")
    return path


@pytest.fixture(scope="session")
def exported_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Base names of every metric family a freshly started controller exposes."""
    from tests.integration.conftest import start_controller

    ctl = start_controller(tmp_path_factory.mktemp("ctl") / "c.sqlite", metrics_port=0)
    try:
        assert ctl.server is not None and ctl.server.metrics_port
        url = f"http://127.0.0.1:{ctl.server.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        ctl.stop()
    names = {base_name(m) for m in re.findall(r"^# TYPE (\S+) \S+$", text, re.M)}
    names |= {base_name(m) for m in re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M)}
    # prometheus_client's creation-time series are not part of the contract.
    names = {n for n in names if not n.endswith("_created")}
    assert "rebalancer_placement_version" in names, text
    yield names
