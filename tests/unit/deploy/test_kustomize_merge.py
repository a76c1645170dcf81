"""Merging an EP group's pods at the leader pod's sidecar on Kubernetes (issue 32):
components/sidecar-merge, listed after components/sidecar, rendered by `kubectl kustomize`
on the example LeaderWorkerSet and validated offline. What each pod's sidecar then runs is
read the way the kubelet reads it (the downward API's labels, `$(VAR)` expanded in env
order, then in the arguments) and handed to the real CLI: the leader pod (worker index 0)
leads the merge of the whole group, every other pod follows it at the leader pod's name,
and without the component nobody merges."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rebalancer.cli import build_parser
from rebalancer.cli.sidecar_cmd import merge_of
from tests.unit.deploy.conftest import COMPONENTS, EXAMPLES, documents, kustomize
from tests.unit.deploy.test_kustomize import (
    SIDECAR,
    expand,
    pod_templates,
    strip_sidecar,
    validate_strict,
)

MERGE = COMPONENTS / "sidecar-merge"
PORT = 50070


def render(kubectl: str, tmp_path: Path, components: list[Path]) -> dict[str, Any]:
    """The example LeaderWorkerSet, without its sidecar, through `components`."""
    (example,) = [
        d for d in documents(EXAMPLES / "leaderworkerset.yaml") if d["kind"] == "LeaderWorkerSet"
    ]
    folder = tmp_path / "workload"
    folder.mkdir()
    (folder / "workload.yaml").write_text(json.dumps(strip_sidecar(example)))  # JSON is YAML
    listed = "".join(f"  - {os.path.relpath(c, folder)}\n" for c in components)
    (folder / "kustomization.yaml").write_text(
        f"resources:\n  - workload.yaml\ncomponents:\n{listed}"
    )
    (rendered,) = kustomize(kubectl, folder)
    return rendered


def pod_env(sidecar: dict[str, Any], pod: dict[str, Any]) -> dict[str, str]:
    """The sidecar's environment in one pod, as the kubelet builds it: downward API fields
    from the pod's metadata, values with `$(VAR)` of earlier variables expanded."""
    env: dict[str, str] = {}
    for e in sidecar["env"]:
        if "valueFrom" in e:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = pod[path]
        else:
            env[e["name"]] = expand(e.get("value", ""), env)
    return env


def group_pod(name: str, index: int) -> dict[str, str]:
    """Pod `index` of group 1 of LeaderWorkerSet `name` (4 pods), as LeaderWorkerSet labels
    and annotates it."""
    return {
        "metadata.name": f"{name}-1" if index == 0 else f"{name}-1-{index}",
        "metadata.namespace": "inference",
        "metadata.annotations['leaderworkerset.sigs.k8s.io/size']": "4",
        "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']": str(index),
        "metadata.labels['leaderworkerset.sigs.k8s.io/name']": name,
        "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']": "1",
    }


def merge_config(template: dict[str, Any], pod: dict[str, str]) -> Any:
    (sidecar,) = [c for c in template["spec"]["initContainers"] if c["name"] == SIDECAR]
    env = pod_env(sidecar, pod)
    argv = [expand(a, env) for a in [*sidecar["command"], *sidecar["args"]]]
    args = build_parser().parse_args(argv[1:])  # the real CLI accepts exactly these flags
    return sidecar, merge_of(args, env, ())


def test_the_group_merges_at_its_leader_pod(
    kubectl: str, kubernetes_validate: Any, tmp_path: Path
) -> None:
    lws = render(kubectl, tmp_path, [COMPONENTS / "sidecar", MERGE])
    name = lws["metadata"]["name"]
    templates = dict(pod_templates(lws))
    assert set(templates) == {"leaderTemplate", "workerTemplate"}
    for where, template in templates.items():
        validate_strict(
            kubernetes_validate,
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{name}-{where.lower()}"},
                "template": template,
            },
            f"sidecar-merge {where}",
        )
    # The leader pod runs the leaderTemplate: it leads, for the group's 32 ranks.
    sidecar, leader = merge_config(templates["leaderTemplate"], group_pod(name, 0))
    assert (leader.role, leader.listen) == ("leader", f"0.0.0.0:{PORT}")
    assert leader.group_ranks == tuple(range(32))
    assert {"name": "rb-merge", "containerPort": PORT, "protocol": "TCP"} in sidecar["ports"]
    # Every other pod follows it at the leader pod's name behind the group's Service.
    for index in (1, 3):
        _, follower = merge_config(templates["workerTemplate"], group_pod(name, index))
        assert (follower.role, follower.leader) == (
            "follower",
            f"{name}-1.{name}.inference:{PORT}",
        )


def test_without_the_component_each_pod_streams_on_its_own(kubectl: str, tmp_path: Path) -> None:
    lws = render(kubectl, tmp_path, [COMPONENTS / "sidecar"])
    name = lws["metadata"]["name"]
    for where, template in pod_templates(lws):
        index = 0 if where == "leaderTemplate" else 2
        sidecar, merge = merge_config(template, group_pod(name, index))
        assert merge.role == "off", where
        assert "rb-merge" not in repr(sidecar["ports"])


@pytest.mark.parametrize(
    "flags,env,message",
    [
        (["--merge-port", "50070"], {}, "--merge-port is for a LeaderWorkerSet"),
        (["--ranks-per-pod", "8", "--merge-port", "x"], {}, "must be a port number"),
        (["--ranks-per-pod", "8", "--merge-port", "70000"], {}, "must be a port number"),
        (["--ranks-per-pod", "8", "--merge-port", "50070"], {}, "LWS_GROUP_SIZE is not set"),
        (
            ["--ranks-per-pod", "8", "--merge-port", "50070"],
            {"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"},
            "LWS_LEADER_ADDRESS is not set",
        ),
        (
            ["--ranks-per-pod", "8", "--merge-port", "50070", "--merge-leader", "h:1"],
            {"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"},
            "not both",
        ),
    ],
)
def test_a_merge_port_outside_a_leaderworkerset_pod_is_refused_in_one_line(
    flags: list[str], env: dict[str, str], message: str
) -> None:
    from rebalancer.errors import InputError

    args = build_parser().parse_args(["sidecar", *flags])
    with pytest.raises(InputError, match=message) as caught:
        merge_of(args, env, ())
    assert "\n" not in str(caught.value)
