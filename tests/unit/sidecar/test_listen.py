"""The ranks' socket: born with restrictive modes, one sidecar per path (a live one is
never displaced, a dead one's socket is taken over), and the readiness probe."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rebalancer.errors import InputError
from rebalancer.sidecar import listen
from rebalancer.sidecar.config import SidecarConfig
from rebalancer.sidecar.daemon import Sidecar
from rebalancer.wire.link import Link


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder whose socket paths fit the 107 bytes a Unix socket allows."""
    with tempfile.TemporaryDirectory(prefix="sc", dir="/tmp") as d:
        yield Path(d)


def test_claim_makes_a_private_folder_and_refuses_a_second_holder(short_dir: Path) -> None:
    path = short_dir / "run" / "agent.sock"
    first = listen.claim(path, 0o700)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with pytest.raises(InputError, match=f"in use by a live sidecar \\(pid {os.getpid()}\\)"):
        listen.claim(path, 0o700)
    first.release()
    listen.claim(path, 0o750).release()  # free again once released
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750


def test_claim_refuses_a_path_that_is_not_a_socket(short_dir: Path) -> None:
    path = short_dir / "agent.sock"
    path.write_text("not a socket")
    with pytest.raises(InputError, match="not a socket"):
        listen.claim(path, 0o700)


def test_claim_takes_over_the_socket_of_a_sidecar_that_died(short_dir: Path) -> None:
    path = short_dir / "agent.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # bound, never listening: what SIGKILL leaves
        dead.bind(str(path))
    assert stat.S_ISSOCK(path.stat().st_mode)
    listen.claim(path, 0o700).release()
    assert not path.exists()


def test_claim_makes_the_sockets_own_folder_only(short_dir: Path) -> None:
    """The socket's folder is made (its mode keeps the socket private); a missing parent
    is a typo or an unmounted volume: refused, nothing created."""
    path = short_dir / "missing" / "dir" / "agent.sock"
    with pytest.raises(InputError, match=f"{short_dir / 'missing'} does not exist"):
        listen.claim(path, 0o700)
    assert list(short_dir.iterdir()) == []
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "sidecar",
            "--listen",
            f"unix://{path}",
            "--controller",
            "127.0.0.1:1",
            "--ranks",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(
        f"rebalancer sidecar: error: cannot make the socket's folder {path.parent}: "
    ), line
    assert list(short_dir.iterdir()) == []


def test_claim_never_narrows_a_folder_shared_by_everyone(short_dir: Path) -> None:
    """`--listen unix:///tmp/agent.sock` run as root must not make /tmp 0700: a sticky
    folder (everyone's) keeps its mode."""
    os.chmod(short_dir, 0o1777)
    listen.claim(short_dir / "agent.sock", 0o700).release()
    assert stat.S_IMODE(short_dir.stat().st_mode) == 0o1777


def test_claim_never_takes_a_live_socket_that_is_not_a_sidecars(short_dir: Path) -> None:
    """A process listening on the path without the sidecar's lock (it speaks no gRPC
    health): the path is refused as in use, the socket and its server left alone."""
    path = short_dir / "agent.sock"
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(path))
        other.listen()
        with pytest.raises(
            InputError, match="in use by a live process that is not a sidecar"
        ) as info:
            listen.claim(path, 0o700)
        assert getattr(info.value, "exit_code", 2) == 7
        assert stat.S_ISSOCK(path.stat().st_mode)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))  # its server still answers there
    listen.claim(path, 0o700).release()  # closed: now stale, taken over


def test_sidecar_serves_health_on_a_socket_born_restricted(short_dir: Path) -> None:
    path = short_dir / "s" / "agent.sock"
    config = SidecarConfig(
        link=Link("127.0.0.1:1"),
        ranks=(0, 1),
        listen=f"unix://{path}",
        socket_access="owner",
        grace_seconds=0.1,
    )

    async def run() -> None:
        sidecar = Sidecar(config)
        await sidecar.start()
        try:
            assert stat.S_ISSOCK(path.stat().st_mode)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            ok, seen = await asyncio.to_thread(listen.probe, f"unix://{path}", 2.0)
            assert ok and seen == "SERVING; controller link: waiting_for_ranks"
            with pytest.raises(InputError, match="in use"):  # a live one is never displaced
                listen.claim(path, 0o700)
        finally:
            await sidecar.stop()
        assert not path.exists()
        ok, _ = await asyncio.to_thread(listen.probe, f"unix://{path}", 0.5)
        assert not ok

    asyncio.run(run())


def test_cli_refuses_a_path_held_by_a_live_sidecar_with_one_line(short_dir: Path) -> None:
    path = short_dir / "agent.sock"
    held = listen.claim(path, 0o700)  # as a running sidecar holds it
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rebalancer",
                "sidecar",
                "--listen",
                f"unix://{path}",
                "--controller",
                "127.0.0.1:1",
                "--ranks",
                "0-1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        held.release()
    assert out.returncode == 7  # in use, as a controller's store or port
    assert out.stderr.strip().splitlines() == [
        f"rebalancer sidecar: error: {path} is in use by a live sidecar (pid {os.getpid()})"
    ]
    probe = subprocess.run(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "sidecar",
            "--check",
            f"unix://{path}",
            "--timeout",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 1 and "is not serving" in probe.stderr


def test_cli_refuses_a_metrics_port_in_use_and_leaves_no_socket(short_dir: Path) -> None:
    path = short_dir / "agent.sock"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rebalancer",
                "sidecar",
                "--listen",
                f"unix://{path}",
                "--controller",
                "127.0.0.1:1",
                "--ranks",
                "0",
                "--metrics-port",
                str(port),
                "--metrics-host",
                "127.0.0.1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 7
    assert out.stderr.splitlines() == [f"rebalancer sidecar: error: metrics port {port} is in use"]
    assert not path.exists()
    assert not path.with_name("agent.sock.lock").exists()  # issue 34: the lock was left behind
    listen.claim(path, 0o700).release()  # and the path is free again


def test_no_lock_file_outlives_its_holder(short_dir: Path) -> None:
    """Issue 34: a failed sidecar start left `<socket>.lock` behind. The holder deletes it
    as it lets go: a start that fails after the claim, a claim refused after the lock was
    taken, a clean stop; a holder killed outright leaves it, and the next one takes it."""
    path = short_dir / "agent.sock"
    lock = short_dir / "agent.sock.lock"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = SidecarConfig(
            link=Link("127.0.0.1:1"),
            ranks=(0,),
            listen=f"unix://{path}",
            metrics_host="127.0.0.1",
            metrics_port=taken.getsockname()[1],
        )

        async def start() -> None:
            await Sidecar(config).start()

        with pytest.raises(InputError, match="metrics port"):
            asyncio.run(start())
    assert not path.exists() and not lock.exists()
    path.write_text("not a socket")
    with pytest.raises(InputError, match="not a socket"):
        listen.claim(path, 0o700)
    assert not lock.exists()
    path.unlink()
    held = listen.claim(path, 0o700)
    assert lock.read_text() == f"{os.getpid()}\n"
    held.release()
    assert not lock.exists()
    lock.write_text("12345\n")  # what a sidecar killed outright leaves
    listen.claim(path, 0o700).release()
    assert not lock.exists()
