"""Controller shards on Kubernetes (issue 32; docs/shards.md), rendered by `kubectl
kustomize` and validated offline against Kubernetes' own schemas like the other manifests:
components/shards turns the base's Deployment into a StatefulSet of N shards (a store
each, the shard index its pod's ordinal, a headless Service giving each its name),
overlays/shards is one, overlays/prod-shards another with the prod overlay's settings
(components/prod: it runs, shard by shard, what overlays/prod runs), and
components/sidecar-shards points every sidecar at the shard that owns its pool. What they
run is what `rebalancer serve`, `rebalancer sidecar` and `rebalancer admin` accept, and
the names agree: the address a sidecar computes by the rule is a pod of the StatefulSet,
behind its Service, on its gRPC port, and the certificate template
(templates/certificate-shards-tls.yaml) covers the names the clients dial."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rebalancer.cli import build_parser
from rebalancer.controller.config import ShardConfig, check_exposure, check_shard, load_config
from rebalancer.errors import InputError
from rebalancer.wire.link import Link
from rebalancer.wire.shards import owner_shard
from tests.unit.deploy.conftest import (
    BASE,
    COMPONENTS,
    EXAMPLES,
    OVERLAYS,
    TEMPLATES,
    documents,
    kustomize,
)
from tests.unit.deploy.test_kustomize import (
    ENGINE,
    OPERATOR_GROUP,
    SIDECAR,
    SOCKET,
    by_key,
    check_leaderworkerset,
    controller,
    expand,
    pod_templates,
    projected_files,
    sidecar_checks,
    strip_sidecar,
    validate_strict,
)

SHARDS = COMPONENTS / "shards"
SIDECAR_SHARDS = COMPONENTS / "sidecar-shards"
NAME = ("StatefulSet", "rebalancer")
# (deployment, pool) pairs a sidecar may serve.
OWNERS = [("m1", "fleet"), ("m2", "fleet"), ("solo", ""), *((f"d{i}", f"p{i}") for i in range(9))]


def render(kubectl: str, folder: Path, kustomization: str) -> dict[tuple[str, str], Any]:
    folder.mkdir()
    (folder / "kustomization.yaml").write_text(kustomization)
    return by_key(kustomize(kubectl, folder))


def rel(path: Path, folder: Path) -> str:
    return os.path.relpath(path, folder)  # kustomize wants a relative path


@pytest.fixture(scope="module")
def shards_overlay(kubectl: str) -> dict[tuple[str, str], dict[str, Any]]:
    return by_key(kustomize(kubectl, OVERLAYS / "shards"))


@pytest.fixture(scope="module")
def prod_shards(kubectl: str) -> dict[tuple[str, str], dict[str, Any]]:
    return by_key(kustomize(kubectl, OVERLAYS / "prod-shards"))


@pytest.fixture(scope="module")
def prod(kubectl: str) -> dict[tuple[str, str], dict[str, Any]]:
    return by_key(kustomize(kubectl, OVERLAYS / "prod"))


@pytest.fixture
def base_with_shards(kubectl: str, tmp_path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The base with components/shards, as an overlay of one's own has it (namespace
    `rebalancer`, the one components/sidecar-shards names)."""
    folder = tmp_path / "sharded"
    return render(
        kubectl,
        folder,
        f"resources:\n  - {rel(BASE, folder)}\ncomponents:\n  - {rel(SHARDS, folder)}\n",
    )


def controller_of(objects: dict[tuple[str, str], Any]) -> dict[str, Any]:
    (c,) = objects[NAME]["spec"]["template"]["spec"]["containers"]
    return c


# The variables the StatefulSet adds to the base Deployment's container.
SHARD_ONLY_ENV = ("POD_NAMESPACE", "REBALANCER_SHARDS", "POD_INDEX")
# The downward API fields the shards' variables read.
POD_FIELDS = {"metadata.namespace", "metadata.labels['apps.kubernetes.io/pod-index']"}


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def pod_env(container: dict[str, Any], namespace: str, ordinal: int) -> dict[str, str]:
    """The container's variables as the kubelet gives them to pod `ordinal` of `namespace`:
    in order, each value's $(VAR) expanded from the variables listed before it only, the
    downward API's fields filled in (a Secret's value stands as "<secret>")."""
    fields = {
        "metadata.namespace": namespace,
        "metadata.labels['apps.kubernetes.io/pod-index']": str(ordinal),
    }
    assert set(fields) == POD_FIELDS
    out: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            out[e["name"]] = expand(e["value"], out)
        elif "fieldRef" in e["valueFrom"]:
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            out[e["name"]] = "<secret>"
    return out


def as_one_controller(sts: dict[str, Any], deployment: dict[str, Any]) -> dict[str, Any]:
    """The StatefulSet's pod template less what makes it a shard: --shard and --shards, the
    variables only shards have (SHARD_ONLY_ENV), the in-pod admin CLI's address of every
    shard (the Deployment's instead), and the store from the pod's own claim (the
    Deployment's PVC volume instead, where the Deployment has it)."""
    template = copy.deepcopy(sts["spec"]["template"])
    (c,) = template["spec"]["containers"]
    c["args"] = [a for a in c["args"] if a.partition("=")[0] not in ("--shard", "--shards")]
    c["env"] = [e for e in c["env"] if e["name"] not in SHARD_ONLY_ENV]
    (address,) = [
        e
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        if e["name"] == "REBALANCER_ADDRESS"
    ]
    c["env"][[e["name"] for e in c["env"]].index("REBALANCER_ADDRESS")] = address
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    (data,) = [v for v in volumes if "persistentVolumeClaim" in v]
    assert claim["metadata"]["name"] == data["name"]
    template["spec"]["volumes"].insert([v["name"] for v in volumes].index(data["name"]), data)
    return template


def replicas(objects: dict[tuple[str, str], Any]) -> int:
    return int(objects[NAME]["spec"]["replicas"])


def shard_names(objects: dict[tuple[str, str], Any]) -> tuple[list[str], str, str, int]:
    """(pod names, headless Service, namespace, gRPC port) of the rendered shards."""
    sts = objects[NAME]
    service = objects[("Service", sts["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None", "headless: a DNS name per shard"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in controller_of(objects)["ports"]}
    (grpc_port,) = [p for p in service["spec"]["ports"] if p["targetPort"] == "grpc"]
    assert grpc_port["port"] == ports["grpc"]
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(replicas(objects))]
    return pods, service["metadata"]["name"], sts["metadata"]["namespace"], ports["grpc"]


@pytest.mark.parametrize("where", ["overlay", "component", "prod-shards"])
def test_the_shards_validate_strictly(
    where: str,
    shards_overlay: dict[tuple[str, str], dict[str, Any]],
    base_with_shards: dict[tuple[str, str], dict[str, Any]],
    prod_shards: dict[tuple[str, str], dict[str, Any]],
    kubernetes_validate: Any,
) -> None:
    objects = {"overlay": shards_overlay, "component": base_with_shards}.get(where, prod_shards)
    builtin = [o for o in objects.values() if not o["apiVersion"].startswith(OPERATOR_GROUP)]
    for obj in builtin:
        validate_strict(kubernetes_validate, obj, f"shards ({where})")
    kinds = {kind for kind, _ in objects}
    assert "StatefulSet" in kinds
    assert "Deployment" not in kinds and "PersistentVolumeClaim" not in kinds, (
        "one store per shard: the single controller's Deployment and PVC are gone"
    )


def test_the_statefulset_is_the_base_deployment_but_for_the_shards() -> None:
    """Its pod template is the base Deployment's, but for what makes it a shard: the store
    from its own claim, --shard from the pod's ordinal, --shards, and the in-pod admin
    CLI's address of every shard."""
    (deployment,) = documents(BASE / "deployment.yaml")
    (pvc,) = documents(BASE / "pvc.yaml")
    (sts,) = documents(SHARDS / "statefulset.yaml")
    assert sts["metadata"] == deployment["metadata"] | {"name": sts["metadata"]["name"]}
    assert sts["spec"]["selector"] == deployment["spec"]["selector"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    n = sts["spec"]["replicas"]
    assert c["args"][-2:] == ["--shard=$(POD_INDEX)", f"--shards={n}"]
    env = env_of(c)
    assert env["REBALANCER_SHARDS"]["value"] == str(n)
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["REBALANCER_ADDRESS"]["value"] == (
        "rebalancer-{shard}.rebalancer.$(POD_NAMESPACE).svc:50051"
    )
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"] == pvc["spec"]
    assert as_one_controller(sts, deployment) == deployment["spec"]["template"]


def test_each_shard_serves_its_ordinal(
    shards_overlay: dict[tuple[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    sts = shards_overlay[NAME]["spec"]
    c = controller_of(shards_overlay)
    n = replicas(shards_overlay)
    assert n == 3 and sts["podManagementPolicy"] == "Parallel"
    assert sts["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain",
        "whenScaled": "Retain",
    }
    # controller.toml from the ConfigMap the pod mounts: the store on the shard's own claim.
    pod_spec = sts["template"]["spec"]
    (claim,) = sts["volumeClaimTemplates"]
    claimed = {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": "x"}}
    mounted = {**pod_spec, "volumes": [*pod_spec["volumes"], claimed]}  # as the pod gets it
    args0 = build_parser().parse_args([expand(a, {"POD_INDEX": "0"}) for a in c["args"]])
    name, key = projected_files(mounted, c)[args0.config]
    (tmp_path / "controller.toml").write_text(shards_overlay[("ConfigMap", name)]["data"][key])
    config = load_config(tmp_path / "controller.toml")
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert config.db_path.startswith(mount["mountPath"] + "/")
    assert claim["metadata"]["name"] not in {v["name"] for v in pod_spec["volumes"]}
    for ordinal in range(n):
        argv = [expand(a, {"POD_INDEX": str(ordinal)}) for a in [*c["command"], *c["args"]]]
        args = build_parser().parse_args(argv[1:])  # the real CLI accepts these flags
        assert argv[:2] == ["rebalancer", "serve"] and (args.shard, args.shards) == (ordinal, n)
        check_shard(ShardConfig(args.shard, args.shards))
        check_exposure(replace(config, insecure=args.insecure))  # dev-style: --insecure
    env = env_of(c)
    assert env["REBALANCER_SHARDS"]["value"] == str(n) and "REBALANCER_ADMIN_TOKEN" not in env


def test_the_admin_cli_in_a_shard_asks_every_shard(
    base_with_shards: dict[tuple[str, str], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kubectl exec rebalancer-0 -- rebalancer admin status` reads the pod's variables: it
    asks every shard by the name the headless Service gives it, which the NetworkPolicy
    lets it reach."""
    pods, service, namespace, port = shard_names(base_with_shards)
    env = pod_env(controller_of(base_with_shards), namespace, ordinal=0)
    monkeypatch.setenv("REBALANCER_ADDRESS", env["REBALANCER_ADDRESS"])
    monkeypatch.setenv("REBALANCER_SHARDS", env["REBALANCER_SHARDS"])
    args = build_parser().parse_args(["admin", "status"])
    link = Link(args.address, shards=int(args.shards))
    assert [link.shard(i).address for i in range(link.shards)] == [
        f"{pod}.{service}.{namespace}.svc:{port}" for pod in pods
    ]
    policy = base_with_shards[("NetworkPolicy", "rebalancer")]["spec"]["ingress"][0]
    labels = base_with_shards[NAME]["spec"]["template"]["metadata"]["labels"]
    assert port in [p["port"] for p in policy["ports"]]
    assert any(
        "namespaceSelector" not in peer
        and peer["podSelector"]["matchLabels"].items() <= labels.items()
        for peer in policy["from"]
    )


def render_workloads(
    kubectl: str, workloads: list[dict[str, Any]], tmp_path: Path
) -> list[dict[str, Any]]:
    folder = tmp_path / "workload"
    folder.mkdir()
    (folder / "workloads.yaml").write_text("\n---\n".join(json.dumps(w) for w in workloads))
    (folder / "kustomization.yaml").write_text(
        "resources:\n  - workloads.yaml\ncomponents:\n"
        f"  - {rel(COMPONENTS / 'sidecar', folder)}\n  - {rel(SIDECAR_SHARDS, folder)}\n"
    )
    return kustomize(kubectl, folder)


def test_the_sidecar_reaches_the_shard_that_owns_its_pool(
    kubectl: str,
    kubernetes_validate: Any,
    base_with_shards: dict[tuple[str, str], dict[str, Any]],
    tmp_path: Path,
) -> None:
    """components/sidecar then components/sidecar-shards, on the example workloads (a Pod,
    a LeaderWorkerSet) and a Deployment: every sidecar still runs what `rebalancer sidecar`
    accepts, and for any pool or deployment it computes the name of the StatefulSet's pod
    that owns it, behind the Service, on the gRPC port; the engine still talks to the
    socket only."""
    from rebalancer.cli.sidecar_cmd import link_of
    from rebalancer.sidecar.config import SidecarConfig, lws_ranks, parse_ranks

    pods, service, namespace, port = shard_names(base_with_shards)
    n = replicas(base_with_shards)
    workloads = [
        strip_sidecar(next(d for d in documents(EXAMPLES / name) if d["kind"] == kind))
        for name, kind in (
            ("inference-pod.yaml", "Pod"),
            ("leaderworkerset.yaml", "LeaderWorkerSet"),
        )
    ]
    workloads.append(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "e", "labels": {"rebalancer.io/sidecar": "true"}},
            "spec": {
                "selector": {"matchLabels": {"app": "e"}},
                "template": {
                    "metadata": {"labels": {"app": "e"}},
                    "spec": {"containers": [{"name": ENGINE, "image": "engine:1"}]},
                },
            },
        }
    )
    rendered = render_workloads(kubectl, workloads, tmp_path)
    assert len(rendered) == 3
    templates = 0
    for obj in rendered:
        if obj["kind"] == "LeaderWorkerSet":
            check_leaderworkerset(obj)
        for where, template in pod_templates(obj):
            if obj["kind"] == "LeaderWorkerSet":
                wrapped = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"t-{where.lower()}"},
                    "template": template,
                }
                validate_strict(kubernetes_validate, wrapped, f"sidecar-shards {where}")
            else:
                validate_strict(kubernetes_validate, obj, "sidecar-shards")
            sidecar_checks(template, obj["kind"])  # as components/sidecar alone makes it
            (sidecar,) = [c for c in template["spec"]["initContainers"] if c["name"] == SIDECAR]
            env = {e["name"]: e.get("value", "") for e in sidecar["env"]}
            assert env["REBALANCER_SHARDS"] == str(n), "the clients' N is the StatefulSet's"
            # Without the TLS files (they are not here), as against overlays/shards.
            env.update(REBALANCER_TLS_CA="", REBALANCER_TLS_CERT="", REBALANCER_TLS_KEY="")
            args = build_parser().parse_args([expand(a, env) for a in sidecar["args"]])
            ranks = (
                lws_ranks({"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "1"}, args.ranks_per_pod)
                if args.ranks_per_pod
                else parse_ranks(args.ranks)
            )
            config = SidecarConfig(link=link_of(args, env), ranks=ranks, listen=args.listen)
            for deployment, pool in OWNERS:
                owner = owner_shard(deployment, pool, n)
                assert config.channel().routed(deployment, pool).address == (
                    f"{pods[owner]}.{service}.{namespace}.svc.cluster.local:{port}"
                )
            (engine,) = [c for c in template["spec"]["containers"] if c["name"] == ENGINE]
            assert env_of(engine)["REBALANCER_ADDRESS"]["value"] == SOCKET
            assert "REBALANCER_SHARDS" not in env_of(engine)
            templates += 1
    assert templates == 4  # the Pod, the Deployment, the LeaderWorkerSet's two


# ----------------------------------------------------------------------- overlays/prod-shards
# The prod overlay's settings (components/prod) on the shards: what prod's one controller
# runs, run by every shard, and the certificate template naming what the clients dial.

CERTIFICATE = TEMPLATES / "certificate-shards-tls.yaml"
TLS_SECRET = "rebalancer-tls"


def shard_serve_config(
    objects: dict[tuple[str, str], Any], ordinal: int, tmp_path: Path
) -> tuple[Any, Any, dict[str, tuple[str, str]]]:
    """(parsed args, ControllerConfig, mounted files) of shard `ordinal` as `rebalancer serve`
    builds them in its pod: the args with the pod's variables expanded, the real parser,
    controller.toml from the ConfigMap mounted at --config, the flags over it (an admin
    token stands for the file's)."""
    sts = objects[NAME]
    pod_spec = sts["spec"]["template"]["spec"]
    c = controller_of(objects)
    env = pod_env(c, sts["metadata"]["namespace"], ordinal)
    argv = [expand(a, env) for a in [*c["command"], *c["args"]]]
    assert argv[:2] == ["rebalancer", "serve"]
    args = build_parser().parse_args(argv[1:])
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    claimed = {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": "x"}}
    files = projected_files({**pod_spec, "volumes": [*pod_spec["volumes"], claimed]}, c)
    name, key = files[args.config]
    (tmp_path / "controller.toml").write_text(objects[("ConfigMap", name)]["data"][key])
    config = load_config(tmp_path / "controller.toml")
    overrides = {
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
        "insecure": args.insecure,
    }
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if args.admin_token_file:
        config = replace(config, admin_token="a token read from the file")
    return args, config, files


def test_prod_shards_run_what_prod_runs(
    prod_shards: dict[tuple[str, str], dict[str, Any]],
    prod: dict[tuple[str, str], dict[str, Any]],
) -> None:
    """Every setting of prod's one controller (TLS flags and files, the admin token, probes,
    requests and limits, PriorityClass, image, security context) is the shards' too: the
    StatefulSet less what makes it a shard is prod's Deployment, and the rest of the
    objects are prod's but for the shards' own (Service, NetworkPolicy)."""
    deployment = prod[("Deployment", "rebalancer")]
    assert as_one_controller(prod_shards[NAME], deployment) == deployment["spec"]["template"]
    for key in set(prod) - {
        ("Deployment", "rebalancer"),
        ("PersistentVolumeClaim", "rebalancer-data"),
    }:
        if key not in {("Service", "rebalancer"), ("NetworkPolicy", "rebalancer")}:
            assert prod_shards[key] == prod[key], key
    assert set(prod_shards) - set(prod) == {NAME}
    namespaces = {o["metadata"].get("namespace") for o in prod_shards.values()}
    assert namespaces == {"rebalancer", None}  # None: the Namespace, the PriorityClass


def test_prod_shards_serve_mutual_tls_with_the_admin_token(
    prod_shards: dict[tuple[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    n = replicas(prod_shards)
    assert n == 3
    for ordinal in range(n):
        args, config, files = shard_serve_config(prod_shards, ordinal, tmp_path)
        assert (args.shard, args.shards) == (ordinal, n), "the pod's ordinal is its shard"
        check_shard(ShardConfig(args.shard, args.shards))
        assert files[args.tls_cert] == (TLS_SECRET, "tls.crt")
        assert files[args.tls_key] == (TLS_SECRET, "tls.key")
        assert files[args.tls_client_ca] == (TLS_SECRET, "ca.crt")
        assert files[args.admin_token_file] == ("rebalancer-admin-token", "token")
        assert not args.insecure
        check_exposure(config)  # mutual TLS authenticates both services on 0.0.0.0
        with pytest.raises(InputError, match="refusing to listen"):
            check_exposure(replace(config, tls_client_ca=None))  # without it: refused
    c = controller_of(prod_shards)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in c[probe] and c[probe]["tcpSocket"] == {"port": "grpc"}, probe
    env = pod_env(c, "rebalancer", 0)
    assert env["REBALANCER_ADMIN_TOKEN"] == "<secret>" and env["REBALANCER_SHARDS"] == str(n)


def test_prod_shards_resources_priority_and_image_are_prods(
    prod_shards: dict[tuple[str, str], dict[str, Any]],
    prod: dict[tuple[str, str], dict[str, Any]],
) -> None:
    c, one = controller_of(prod_shards), controller(prod)
    assert c["resources"] == one["resources"] and "cpu" not in c["resources"]["limits"]
    assert c["resources"]["requests"]["cpu"] == "2"  # prod's, not the base's 1
    assert c["image"] == one["image"] and "/" in c["image"], "the registry, as prod"
    pod_spec = prod_shards[NAME]["spec"]["template"]["spec"]
    priority = prod_shards[("PriorityClass", pod_spec["priorityClassName"])]
    assert priority["preemptionPolicy"] == "Never" and priority["globalDefault"] is False


def test_prod_shards_are_shards(prod_shards: dict[tuple[str, str], dict[str, Any]]) -> None:
    """One store per shard, each behind its own name: no Deployment, no single PVC, the
    Service headless."""
    kinds = {kind for kind, _ in prod_shards}
    assert "Deployment" not in kinds and "PersistentVolumeClaim" not in kinds
    pods, service, namespace, port = shard_names(prod_shards)  # asserts headless
    assert (pods, service, namespace, port) == (
        ["rebalancer-0", "rebalancer-1", "rebalancer-2"],
        "rebalancer",
        "rebalancer",
        50051,
    )
    (claim,) = prod_shards[NAME]["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_prod_shards_monitoring_scrapes_every_shard(
    prod_shards: dict[tuple[str, str], dict[str, Any]],
    operator_models: Path,
    tmp_path: Path,
) -> None:
    """The ServiceMonitor selects the headless Service, whose endpoints are every shard's
    pod (its selector picks the StatefulSet's pods), on the containers' metrics port, which
    the NetworkPolicy opens to Prometheus; the operator objects fit the operator's schemas."""
    from tests.unit.deploy.test_operator import OPERATOR_KINDS, operator_check

    monitor = prod_shards[("ServiceMonitor", "rebalancer")]
    service = prod_shards[("Service", "rebalancer")]
    labels = prod_shards[NAME]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert service["spec"]["selector"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    ports = {p["name"]: p["containerPort"] for p in controller_of(prod_shards)["ports"]}
    assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]
    policy = prod_shards[("NetworkPolicy", "rebalancer")]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert any(
        {"port": ports["metrics"], "protocol": "TCP"} in rule["ports"] for rule in policy["ingress"]
    )
    objects = [o for (kind, _), o in prod_shards.items() if kind in OPERATOR_KINDS]
    assert {o["kind"] for o in objects} == OPERATOR_KINDS
    errors = operator_check(operator_models, objects, tmp_path)
    assert errors and all(not e for e in errors.values()), errors


def test_prod_shards_reach_each_others_grpc_port(
    prod_shards: dict[tuple[str, str], dict[str, Any]],
) -> None:
    """The gRPC rule admits the shards (their namespace: a peer without namespaceSelector)
    beside the sidecars and ranks of any namespace."""
    policy = prod_shards[("NetworkPolicy", "rebalancer")]["spec"]
    labels = prod_shards[NAME]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    (grpc_rule,) = [
        r for r in policy["ingress"] if {"port": 50051, "protocol": "TCP"} in r["ports"]
    ]
    peers = grpc_rule["from"]
    assert any(
        "namespaceSelector" not in p and p["podSelector"]["matchLabels"].items() <= labels.items()
        for p in peers
    ), "the admin CLI inside one shard asks the others"
    clients = [p["podSelector"]["matchLabels"] for p in peers if p.get("namespaceSelector") == {}]
    assert {"rebalancer.io/sidecar": "true"} in clients and {
        "rebalancer.io/worker": "true"
    } in clients


def covers(pattern: str, host: str) -> bool:
    """Whether a certificate's DNS name `pattern` covers `host` as gRPC checks every call's
    host: exactly, or `*.X` for one label then X, where X has two labels or more (a wildcard
    over one label, *.rebalancer, covers nothing there)."""
    host, pattern = host.lower().rstrip("."), pattern.lower()
    if not pattern.startswith("*."):
        return host == pattern
    suffix = pattern[2:]
    first, _, rest = host.partition(".")
    return "." in suffix and bool(first) and rest == suffix


def test_the_certificate_template_names_what_the_clients_dial(
    prod_shards: dict[tuple[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    """templates/certificate-shards-tls.yaml writes the Secret the shards mount, in their
    namespace, for server and client use (the admin CLI in a shard presents it), with names
    covering every shard's name as the sidecars (components/sidecar-shards) and the admin
    CLI in a shard dial it: tests/integration/test_shards_tls.py shows it with real shards."""
    (cert,) = documents(CERTIFICATE)
    spec = cert["spec"]
    assert cert["apiVersion"] == "cert-manager.io/v1" and cert["kind"] == "Certificate"
    pods, service, namespace, port = shard_names(prod_shards)
    args, _, files = shard_serve_config(prod_shards, 0, tmp_path)
    mounted = {files[args.tls_cert][0], files[args.tls_key][0], files[args.tls_client_ca][0]}
    assert cert["metadata"]["namespace"] == namespace and mounted == {spec["secretName"]}
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert "REPLACE" in spec["issuerRef"]["name"], "a placeholder for the operator's Issuer"
    for name in spec["dnsNames"]:
        assert not name.startswith("*.") or "." in name[2:], f"{name}: gRPC never matches it"
    (patch,) = documents(SIDECAR_SHARDS / "pod-patch.yaml")
    (sidecar,) = patch["spec"]["initContainers"]
    sidecar_address = {e["name"]: e["value"] for e in sidecar["env"]}["REBALANCER_ADDRESS"]
    c = controller_of(prod_shards)
    for i, pod in enumerate(pods):
        dialled = [
            Link(sidecar_address, shards=len(pods)).shard(i).address,
            Link(pod_env(c, namespace, 0)["REBALANCER_ADDRESS"], shards=len(pods)).shard(i).address,
        ]
        assert dialled == [
            f"{pod}.{service}.{namespace}.svc.cluster.local:{port}",
            f"{pod}.{service}.{namespace}.svc:{port}",
        ]
        for address in dialled:
            host = address.rsplit(":", 1)[0]
            assert any(covers(n, host) for n in spec["dnsNames"]), host
    assert not any(covers(n, f"{service}.{namespace}.svc.cluster.local") for n in spec["dnsNames"])


def test_covers_follows_grpcs_rule() -> None:
    assert covers("*.rebalancer.rebalancer.svc", "rebalancer-1.rebalancer.rebalancer.svc")
    assert not covers("*.rebalancer.rebalancer.svc", "a.rebalancer-1.rebalancer.rebalancer.svc")
    assert not covers("*.rebalancer.rebalancer.svc", "rebalancer.rebalancer.svc")
    assert not covers("*.rebalancer", "rebalancer-1.rebalancer")  # gRPC: call host mismatch
    assert covers("rebalancer-1.rebalancer", "rebalancer-1.rebalancer")
