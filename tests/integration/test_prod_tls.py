"""The one controller's certificate (deploy/kubernetes/templates/certificate-tls.yaml) on a
real controller, verified by the real clients under the names and the address they dial.

A CA issues a certificate with exactly the template's dnsNames, ipAddresses and usages;
one controller runs what overlays/prod's pod runs (the Deployment's command and args, the
ConfigMap's controller.toml, the admin token and that certificate as the files the pod
mounts: mutual TLS) on 127.0.0.1; the DNS server of test_shards_tls answers for the
Service's names as the cluster's DNS does, and every client dialling a name reaches it
through a `dns://127.0.0.1:PORT/` authority in front of the host the manifests give it.
So gRPC resolves and checks the very host the client dials:

- a sidecar's link (components/sidecar's REBALANCER_ADDRESS, and the same name without
  the cluster domain) registers over mutual TLS;
- `rebalancer admin` as it runs inside the pod (the Deployment's REBALANCER_ADDRESS,
  127.0.0.1, and REBALANCER_ADMIN_TOKEN; the pod's own TLS files as its client
  certificate), a process of its own, gets the status of what registered;
- a host the certificate does not cover (another namespace's Service; the name
  `localhost`, which the address 127.0.0.1 does not stand for) is refused at the
  handshake, with one line saying so.

Every process is reaped, whatever happens.
"""

from __future__ import annotations

import ipaddress
import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rebalancer.launch.processes import bound_to_this_process, free_port, reap
from rebalancer.wire.channel import unavailable_cause
from rebalancer.wire.link import Link
from tests.integration.test_shards_tls import (
    TOKEN,
    USAGES,
    Names,
    host_of,
    issue_for,
    register,
    rendered,
)
from tests.unit.deploy.conftest import (
    COMPONENTS,
    TEMPLATES,
    documents,
)
from tests.unit.deploy.test_kustomize import controller, pod_templates, projected_files

NAMESPACE = "rebalancer"
DEPLOYMENT = ("Deployment", "rebalancer")
CERTIFICATE = TEMPLATES / "certificate-tls.yaml"
TLS_SECRET = "rebalancer-tls"
SIDECAR = "rebalancer-sidecar"


def certificate_template() -> dict[str, Any]:
    (doc,) = documents(CERTIFICATE)
    assert doc["apiVersion"] == "cert-manager.io/v1" and doc["kind"] == "Certificate"
    return dict(doc["spec"])


def sidecar_address() -> str:
    """REBALANCER_ADDRESS of the sidecar in every patch of components/sidecar (the Pod,
    Deployment and StatefulSet ones and the LeaderWorkerSet's leader and worker): one."""
    found = set()
    for patch in sorted((COMPONENTS / "sidecar").glob("*-patch.yaml")):
        (doc,) = documents(patch)
        for _, template in pod_templates(doc):
            spec = template["spec"]
            for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
                if c["name"] == SIDECAR:
                    found |= {e["value"] for e in c["env"] if e["name"] == "REBALANCER_ADDRESS"}
    (address,) = found
    return str(address)


def in_pod_address(objects: dict[tuple[str, str], Any]) -> str:
    """The address `rebalancer admin` dials inside the controller's pod."""
    env = {e["name"]: e for e in controller(objects)["env"]}
    return str(env["REBALANCER_ADDRESS"]["value"])


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def prod() -> dict[tuple[str, str], Any]:
    """The objects overlays/prod renders."""
    return rendered("prod")


def test_the_template_names_exactly_what_the_clients_dial(
    prod: dict[tuple[str, str], Any],
) -> None:
    """Cheap, without processes: the Secret the pod mounts, in its namespace, with the
    Service's two names (the sidecars' one, and without the cluster domain) as dnsNames
    and the in-pod admin CLI's loopback address as ipAddresses, for server and client use."""
    (doc,) = documents(CERTIFICATE)
    spec = certificate_template()
    deployment = prod[DEPLOYMENT]
    namespace = deployment["metadata"]["namespace"]
    assert doc["metadata"]["namespace"] == namespace == NAMESPACE
    c = controller(prod)
    files = projected_files(deployment["spec"]["template"]["spec"], c)
    tls_args = [
        a for a in c["args"] if a.startswith(("--tls-cert=", "--tls-key=", "--tls-client-ca="))
    ]
    assert {files[a.split("=", 1)[1]][0] for a in tls_args} == {spec["secretName"]} == {TLS_SECRET}
    service = prod[("Service", "rebalancer")]
    assert service["spec"].get("clusterIP") != "None", "one controller behind a ClusterIP"
    name = f"{service['metadata']['name']}.{namespace}.svc"
    assert host_of(sidecar_address()) == f"{name}.cluster.local"
    assert spec["dnsNames"] == [f"{name}.cluster.local", name]
    host = host_of(in_pod_address(prod))
    assert is_ip(host), "a name would belong in dnsNames"
    assert spec["ipAddresses"] == [host]
    assert {"server auth", "client auth"} <= set(spec["usages"]) <= set(USAGES)
    assert "REPLACE" in spec["issuerRef"]["name"], "a placeholder for the operator's Issuer"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA; `controller.crt` for the template (its ipAddresses too); `sidecar.crt`
    (`issue_for`)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("pki")
    issue_for(d, "controller", certificate_template())
    return d


# Hosts a client could dial that the certificate does not cover: the Service of another
# namespace, and the pod's loopback by name rather than by the address the certificate lists.
NOT_COVERED = [
    host_of(sidecar_address()).replace(f".{NAMESPACE}.svc", ".other.svc"),
    "localhost",
]


class Controller:
    """overlays/prod's controller (its Deployment's command and args, the files its pod
    mounts) on 127.0.0.1:port, and the DNS server naming it by the Service's names, by the
    sidecars' name without the cluster domain, and by the hosts of NOT_COVERED."""

    def __init__(self, objects: dict[tuple[str, str], Any], pki: Path, tmp: Path) -> None:
        self.objects, self.pki, self.tmp = objects, pki, tmp
        self.container = controller(objects)
        self.in_pod_address = in_pod_address(objects)
        self.files = self._mount()
        self.port = free_port()
        self.proc: subprocess.Popen[str] | None = None
        sidecar = host_of(sidecar_address())
        hosts = [sidecar, sidecar.removesuffix(".cluster.local"), *NOT_COVERED]
        self.dns = Names(dict.fromkeys(hosts, "127.0.0.1"))

    def in_pod(self, path: str) -> Path:
        """Where a path of the pod's file system is here."""
        return self.tmp / "pod" / path.lstrip("/")

    def _mount(self) -> dict[tuple[str, str], str]:
        """Write every file the pod mounts from a ConfigMap or Secret under `in_pod`
        (rebalancer-tls as cert-manager fills it from the certificate issued for the
        template); (Secret or ConfigMap, key) -> its path in the pod."""
        secrets = {
            ("rebalancer-admin-token", "token"): TOKEN + "\n",
            (TLS_SECRET, "tls.crt"): (self.pki / "controller.crt").read_text(),
            (TLS_SECRET, "tls.key"): (self.pki / "controller.key").read_text(),
            (TLS_SECRET, "ca.crt"): (self.pki / "ca.crt").read_text(),
        }
        pod_spec = self.objects[DEPLOYMENT]["spec"]["template"]["spec"]
        files = projected_files(pod_spec, self.container)
        for path, (name, key) in files.items():
            config_map = self.objects.get(("ConfigMap", name))
            data = config_map["data"][key] if config_map else secrets[(name, key)]
            self.in_pod(path).parent.mkdir(parents=True, exist_ok=True)
            self.in_pod(path).write_text(data)
        assert set(secrets) <= set(files.values()), "the pod mounts every Secret it needs"
        return {source: path for path, source in files.items()}

    def argv(self) -> list[str]:
        """The Deployment's command and args (its mounted files here), then what a test on
        one machine needs: loopback, a free port, a store here, no fixed metrics port."""
        c = self.container
        assert c["command"] == ["rebalancer"] and c["args"][0] == "serve"
        mounted = {path: str(self.in_pod(path)) for path in self.files.values()}
        args = []
        for arg in c["args"]:
            assert "$(" not in arg, arg
            flag, eq, value = arg.rpartition("=")
            args.append(
                f"{flag}{eq}{mounted[value]}" if value in mounted else mounted.get(arg, arg)
            )
        paths = [a.rpartition("=")[2] for a in args if "/" in a]
        assert all(path.startswith(str(self.tmp)) for path in paths), args  # every one mounted
        return [
            sys.executable, "-m", "rebalancer", *args,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--db", str(self.tmp / "controller.sqlite"), "--metrics-port", "0",
            "--log-level", "WARNING",
        ]  # fmt: skip

    def address(self, manifest_address: str) -> str:
        """What a client dials: the manifest's host with this port; a name through the DNS
        server, an IP address as it is (gRPC resolves nothing for it)."""
        host = host_of(manifest_address)
        if is_ip(host):
            return f"{host}:{self.port}"
        return f"dns://127.0.0.1:{self.dns.port}/{host}:{self.port}"

    def tls(self, key: str) -> str:
        """The pod's own file of rebalancer-tls `key`, here."""
        return str(self.in_pod(self.files[(TLS_SECRET, key)]))

    def start(self) -> None:
        """`rebalancer serve` as the pod runs it; returns once it serves."""
        log_path = self.tmp / "controller.log"
        with log_path.open("a") as log:
            self.proc = subprocess.Popen(
                bound_to_this_process(self.argv()),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        assert line.startswith(f"serving on 127.0.0.1:{self.port}"), (
            line,
            log_path.read_text()[-2000:],
        )

    def close(self) -> None:
        try:
            if self.proc is not None:
                reap([self.proc], terminate=True, seconds=10.0)
        finally:
            if self.proc is not None and self.proc.stdout is not None:
                self.proc.stdout.close()
            self.dns.close()


@pytest.fixture
def prod_controller(
    prod: dict[tuple[str, str], Any], pki: Path, tmp_path: Path
) -> Iterator[Controller]:
    c = Controller(prod, pki, tmp_path)
    try:
        c.start()
        yield c
    finally:
        c.close()


def sidecar_link(ctl: Controller, manifest_address: str) -> Link:
    """A sidecar's link to `manifest_address`, with its client certificate."""
    pki = ctl.pki
    return Link(
        ctl.address(manifest_address),
        str(pki / "ca.crt"),
        str(pki / "sidecar.crt"),
        str(pki / "sidecar.key"),
    )


def admin_in_the_pod(ctl: Controller, address: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`kubectl exec deploy/rebalancer -- rebalancer admin --ca ... --cert ... --key ...`,
    a process of its own: the pod's REBALANCER_ADDRESS (`address`, as `Controller.address`
    gives it) and REBALANCER_ADMIN_TOKEN, the pod's own TLS files as its client certificate."""
    env = {**os.environ, "REBALANCER_ADDRESS": address, "REBALANCER_ADMIN_TOKEN": TOKEN}
    argv = [
        sys.executable, "-m", "rebalancer", "admin", "--ca", ctl.tls("ca.crt"),
        "--cert", ctl.tls("tls.crt"), "--key", ctl.tls("tls.key"), "--timeout", "10", *args,
    ]  # fmt: skip
    # run() kills the process if it outlives the timeout, or if anything interrupts the wait.
    return subprocess.run(
        bound_to_this_process(argv), env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_the_certificate_names_what_the_clients_dial(prod_controller: Controller) -> None:
    ctl = prod_controller
    address = sidecar_address()
    assert host_of(address) == "rebalancer.rebalancer.svc.cluster.local"
    full = sidecar_link(ctl, address)
    assert register(full, "by-full-name", "").session_id
    short = sidecar_link(ctl, address.replace(".svc.cluster.local:", ".svc:"))
    assert "/rebalancer.rebalancer.svc:" in short.address
    assert register(short, "by-short-name", "").session_id

    # The admin CLI inside the pod: 127.0.0.1, its own certificate as the client's.
    assert ctl.in_pod_address == "127.0.0.1:50051"
    done = admin_in_the_pod(ctl, ctl.address(ctl.in_pod_address), "--json", "status")
    assert done.returncode == 0, done.stderr
    held = {d["deployment"] for d in json.loads(done.stdout)["deployments"]}
    assert held == {"by-full-name", "by-short-name"}, done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("host", NOT_COVERED)
def test_a_host_the_certificate_does_not_cover_is_refused(
    prod_controller: Controller, host: str
) -> None:
    ctl = prod_controller
    link = sidecar_link(ctl, f"{host}:50051")
    with pytest.raises(grpc.RpcError) as info:
        register(link, "refused", "")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "does not name the host" in unavailable_cause(link, info.value.details() or "")
    # The admin CLI says it in one line, and no status.
    done = admin_in_the_pod(ctl, link.address, "status")
    assert done.returncode == 5 and not done.stdout, (done.returncode, done.stdout)
    (line,) = done.stderr.splitlines()
    assert "does not name the host" in line, line
