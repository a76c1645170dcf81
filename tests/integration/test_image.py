"""The image, built and run here. No base image can be pulled on these machines, so
buildah builds the Containerfile on a local Debian bookworm root that .ci/run makes with
mmdebstrap (.ci/tools/image-base; the Containerfile's PYTHON_IMAGE argument, whose default
is the public digest), and pip takes the locked wheels from a folder instead of the
package index (fetched once into .ci/tools/image-wheels by the host's pip, hashes checked
twice). In containers of the image (`buildah run`, chroot isolation: the host's network,
so loopback is shared): `rebalancer serve` answers gRPC health to the host and drains on
SIGTERM, a sidecar passes `rebalancer sidecar --check`, and the image holds exactly the lock
and the package, no bench, no tests, no pip, no torch.

Everything the test makes (buildah's storage, containers, images, temporary files, every
process) lives under one temporary folder and goes with it, however the test ends.
Phase times are printed (-s); build time: docs/operations.md, "Image".

Root, buildah and the mmdebstrap base are needed: .ci/run provides them (CI fails without
them; elsewhere the test is skipped, saying why)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from packaging.utils import canonicalize_name

from tests.unit.deploy.conftest import CI_TOOLS, ROOT, find_tool, missing
from tests.unit.deploy.image_lock import BUILD_LOCK, RUNTIME_LOCK, missing_wheels, read_lock

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

BASE_TAR = CI_TOOLS / "image-base" / "base.tar"
WHEELS = CI_TOOLS / "image-wheels"
BASE_IMAGE = "localhost/rebalancer-test-base"
IMAGE = "localhost/moe-rebalancer:test"
# What a base image's config sets and a bare root file system lacks.
BASE_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VENV_PYTHON = "/opt/rebalancer/bin/python"
ENTRYPOINT = "/opt/rebalancer/bin/rebalancer"
SOCKET = "unix:///run/rebalancer/agent.sock"


def locked_wheels() -> Path:
    """The folder of every locked wheel (runtime and build), fetched by hash if one is missing."""
    pins = read_lock(RUNTIME_LOCK) | read_lock(BUILD_LOCK)
    if missing_wheels(pins, WHEELS):
        WHEELS.mkdir(parents=True, exist_ok=True)
        fetch = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--require-hashes",
                "--only-binary=:all:",
                "-r",
                str(RUNTIME_LOCK),
                "-r",
                str(BUILD_LOCK),
                "-d",
                str(WHEELS),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if fetch.returncode != 0:
            missing("the locked wheels", f"pip download failed: {fetch.stderr.strip()[-500:]}")
    left = missing_wheels(pins, WHEELS)
    assert not left, f"no wheel in {WHEELS} matches the lock's hashes for {left}"
    return WHEELS


@dataclass
class Buildah:
    """buildah on storage of its own under `home`, its temporary files there too, so that
    every mount it makes and every process it starts lies under `home`."""

    home: Path
    binary: str
    driver: (
        str  # overlay: no full copy of the base per stage and container; vfs where overlay fails
    )
    started: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def argv(self) -> list[str]:
        return [
            self.binary,
            "--root",
            str(self.home / "storage"),
            "--runroot",
            str(self.home / "run"),
            "--storage-driver",
            self.driver,
        ]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "TMPDIR": str(self.home / "tmp"), "BUILDAH_ISOLATION": "chroot"}

    def __call__(self, *args: str, timeout: float = 300) -> str:
        run = subprocess.run(
            [*self.argv, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            stdin=subprocess.DEVNULL,
        )
        assert run.returncode == 0, (
            f"buildah {' '.join(args)}: exit {run.returncode}\n"
            f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
        )
        return run.stdout.strip()

    def start(self, container: str, *command: str, log: Path) -> subprocess.Popen[str]:
        """`buildah run` in a session of its own: its whole tree is one process group."""
        with log.open("w") as stderr:
            proc = subprocess.Popen(
                [*self.argv, "run", "--isolation", "chroot", container, "--", *command],
                stdout=subprocess.PIPE,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                text=True,
                env=self.env,
                start_new_session=True,
            )
        self.started.append(proc)
        return proc

    def processes(self) -> list[int]:
        """Every live process started here: the groups of `start`, and whatever has its root
        under `home` (chroot isolation roots a container's processes in its mount)."""
        pids = set()
        for proc in self.started:
            if proc.poll() is None:
                pids.add(proc.pid)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/root").startswith(f"{self.home}/"):
                    pids.add(int(entry))
        return sorted(pids)

    def remove_everything(self) -> list[str]:
        """Kill what runs, remove containers and images, unmount and delete `home`. Returns
        what could not be removed."""
        for proc in self.started:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (pids := self.processes()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        left = [f"process {pid}" for pid in self.processes()]
        for args in (("rm", "--all"), ("rmi", "--all", "--force")):
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                self(*args, timeout=120)
        for mount in mounts_under(self.home):
            subprocess.run(["umount", "--lazy", mount], capture_output=True, timeout=30)
        shutil.rmtree(self.home, ignore_errors=True)
        left += [f"mount {m}" for m in mounts_under(self.home)]
        if self.home.exists():
            left.append(f"folder {self.home}")
        return left


def mounts_under(folder: Path) -> list[str]:
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return sorted((p for p in points if p.startswith(f"{folder}/")), key=len, reverse=True)


@dataclass
class Image:
    buildah: Buildah
    container: str  # a working container of the image, for the tests to run in


def storage(home: Path, binary: str) -> tuple[Buildah, str]:
    """buildah on overlay storage, or vfs if overlay cannot mount here; and a new scratch
    container on it."""
    failures = []
    for driver in ("overlay", "vfs"):
        buildah = Buildah(home / driver, binary, driver)
        (buildah.home / "tmp").mkdir(parents=True)
        try:
            return buildah, buildah("from", "scratch")
        except AssertionError as error:
            failures.append(str(error))
            left = buildah.remove_everything()
            assert not left, f"the image test left behind: {left}"
    raise AssertionError("buildah cannot make a container here:\n" + "\n".join(failures))


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    if os.geteuid() != 0:
        missing("root", "buildah's chroot isolation and storage of its own run as root here")
    binary = find_tool("buildah")
    if binary is None:
        missing("buildah", ".ci/run installs Debian's (`.ci/run --tools` alone)")
    if not BASE_TAR.is_file():
        missing(
            f"the local Debian base {BASE_TAR.relative_to(ROOT)}",
            "`.ci/run --tools` makes it with mmdebstrap",
        )
    assert binary is not None
    wheels = locked_wheels()
    home = Path(tempfile.mkdtemp(prefix="rebalancer-image-"))
    try:
        buildah, base = storage(home, binary)
    except BaseException:
        shutil.rmtree(home, ignore_errors=True)
        raise
    seconds: dict[str, float] = {}
    try:
        start = time.monotonic()
        buildah("add", base, str(BASE_TAR), "/", timeout=600)
        buildah("config", "--env", BASE_PATH, "--cmd", "/bin/sh", base)
        buildah("commit", "--quiet", "--rm", base, BASE_IMAGE, timeout=600)
        seconds["base"] = time.monotonic() - start
        start = time.monotonic()
        buildah(
            "bud",
            "--pull-never",
            "--isolation",
            "chroot",
            "--layers=false",
            "--build-arg",
            f"PYTHON_IMAGE={BASE_IMAGE}",
            "--build-arg",
            "PIP_NO_INDEX=1",
            "--build-arg",
            "PIP_FIND_LINKS=/wheels",
            "--volume",
            f"{wheels}:/wheels:ro",
            "-f",
            str(ROOT / "Containerfile"),
            "-t",
            IMAGE,
            str(ROOT),
            timeout=1000,
        )
        seconds["build"] = time.monotonic() - start
        print(
            f"\n[image] {buildah.driver} storage: base imported in {seconds['base']:.1f}s,"
            f" image built in {seconds['build']:.1f}s"
        )
        yield Image(buildah, buildah("from", "--pull-never", IMAGE))
    finally:
        start = time.monotonic()
        left = buildah.remove_everything()
        shutil.rmtree(home, ignore_errors=True)
        print(f"\n[image] everything removed in {time.monotonic() - start:.1f}s")
        assert not left and not home.exists(), f"the image test left behind: {left or home}"


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The process's next stdout line, or '' if none within `timeout`."""
    line: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    return line[0] if line else ""


def main_process(proc: subprocess.Popen[str]) -> int:
    """The `rebalancer` process in a `buildah run` tree (its group), not buildah's own."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if os.getpgid(int(entry)) == proc.pid and argv[:2] == [
                VENV_PYTHON.encode(),
                ENTRYPOINT.encode(),
            ]:
                return int(entry)
    raise AssertionError(f"no rebalancer process in the group of buildah run {proc.pid}")


def stop(proc: subprocess.Popen[str], log: Path) -> int:
    """SIGTERM to the rebalancer inside (what the kubelet sends), then buildah run's exit code."""
    os.kill(main_process(proc), signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"not stopped 60 s after SIGTERM: {log.read_text()[-2000:]}") from None


def test_serves_health_and_the_sidecar_check_in_the_image(image: Image) -> None:
    buildah, container = image.buildah, image.container
    assert buildah("run", container, "--", "id", "-u") == "10001", "the manifests' runAsUser"
    serve_log = buildah.home / "serve.log"
    serve = buildah.start(
        container,
        "rebalancer",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--db",
        "/var/lib/rebalancer/rebalancer.sqlite",
        "--grace",
        "1",
        log=serve_log,
    )
    line = read_line(serve, 120)
    assert line.startswith("serving on 127.0.0.1:"), (line, serve_log.read_text()[-2000:])
    address = line.split()[-1]
    # The host asks the controller in the container for its health, over loopback.
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=30
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING

    sidecar_log = buildah.home / "sidecar.log"
    sidecar = buildah.start(
        container,
        "rebalancer",
        "sidecar",
        "--listen",
        SOCKET,
        "--controller",
        address,
        "--ranks",
        "0-1",
        "--pod",
        "test/pod0",
        "--grace",
        "1",
        log=sidecar_log,
    )
    line = read_line(sidecar, 120)
    assert line.startswith("sidecar serving on"), (line, sidecar_log.read_text()[-2000:])
    # The startup probe of the manifests, run in the image as the kubelet would.
    buildah(
        "run",
        container,
        "--",
        "rebalancer",
        "sidecar",
        "--check",
        SOCKET,
        "--timeout",
        "30",
        timeout=120,
    )

    assert stop(sidecar, sidecar_log) == 0, sidecar_log.read_text()[-2000:]
    assert stop(serve, serve_log) == 0, serve_log.read_text()[-2000:]
    assert "controller stopped" in serve_log.read_text()


CONTENTS = """
import importlib.metadata as md, importlib.util as u, json, sys
print(json.dumps({
    "python": list(sys.version_info[:2]),
    "distributions": sorted(f"{d.metadata['Name']}=={d.version}" for d in md.distributions()),
    "importable": [m for m in ("torch", "bench", "tests", "pip", "setuptools") if u.find_spec(m)],
}))
"""


def test_holds_exactly_the_lock_and_the_package(image: Image) -> None:
    found = json.loads(image.buildah("run", image.container, "--", VENV_PYTHON, "-c", CONTENTS))
    assert found["python"] == [3, 11]
    locked = {f"{name}=={pin.version}" for name, pin in read_lock(RUNTIME_LOCK).items()}
    installed = set()
    for entry in found["distributions"]:
        name, _, version = entry.partition("==")
        installed.add(f"{canonicalize_name(name)}=={version}")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert installed == locked | {f"{project['name']}=={project['version']}"}
    assert found["importable"] == [], "neither torch, bench, tests nor a build tool ships"
