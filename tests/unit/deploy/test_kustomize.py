"""What `kubectl kustomize` renders from deploy/kubernetes: the dev and prod overlays and
the sidecar component validate offline against Kubernetes' own schemas (strict: an
unknown field fails) for 1.29 and the newest known, and what they run is what
`rebalancer serve` and `rebalancer sidecar` accept: the real argument parsers, and the
controller's own exposure check (dev must say --insecure, prod is authenticated)."""

from __future__ import annotations

import copy
import os
import posixpath
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rebalancer.cli import build_parser
from rebalancer.controller.config import check_exposure, load_config
from rebalancer.errors import InputError
from tests.unit.deploy.conftest import (
    BASE,
    COMPONENTS,
    EXAMPLES,
    KUBERNETES_VERSIONS,
    OVERLAYS,
    documents,
    kustomization,
    kustomize,
)

SIDECAR = "rebalancer-sidecar"
ENGINE = "inference"
SOCKET = "unix:///run/rebalancer/agent.sock"
OPERATOR_GROUP = "monitoring.coreos.com/"
UID = 10001  # the Containerfile's USER, the base Deployment's runAsUser


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = obj
    return out


def validate_strict(kubernetes_validate: Any, obj: dict[str, Any], where: str) -> None:
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(
                f"{where}: {obj['kind']} {obj['metadata'].get('name')} "
                f"invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}"
            ) from None


def controller(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    (c,) = objects[("Deployment", "rebalancer")]["spec"]["template"]["spec"]["containers"]
    return c


def projected_files(
    pod_spec: dict[str, Any], container: dict[str, Any]
) -> dict[str, tuple[str, str]]:
    """Absolute path -> (Secret or ConfigMap name, key) for every projected/secret item mounted."""
    out = {}
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        sources = volume["projected"]["sources"] if "projected" in volume else [volume]
        for source in sources:
            for kind in ("secret", "configMap"):
                if kind in source:
                    for item in source[kind].get("items", []):
                        out[posixpath.join(mount["mountPath"], item["path"])] = (
                            source[kind]["name"],
                            item["key"],
                        )
    return out


def serve_config(objects: dict[tuple[str, str], dict[str, Any]], tmp_path: Path) -> tuple[Any, Any]:
    """(parsed args, ControllerConfig) of the rendered controller, as `serve` builds them."""
    c = controller(objects)
    argv = [*c["command"], *c["args"]]
    assert argv[:2] == ["rebalancer", "serve"]
    args = build_parser().parse_args(argv[1:])
    # The file --config names, from the ConfigMap the pod mounts there (whatever its name).
    pod_spec = objects[("Deployment", "rebalancer")]["spec"]["template"]["spec"]
    name, key = projected_files(pod_spec, c)[args.config]
    path = tmp_path / "controller.toml"
    path.write_text(objects[("ConfigMap", name)]["data"][key])
    config = load_config(path)
    overrides = {
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
        "insecure": args.insecure,
        "host": args.host,
        "port": args.port,
    }
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if args.admin_token_file:
        config = replace(config, admin_token="a token read from the file")
    return args, config


# ----------------------------------------------------------------------- overlays


@pytest.fixture(scope="module")
def dev(kubectl: str) -> dict[tuple[str, str], dict[str, Any]]:
    return by_key(kustomize(kubectl, OVERLAYS / "dev"))


@pytest.fixture(scope="module")
def prod(kubectl: str) -> dict[tuple[str, str], dict[str, Any]]:
    return by_key(kustomize(kubectl, OVERLAYS / "prod"))


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_overlay_validates_strictly(overlay: str, kubectl: str, kubernetes_validate: Any) -> None:
    objects = kustomize(kubectl, OVERLAYS / overlay)
    builtin = [o for o in objects if not o["apiVersion"].startswith(OPERATOR_GROUP)]
    assert len(builtin) >= 8
    for obj in builtin:
        validate_strict(kubernetes_validate, obj, f"overlays/{overlay}")


def test_the_base_renders_what_its_files_say(
    kubectl: str, manifests: dict[tuple[str, str], dict[str, Any]]
) -> None:
    rendered = by_key(kustomize(kubectl, BASE))
    generated = {g["name"] for g in kustomization(BASE).get("configMapGenerator", [])}
    names = {
        (
            kind,
            name.rsplit("-", 1)[0]
            if kind == "ConfigMap" and name.rsplit("-", 1)[0] in generated
            else name,
        )
        for kind, name in rendered
    }
    assert names == {k for k in manifests if k[0] != "Secret"}
    for obj in rendered.values():
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "moe-rebalancer"


def test_the_base_alone_is_refused(kubectl: str, tmp_path: Path) -> None:
    """0.0.0.0 with the worker service unauthenticated: serve refuses it, an overlay decides."""
    _, config = serve_config(by_key(kustomize(kubectl, BASE)), tmp_path)
    with pytest.raises(InputError, match="refusing to listen"):
        check_exposure(config)


def test_dev_is_one_namespace_and_insecure_on_purpose(
    dev: dict[tuple[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    namespaces = {o["metadata"].get("namespace") for o in dev.values() if o["kind"] != "Namespace"}
    assert namespaces == {"rebalancer-dev"} and ("Namespace", "rebalancer-dev") in dev
    args, config = serve_config(dev, tmp_path)
    assert args.insecure is True and args.admin_token_file is None and not args.tls_cert
    check_exposure(config)  # accepted, because it says --insecure
    with pytest.raises(InputError):
        check_exposure(replace(config, insecure=False))
    # No Secret is needed: nothing refers to one.
    text = repr(dev[("Deployment", "rebalancer")])
    assert "secret" not in text.lower(), "dev runs without the admin token Secret"
    # Clients of this namespace only.
    for rule in dev[("NetworkPolicy", "rebalancer")]["spec"]["ingress"][:1]:
        assert all("namespaceSelector" not in peer for peer in rule["from"])


def test_prod_serves_mutual_tls_from_cert_manager_secrets(
    prod: dict[tuple[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    args, config = serve_config(prod, tmp_path)
    assert not args.insecure
    check_exposure(config)  # mutual TLS authenticates both services without --insecure
    pod_spec = prod[("Deployment", "rebalancer")]["spec"]["template"]["spec"]
    files = projected_files(pod_spec, controller(prod))
    assert files[args.tls_cert] == ("rebalancer-tls", "tls.crt")
    assert files[args.tls_key] == ("rebalancer-tls", "tls.key")
    assert files[args.tls_client_ca] == ("rebalancer-tls", "ca.crt")
    assert files[args.admin_token_file] == ("rebalancer-admin-token", "token"), (
        "prod mounts the admin token"
    )
    assert (
        files[args.config][0].startswith("rebalancer-config")
        and files[args.config][1] == "controller.toml"
    )
    # kubelet's grpc probes cannot pass a TLS handshake.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in controller(prod)[probe] and controller(prod)[probe]["tcpSocket"], probe


def test_prod_resources_priority_and_image(prod: dict[tuple[str, str], dict[str, Any]]) -> None:
    pod_spec = prod[("Deployment", "rebalancer")]["spec"]["template"]["spec"]
    priority = prod[("PriorityClass", pod_spec["priorityClassName"])]
    assert priority["preemptionPolicy"] == "Never", "the controller must never evict inference pods"
    assert priority["globalDefault"] is False
    resources = controller(prod)["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys() and "memory" in resources["limits"]
    assert "cpu" not in resources["limits"], "no CPU limit: throttling shows up as ingest latency"
    assert controller(prod)["image"].endswith(":0.1.0") and "/" in controller(prod)["image"]
    kinds = {kind for kind, _ in prod}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= kinds
    assert ("ConfigMap", "rebalancer-dashboard") in prod


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_overlay_keeps_the_controller_locked_down(overlay: str, kubectl: str) -> None:
    objects = by_key(kustomize(kubectl, OVERLAYS / overlay))
    deployment = objects[("Deployment", "rebalancer")]
    assert (
        deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    )
    pod_spec = deployment["spec"]["template"]["spec"]
    assert (
        pod_spec["securityContext"]["runAsUser"] == UID
        and pod_spec["securityContext"]["runAsNonRoot"]
    )
    sc = controller(objects)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    assert objects[("ServiceAccount", pod_spec["serviceAccountName"])]


# ----------------------------------------------------------------------- the sidecar component


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) of a workload; for a Pod, the Pod itself."""
    if obj["kind"] == "Pod":
        return [("", obj)]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [(t, lwt[t]) for t in ("leaderTemplate", "workerTemplate") if t in lwt]
    return [("template", obj["spec"]["template"])]


def strip_sidecar(obj: dict[str, Any]) -> dict[str, Any]:
    """The workload without what components/sidecar adds."""
    obj = copy.deepcopy(obj)
    for _, template in pod_templates(obj):
        spec = template["spec"]
        spec["initContainers"] = [c for c in spec.get("initContainers", []) if c["name"] != SIDECAR]
        spec["volumes"] = [
            v for v in spec.get("volumes", []) if not v["name"].startswith("rebalancer-")
        ]
        for c in spec["containers"]:
            if c["name"] == ENGINE:
                c["env"] = [e for e in c.get("env", []) if e["name"] != "REBALANCER_ADDRESS"]
                c["volumeMounts"] = [
                    m for m in c.get("volumeMounts", []) if m["name"] != "rebalancer-socket"
                ]
                for key in ("env", "volumeMounts"):
                    if not c[key]:
                        del c[key]
        for key in ("initContainers", "volumes"):
            if not spec[key]:
                del spec[key]
        if obj["kind"] != "Pod":  # a Pod keeps the label the component selects it by
            labels = template.get("metadata", {}).get("labels", {})
            labels.pop("rebalancer.io/sidecar", None)
            if not labels and "metadata" in template:
                template["metadata"].pop("labels", None)
    return obj


def render_with_component(
    kubectl: str, workloads: list[dict[str, Any]], tmp_path: Path
) -> list[dict[str, Any]]:
    import json

    folder = tmp_path / "workload"
    folder.mkdir()
    (folder / "workloads.yaml").write_text(
        "\n---\n".join(json.dumps(w) for w in workloads)
    )  # JSON is YAML
    component = os.path.relpath(COMPONENTS / "sidecar", folder)  # kustomize wants it relative
    (folder / "kustomization.yaml").write_text(
        f"resources:\n  - workloads.yaml\ncomponents:\n  - {component}\n"
    )
    return kustomize(kubectl, folder)


EXAMPLE_WORKLOADS = [("inference-pod.yaml", "Pod"), ("leaderworkerset.yaml", "LeaderWorkerSet")]


@pytest.mark.parametrize("name,kind", EXAMPLE_WORKLOADS)
def test_examples_are_what_the_component_makes(
    name: str, kind: str, kubectl: str, tmp_path: Path
) -> None:
    (example,) = [d for d in documents(EXAMPLES / name) if d["kind"] == kind]
    bare = strip_sidecar(example)
    assert SIDECAR not in repr(bare)
    (rendered,) = render_with_component(kubectl, [bare], tmp_path)
    assert rendered == example, f"examples/{name} differs from components/sidecar applied to it"


@pytest.mark.parametrize("name", [n for n, _ in EXAMPLE_WORKLOADS])
def test_examples_validate_strictly(name: str, kubernetes_validate: Any) -> None:
    for doc in documents(EXAMPLES / name):
        if doc["kind"] == "LeaderWorkerSet":
            # The LeaderWorkerSet CRD's schema is not available offline here: its pod
            # templates are checked as core PodTemplates, the rest by check_leaderworkerset.
            check_leaderworkerset(doc)
            for where, template in pod_templates(doc):
                wrapped = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{doc['metadata']['name']}-{where.lower()}"},
                    "template": template,
                }
                validate_strict(kubernetes_validate, wrapped, f"examples/{name} {where}")
        else:
            validate_strict(kubernetes_validate, doc, f"examples/{name}")


def check_leaderworkerset(doc: dict[str, Any]) -> None:
    """The fields of leaderworkerset.x-k8s.io/v1 the example uses, by the API's rules."""
    assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = doc["spec"]
    assert set(spec) <= {
        "replicas",
        "leaderWorkerTemplate",
        "rolloutStrategy",
        "startupPolicy",
        "networkConfig",
    }, sorted(spec)
    assert isinstance(spec.get("replicas", 1), int) and spec.get("replicas", 1) >= 0
    assert spec.get("startupPolicy", "LeaderCreated") in ("LeaderCreated", "LeaderReady")
    lwt = spec["leaderWorkerTemplate"]
    assert set(lwt) <= {
        "leaderTemplate",
        "workerTemplate",
        "size",
        "restartPolicy",
        "subGroupPolicy",
        "resourceClaims",
    }, sorted(lwt)
    assert isinstance(lwt["size"], int) and lwt["size"] >= 1
    assert lwt.get("restartPolicy", "RecreateGroupOnPodRestart") in (
        "RecreateGroupOnPodRestart",
        "None",
    )
    assert "workerTemplate" in lwt


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args."""
    return re.sub(
        r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value
    )


def sidecar_checks(template: dict[str, Any], kind: str) -> None:
    spec = template["spec"]
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == SIDECAR]
    assert sidecar["restartPolicy"] == "Always", "a native sidecar"
    env = {e["name"]: e.get("value", "") for e in sidecar["env"]}
    refs = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in sidecar["env"]
        if "valueFrom" in e
    }
    assert refs["POD_NAME"] == "metadata.name" and refs["POD_NAMESPACE"] == "metadata.namespace"
    argv = [expand(a, env) for a in [*sidecar["command"], *sidecar["args"]]]
    args = build_parser().parse_args(argv[1:])  # the real CLI accepts exactly these flags
    assert argv[:2] == ["rebalancer", "sidecar"] and args.listen == SOCKET
    if kind == "LeaderWorkerSet":
        assert args.ranks_per_pod and refs["LWS_WORKER_INDEX"].endswith(
            "['leaderworkerset.sigs.k8s.io/worker-index']"
        )
        assert refs["LWS_GROUP_SIZE"].endswith("['leaderworkerset.sigs.k8s.io/size']")
    else:
        assert args.ranks
    # The startup probe is the check command on the same socket; the engine waits for it.
    probe = sidecar["startupProbe"]["exec"]["command"]
    assert build_parser().parse_args(probe[1:]).check == args.listen and probe[0] == "rebalancer"
    assert "readinessProbe" not in sidecar, "the sidecar's readiness must not gate serving"
    # Ports: the metrics port is the one the PodMonitor scrapes by name.
    (port,) = sidecar["ports"]
    assert port["containerPort"] == args.metrics_port and port["name"] == "rb-metrics"
    # Non-root, the image's UID, read-only root.
    sc = sidecar["securityContext"]
    assert sc["runAsUser"] == UID and sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["allowPrivilegeEscalation"] is False
    # The socket's directory is the shared emptyDir, in both containers.
    volumes = {v["name"]: v for v in spec["volumes"]}
    socket_dir = posixpath.dirname(args.listen[len("unix://") :])
    (engine,) = [c for c in spec["containers"] if c["name"] == ENGINE]
    for c in (sidecar, engine):
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == socket_dir]
        assert "emptyDir" in volumes[mount["name"]]
    assert {e["name"]: e["value"] for e in engine["env"]}["REBALANCER_ADDRESS"] == args.listen
    # Credentials: files of the sidecar only; the engine sees no secret at all.
    files = projected_files(spec, sidecar)
    for flag in (args.token_file, args.ca_file, args.cert_file, args.key_file):
        assert flag in files and files[flag][0].startswith("rebalancer-"), flag
    secret_volumes = {n for n, v in volumes.items() if "secret" in repr(v)}
    for c in spec["containers"]:
        assert not {m["name"] for m in c.get("volumeMounts", [])} & secret_volumes, c["name"]
        assert "secretKeyRef" not in repr(c.get("env", [])), c["name"]
    assert template["metadata"]["labels"]["rebalancer.io/sidecar"] == "true"


@pytest.mark.parametrize("name,kind", EXAMPLE_WORKLOADS)
def test_example_sidecar_runs_what_the_cli_accepts(name: str, kind: str) -> None:
    (example,) = [d for d in documents(EXAMPLES / name) if d["kind"] == kind]
    templates = pod_templates(example)
    assert len(templates) == (2 if kind == "LeaderWorkerSet" else 1), "the leader runs ranks too"
    for _, template in templates:
        sidecar_checks(template, kind)


def test_component_patches_deployments_and_statefulsets(
    kubectl: str, kubernetes_validate: Any, tmp_path: Path
) -> None:
    engine = {
        "name": ENGINE,
        "image": "engine:1",
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    template = {
        "metadata": {"labels": {"app": "e"}},
        "spec": {
            "containers": [engine, {"name": "other", "image": "o:1"}],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        },
    }
    workloads = [
        {
            "apiVersion": "apps/v1",
            "kind": kind,
            "metadata": {"name": "e", "labels": {"rebalancer.io/sidecar": "true"}},
            "spec": {
                "selector": {"matchLabels": {"app": "e"}},
                "template": template,
                **({"serviceName": "e"} if kind == "StatefulSet" else {}),
            },
        }
        for kind in ("Deployment", "StatefulSet")
    ]
    unlabelled = copy.deepcopy(workloads[0])
    unlabelled["metadata"] = {"name": "untouched"}
    rendered = by_key(render_with_component(kubectl, [*workloads, unlabelled], tmp_path))
    for kind in ("Deployment", "StatefulSet"):
        obj = rendered[(kind, "e")]
        validate_strict(kubernetes_validate, obj, f"components/sidecar on a {kind}")
        (template_out,) = [t for _, t in pod_templates(obj)]
        sidecar_checks(template_out, kind)
        # Merged, not replaced: the workload's own containers, mounts and volumes stay.
        names = [c["name"] for c in template_out["spec"]["containers"]]
        assert names.count(ENGINE) == 1 and "other" in names
        (eng,) = [c for c in template_out["spec"]["containers"] if c["name"] == ENGINE]
        assert {"dshm", "rebalancer-socket"} <= {m["name"] for m in eng["volumeMounts"]}
        assert eng["image"] == "engine:1"
    assert rendered[("Deployment", "untouched")] == unlabelled, (
        "only labelled workloads get a sidecar"
    )


def test_one_sidecar_in_every_patch() -> None:
    """The four patches of components/sidecar add the same pod-spec parts; only how the
    sidecar learns its ranks differs (--ranks, or --ranks-per-pod in a LeaderWorkerSet)
    and a LeaderWorkerSet's group merging (--merge-port, components/sidecar-merge)."""
    ranks_env = {
        "REBALANCER_RANKS",
        "REBALANCER_RANKS_PER_POD",
        "LWS_GROUP_SIZE",
        "LWS_WORKER_INDEX",
        "LWS_NAME",
        "LWS_GROUP_INDEX",
        "LWS_LEADER_ADDRESS",
        "REBALANCER_MERGE_PORT",
    }

    def fragment(name: str) -> dict[str, Any]:
        (patch,) = documents(COMPONENTS / "sidecar" / name)
        (_, template), *more = (
            pod_templates(patch)
            if patch["kind"] != "LeaderWorkerSet"
            else [
                (t, patch["spec"]["leaderWorkerTemplate"][t])
                for t in patch["spec"]["leaderWorkerTemplate"]
            ]
        )
        assert not more
        spec = copy.deepcopy(template["spec"])
        (sidecar,) = spec["initContainers"]
        sidecar["args"] = [
            a for a in sidecar["args"] if not a.startswith(("--ranks", "--merge-port"))
        ]
        sidecar["env"] = [e for e in sidecar["env"] if e["name"] not in ranks_env]
        return {"labels": template["metadata"]["labels"], "spec": spec}

    names = [
        "pod-patch.yaml",
        "template-patch.yaml",
        "lws-worker-patch.yaml",
        "lws-leader-patch.yaml",
    ]
    first = fragment(names[0])
    for name in names[1:]:
        assert fragment(name) == first, f"components/sidecar/{name} differs from {names[0]}"


def test_empty_credentials_turn_tls_and_token_off() -> None:
    """What components/sidecar documents for a dev controller: REBALANCER_TLS_CA/CERT/KEY
    and REBALANCER_TOKEN_FILE set to "" give a sidecar without TLS or token upstream."""
    from rebalancer.cli.sidecar_cmd import link_of
    from rebalancer.sidecar.config import SidecarConfig, parse_ranks

    (patch,) = documents(COMPONENTS / "sidecar" / "pod-patch.yaml")
    (sidecar,) = patch["spec"]["initContainers"]
    env = {e["name"]: e.get("value", "") for e in sidecar["env"]}
    env.update(
        REBALANCER_TLS_CA="",
        REBALANCER_TLS_CERT="",
        REBALANCER_TLS_KEY="",
        REBALANCER_TOKEN_FILE="",
    )
    args = build_parser().parse_args([expand(a, env) for a in sidecar["args"]])
    # As `rebalancer sidecar` builds its config from the flags (rebalancer/cli/sidecar_cmd.py).
    config = SidecarConfig(
        link=link_of(args, env),
        ranks=parse_ranks(args.ranks),
        listen=args.listen,
        metrics_port=args.metrics_port,
    )
    channel = config.channel()
    assert channel.credentials() is None and channel.metadata() == ()


def self_signed(folder: Path) -> dict[str, str]:
    """A self-signed certificate and its key, as PEM text by file suffix (.crt, .key)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    folder.mkdir()
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "k.pem",
            "-out",
            "c.pem",
            "-days",
            "2",
            "-subj",
            "/CN=rebalancer-test",
        ],
        cwd=folder,
        check=True,
        capture_output=True,
    )
    return {".crt": (folder / "c.pem").read_text(), ".key": (folder / "k.pem").read_text()}


@pytest.mark.parametrize(
    "present",
    [set(), {"rebalancer-client-tls"}, {"rebalancer-client-tls", "rebalancer-worker-token"}],
    ids=["no Secret", "client TLS only (prod mutual TLS)", "both"],
)
def test_the_sidecar_starts_whichever_credential_secrets_exist(
    present: set[str], tmp_path: Path
) -> None:
    """The sidecar's Secrets are optional volumes, and the sidecar as the component runs it
    accepts every combination of them present: its start (which gates the engine) never
    depends on a Secret. With the client TLS Secret alone (the prod overlay's mutual TLS,
    no [worker_tokens]) it has all it needs: TLS credentials and no token; with none it
    still starts, and its connection attempts report the missing file."""
    from rebalancer.cli.sidecar_cmd import link_of
    from rebalancer.errors import InputError
    from rebalancer.sidecar.config import SidecarConfig, parse_ranks

    (patch,) = documents(COMPONENTS / "sidecar" / "pod-patch.yaml")
    spec = patch["spec"]
    (sidecar,) = spec["initContainers"]
    for source in next(v for v in spec["volumes"] if v["name"] == "rebalancer-credentials")[
        "projected"
    ]["sources"]:
        assert source["secret"]["optional"] is True, source
    files = projected_files(spec, sidecar)
    root = "/etc/rebalancer/credentials"
    pem = self_signed(tmp_path / "pki") if "rebalancer-client-tls" in present else {}
    for path, (secret, _) in files.items():  # what the kubelet projects of the Secrets that exist
        if secret in present:
            local = tmp_path / posixpath.relpath(path, root)
            # A client channel checks that the key is its certificate's: real PEM files.
            local.write_text(pem.get(posixpath.splitext(path)[1], f"token of {path}"))
    env = {e["name"]: e.get("value", "") for e in sidecar["env"]}
    env = {k: v.replace(root, str(tmp_path)) for k, v in env.items()}
    args = build_parser().parse_args([expand(a, env) for a in sidecar["args"]])
    config = SidecarConfig(
        link=link_of(args, env),
        ranks=parse_ranks(args.ranks),
        listen=args.listen,
        metrics_port=args.metrics_port,
    )  # started: no raise
    if "rebalancer-client-tls" not in present:
        with pytest.raises(InputError, match="ca.crt: no such file"):
            config.channel()
        return
    channel = config.channel()
    assert channel.credentials() is not None
    if "rebalancer-worker-token" in present:
        assert channel.metadata() and config.token_missing() == ""
    else:
        assert channel.metadata() == () and "token: no such file" in config.token_missing()
