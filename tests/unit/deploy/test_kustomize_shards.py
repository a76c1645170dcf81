"""Controller shards on Kubernetes (issue 32; docs/shards.md), rendered by `kubectl
kustomize` and validated offline against Kubernetes' own schemas like the other manifests:
components/shards turns the base's Deployment into a StatefulSet of N shards (a store
each, the shard index its pod's ordinal, a headless Service giving each its name),
overlays/shards is one, and components/sidecar-shards points every sidecar at the shard
that owns its pool. What they run is what `rebalancer serve`, `rebalancer sidecar` and
`rebalancer admin` accept, and the names agree: the address a sidecar computes by the
rule is a pod of the StatefulSet, behind its Service, on its gRPC port."""

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
from rebalancer.wire.link import Link
from rebalancer.wire.shards import owner_shard
from tests.unit.deploy.conftest import (
    BASE,
    COMPONENTS,
    EXAMPLES,
    OVERLAYS,
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


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


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


@pytest.mark.parametrize("where", ["overlay", "component"])
def test_the_shards_validate_strictly(
    where: str,
    shards_overlay: dict[tuple[str, str], dict[str, Any]],
    base_with_shards: dict[tuple[str, str], dict[str, Any]],
    kubernetes_validate: Any,
) -> None:
    objects = shards_overlay if where == "overlay" else base_with_shards
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
    template = copy.deepcopy(sts["spec"]["template"])
    (c,) = template["spec"]["containers"]
    n = sts["spec"]["replicas"]
    assert c["args"][-2:] == ["--shard=$(POD_INDEX)", f"--shards={n}"]
    del c["args"][-2:]
    env = env_of(c)
    assert env["REBALANCER_SHARDS"]["value"] == str(n)
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    assert env["REBALANCER_ADDRESS"]["value"] == "rebalancer-{shard}.rebalancer:50051"
    c["env"] = [e for e in c["env"] if e["name"] not in ("REBALANCER_SHARDS", "POD_INDEX")]
    c["env"][[e["name"] for e in c["env"]].index("REBALANCER_ADDRESS")]["value"] = "127.0.0.1:50051"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (data,) = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v
    ]
    assert claim["metadata"]["name"] == data["name"] and claim["spec"] == pvc["spec"]
    template["spec"]["volumes"].insert(
        [v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]].index(data["name"]),
        data,
    )
    assert template == deployment["spec"]["template"]


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
    pods, service, _, port = shard_names(base_with_shards)
    env = env_of(controller_of(base_with_shards))
    monkeypatch.setenv("REBALANCER_ADDRESS", env["REBALANCER_ADDRESS"]["value"])
    monkeypatch.setenv("REBALANCER_SHARDS", env["REBALANCER_SHARDS"]["value"])
    args = build_parser().parse_args(["admin", "status"])
    link = Link(args.address, shards=int(args.shards))
    assert [link.shard(i).address for i in range(link.shards)] == [
        f"{pod}.{service}:{port}" for pod in pods
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
