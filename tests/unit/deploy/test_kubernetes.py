"""deploy/kubernetes: every manifest parses, and what the base's Deployment, Service,
probes, NetworkPolicy and ConfigMap say agrees with deploy/controller.toml and with
`rebalancer serve`, read from the files as written (no tool needed; test_kustomize.py
checks what kustomize renders from them)."""

from __future__ import annotations

import posixpath
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from rebalancer.cli import build_parser
from rebalancer.controller.config import load_config
from tests.unit.deploy.conftest import (
    BASE,
    CONTROLLER_TOML,
    EXAMPLES,
    KUBERNETES,
    base_files,
    documents,
    kustomization,
    manifest_files,
)

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
NAMESPACE = "rebalancer"
CLUSTER_SCOPED = {"Namespace", "PriorityClass"}
SIDECAR_LABEL = ("rebalancer.io/sidecar", "true")  # components/sidecar puts it on pods
WORKER_LABEL = ("rebalancer.io/worker", "true")  # ranks that dial the controller directly
CONFIG_PATH = "/etc/rebalancer/controller.toml"


def _pod(manifests: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return manifests[("Deployment", "rebalancer")]["spec"]["template"]


def _container(manifests: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    containers = _pod(manifests)["spec"]["containers"]
    assert len(containers) == 1, "the controller pod runs one container"
    return containers[0]


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == name]
    return volume


def _mount_of(container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume mount whose mountPath holds `path` (deepest wins)."""
    hits = [
        m
        for m in container["volumeMounts"]
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert hits, f"{path} is on no volume mount"
    return max(hits, key=lambda m: len(m["mountPath"]))


def test_the_manifests_are_there() -> None:
    names = {p.relative_to(KUBERNETES).as_posix() for p in manifest_files()}
    assert {
        *(
            f"base/{n}.yaml"
            for n in (
                "namespace",
                "serviceaccount",
                "deployment",
                "service",
                "pvc",
                "pdb",
                "networkpolicy",
            )
        ),
        "templates/secret-admin-token.yaml",
        "examples/inference-pod.yaml",
        "examples/leaderworkerset.yaml",
        "components/prod/priorityclass.yaml",
        "components/monitoring/servicemonitor.yaml",
        "components/monitoring/podmonitor.yaml",
    } <= names


def test_the_base_lists_its_files() -> None:
    """Every manifest of base/ is a resource of its kustomization, and the other way round."""
    listed = [p.name for p in base_files()]
    assert len(listed) == len(set(listed))
    present = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == present
    assert kustomization(BASE)["kind"] == "Kustomization"


@pytest.mark.parametrize(
    "path", manifest_files(), ids=lambda p: p.relative_to(KUBERNETES).as_posix()
)
def test_every_manifest_parses_and_names_its_object(path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path.name}: no document"
    for doc in docs:
        assert isinstance(doc, dict), f"{path.name}: a document is not a mapping"
        assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], (
            f"{path.name}: apiVersion"
        )
        assert isinstance(doc.get("kind"), str) and doc["kind"][:1].isupper(), f"{path.name}: kind"
        name = (doc.get("metadata") or {}).get("name")
        assert isinstance(name, str) and DNS_LABEL.match(name) and len(name) <= 63, (
            f"{path.name}: metadata.name {name!r}"
        )
        if doc["kind"] not in CLUSTER_SCOPED:
            namespace = doc["metadata"].get("namespace")
            assert namespace, f"{path.name}: {doc['kind']} {name} has no namespace"
            if path.parent == BASE:
                assert namespace == NAMESPACE


def test_the_kinds_a_platform_team_applies(
    manifests: dict[tuple[str, str], dict[str, Any]],
) -> None:
    kinds = {kind for kind, _ in manifests}
    assert {
        "Namespace",
        "ServiceAccount",
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "NetworkPolicy",
    } <= kinds
    assert ("Namespace", NAMESPACE) in manifests
    # The examples are no part of the base.
    assert all(doc["metadata"].get("namespace") != "inference" for doc in manifests.values())
    # Secrets are referenced by the base, never created by it (templates/ only).
    assert not [p for p in base_files() if any(d["kind"] == "Secret" for d in documents(p))]


def test_configmap_holds_controller_toml(
    manifests: dict[tuple[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    text = manifests[("ConfigMap", "rebalancer-config")]["data"]["controller.toml"]
    assert tomllib.loads(text) == tomllib.loads(CONTROLLER_TOML.read_text())
    # And the controller's own loader accepts it as is.
    (tmp_path / "controller.toml").write_text(text)
    config = load_config(tmp_path / "controller.toml")
    assert config.host not in ("127.0.0.1", "localhost", "::1"), (
        "a loopback host is unreachable for probes and ranks"
    )
    assert config.metrics_port, "the scrape annotation needs a fixed metrics port"


def test_deployment_runs_serve_with_the_mounted_config(
    manifests: dict[tuple[str, str], dict[str, Any]],
) -> None:
    deployment = manifests[("Deployment", "rebalancer")]
    assert deployment["spec"]["replicas"] == 1, "single controller: its state is one SQLite file"
    assert deployment["spec"]["strategy"]["type"] == "Recreate", (
        "two controllers must never share the store"
    )
    c = _container(manifests)
    argv = [*c.get("command", []), *c["args"]]
    assert argv[:2] == ["rebalancer", "serve"]
    args = build_parser().parse_args(argv[1:])  # the real CLI accepts exactly these flags
    assert args.config == CONFIG_PATH
    # controller.toml comes from the ConfigMap, at the path --config names.
    pod = _pod(manifests)
    mount = _mount_of(c, CONFIG_PATH)
    relative = posixpath.relpath(CONFIG_PATH, mount["mountPath"])
    volume = _volume(pod, mount["name"])
    sources = volume["projected"]["sources"] if "projected" in volume else [volume]
    items = [
        (s["configMap"]["name"], item)
        for s in sources
        if "configMap" in s
        for item in s["configMap"]["items"]
    ]
    assert ("rebalancer-config", {"key": "controller.toml", "path": relative}) in items
    # The admin token file is projected from the Secret the template creates.
    token_path = args.admin_token_file
    assert token_path, "the admin API must not run unauthenticated in a cluster"
    mount = _mount_of(c, token_path)
    relative = posixpath.relpath(token_path, mount["mountPath"])
    volume = _volume(pod, mount["name"])
    sources = volume["projected"]["sources"] if "projected" in volume else [volume]
    secrets = [
        (s["secret"]["name"], item)
        for s in sources
        if "secret" in s
        for item in s["secret"]["items"]
    ]
    assert len(secrets) == 1 and secrets[0][1]["path"] == relative
    name, item = secrets[0]
    assert item["key"] in manifests[("Secret", name)]["stringData"]


def test_ports_and_probes_agree_with_controller_toml(
    manifests: dict[tuple[str, str], dict[str, Any]], controller_toml: dict[str, Any]
) -> None:
    server = controller_toml["server"]
    c = _container(manifests)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": server["port"], "metrics": server["metrics_port"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == server["port"], probe
        assert c[probe]["grpc"].get("service", "") == "", (
            f"{probe}: the overall health (service '')"
        )
    service = manifests[("Service", "rebalancer")]
    by_target = {p["targetPort"]: p["port"] for p in service["spec"]["ports"]}
    assert by_target == {"grpc": server["port"], "metrics": server["metrics_port"]}
    grpc_port = next(p for p in service["spec"]["ports"] if p["targetPort"] == "grpc")
    assert grpc_port.get("appProtocol") == "grpc"
    annotations = _pod(manifests)["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(server["metrics_port"])
    assert annotations["prometheus.io/path"] == "/metrics"
    # The in-pod admin CLI talks to the gRPC port.
    env = {e["name"]: e for e in c["env"]}
    assert env["REBALANCER_ADDRESS"]["value"].rsplit(":", 1)[1] == str(server["port"])


def test_selectors_pick_the_controller_pod(
    manifests: dict[tuple[str, str], dict[str, Any]],
) -> None:
    labels = _pod(manifests)["metadata"]["labels"]
    deployment = manifests[("Deployment", "rebalancer")]
    for selector in (
        deployment["spec"]["selector"]["matchLabels"],
        manifests[("Service", "rebalancer")]["spec"]["selector"],
        manifests[("PodDisruptionBudget", "rebalancer")]["spec"]["selector"]["matchLabels"],
    ):
        assert selector and all(labels.get(k) == v for k, v in selector.items()), selector


def test_sigterm_drain_fits_in_the_grace_period(
    manifests: dict[tuple[str, str], dict[str, Any]], controller_toml: dict[str, Any]
) -> None:
    from rebalancer.controller.config import ControllerConfig

    server = controller_toml["server"]
    grace = server.get("grace_seconds", ControllerConfig.grace_seconds)
    drain = server.get("drain_seconds", ControllerConfig.drain_seconds)
    period = _pod(manifests)["spec"]["terminationGracePeriodSeconds"]
    # NOT_SERVING for drain_seconds, calls in flight get grace_seconds, then the ingest
    # cursor is saved and the store closed.
    assert period >= drain + grace + 5, (period, drain, grace)


def test_store_is_on_the_persistent_volume(
    manifests: dict[tuple[str, str], dict[str, Any]], controller_toml: dict[str, Any]
) -> None:
    db_path = controller_toml["server"]["db_path"]
    c = _container(manifests)
    mount = _mount_of(c, db_path)
    # SQLite writes -wal/-shm files beside the database: the directory must be writable.
    assert mount["mountPath"] == posixpath.dirname(db_path)
    assert not mount.get("readOnly", False)
    claim = _volume(_pod(manifests), mount["name"])["persistentVolumeClaim"]["claimName"]
    pvc = manifests[("PersistentVolumeClaim", claim)]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert pvc["spec"]["resources"]["requests"]["storage"]


def test_non_root_with_a_read_only_root_filesystem(
    manifests: dict[tuple[str, str], dict[str, Any]], controller_toml: dict[str, Any]
) -> None:
    pod = _pod(manifests)
    c = _container(manifests)
    pod_sc, sc = pod["spec"].get("securityContext", {}), c.get("securityContext", {})
    assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True
    assert sc.get("runAsUser", pod_sc.get("runAsUser", 0)) != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod_sc.get("fsGroup"), "the data volume must be writable by the non-root user"
    # Writable mounts: the data directory and a scratch /tmp, nothing else.
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly", False)}
    assert writable == {posixpath.dirname(controller_toml["server"]["db_path"]), "/tmp"}
    tmp = _volume(pod, _mount_of(c, "/tmp/x")["name"])
    assert "emptyDir" in tmp


def test_admin_token_secret_is_a_template(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    secret = manifests[("Secret", "rebalancer-admin-token")]
    assert secret["type"] == "Opaque"
    assert "REPLACE" in secret["stringData"]["token"], "ship a placeholder, never a usable token"
    env = {e["name"]: e for e in _container(manifests)["env"]}
    ref = env["REBALANCER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("rebalancer-admin-token", "token")


def test_service_account_without_token(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    spec = _pod(manifests)["spec"]
    account = manifests[("ServiceAccount", spec["serviceAccountName"])]
    assert account["automountServiceAccountToken"] is False
    assert spec["automountServiceAccountToken"] is False, "the controller calls no Kubernetes API"


def test_network_policy_admits_ranks_and_prometheus_only(
    manifests: dict[tuple[str, str], dict[str, Any]], controller_toml: dict[str, Any]
) -> None:
    server = controller_toml["server"]
    policy = manifests[("NetworkPolicy", "rebalancer")]["spec"]
    labels = _pod(manifests)["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    by_port: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["ingress"]:
        (port,) = rule["ports"]
        assert port["protocol"] == "TCP"
        by_port.setdefault(port["port"], []).extend(rule["from"])
    assert set(by_port) == {server["port"], server["metrics_port"]}, (
        "only the gRPC and metrics ports"
    )
    grpc_peers = {
        tuple(peer["podSelector"]["matchLabels"].items()) for peer in by_port[server["port"]]
    }
    assert grpc_peers == {(SIDECAR_LABEL,), (WORKER_LABEL,)}
    for peer in by_port[server["port"]] + by_port[server["metrics_port"]]:
        assert peer["podSelector"]["matchLabels"], "every peer is a label selector, never everyone"
    (prometheus,) = by_port[server["metrics_port"]]
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert prometheus["namespaceSelector"]["matchLabels"]


def test_inference_pod_example_goes_through_the_sidecar(
    manifests: dict[tuple[str, str], dict[str, Any]], controller_toml: dict[str, Any]
) -> None:
    docs = documents(EXAMPLES / "inference-pod.yaml")
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    service = manifests[("Service", "rebalancer")]
    (sidecar,) = pod["spec"]["initContainers"]
    env = {e["name"]: e for e in sidecar["env"]}
    host, port = env["REBALANCER_ADDRESS"]["value"].rsplit(":", 1)
    assert int(port) == controller_toml["server"]["port"]
    assert host.split(".")[:3] == [
        service["metadata"]["name"],
        service["metadata"]["namespace"],
        "svc",
    ]
    # The token comes from the Secret the example ships (a placeholder), into the sidecar.
    (credentials,) = [v for v in pod["spec"]["volumes"] if v["name"] == "rebalancer-credentials"]
    token_source = credentials["projected"]["sources"][0]["secret"]
    assert token_source["items"][0]["key"] in secrets[token_source["name"]]["stringData"]
    assert "REPLACE" in secrets[token_source["name"]]["stringData"]["token"]
    assert secrets[token_source["name"]]["metadata"]["namespace"] == pod["metadata"]["namespace"]
    (engine,) = pod["spec"]["containers"]
    engine_env = {e["name"]: e for e in engine["env"]}
    assert engine_env["REBALANCER_ADDRESS"]["value"] == "unix:///run/rebalancer/agent.sock"
