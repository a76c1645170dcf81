"""The controller's guards, in process: the store lock, port reuse off, store paths, a
failed start undone, and which configs may listen where (safe by default)."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from rebalancer.controller import server as server_module
from rebalancer.controller.config import (
    ControllerConfig,
    check_exposure,
    exposure_warnings,
    is_loopback,
    load_config,
    unauthenticated_services,
    validate_config,
)
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.controller.store import InUseError, Store, StoreLock
from rebalancer.errors import InputError
from rebalancer.wire.channel import MAX_GRPC_INT, server_options


def test_store_lock_is_exclusive_and_names_the_holder(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    first = StoreLock(db)
    try:
        with pytest.raises(InUseError) as info:
            StoreLock(db)
        assert f"pid {__import__('os').getpid()}" in str(info.value)
        assert info.value.exit_code == 7 and "\n" not in str(info.value)
    finally:
        first.release()
    StoreLock(db).release()  # free again
    assert not (tmp_path / "c.sqlite.lock").exists()  # the holder deletes it as it lets go


def test_store_lock_is_keyed_on_the_file_not_the_path(tmp_path: Path) -> None:
    """A symbolic link to a store in use (or a folder link above it) meets its lock; a
    store file with a second hard link is refused, naming why."""
    (tmp_path / "real").mkdir()
    db = tmp_path / "real" / "c.sqlite"
    (tmp_path / "link.sqlite").symlink_to(db)
    (tmp_path / "folder-link").symlink_to(tmp_path / "real")
    first = StoreLock(db)
    try:
        for other in (tmp_path / "link.sqlite", tmp_path / "folder-link" / "c.sqlite"):
            with pytest.raises(InUseError, match="in use by another controller"):
                StoreLock(other)
    finally:
        first.release()
    Store(db).close()
    os.link(db, tmp_path / "hard.sqlite")
    for name in (db, tmp_path / "hard.sqlite"):
        with pytest.raises(InputError, match="has 2 hard links") as info:
            StoreLock(name)
        assert not isinstance(info.value, InUseError)
    assert not list(tmp_path.rglob("*.lock"))


def test_store_lock_opened_just_before_its_deletion_is_not_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that opened the lock file just before its holder deleted it locks a file
    no path names any more: it opens the path again, so two controllers never hold two
    files of one name; a lock file left by a holder killed outright is taken over."""
    import rebalancer.controller.store as store_module

    db = tmp_path / "c.sqlite"
    holder = StoreLock(db)
    stale = os.open(holder.path, os.O_RDWR)
    holder.release()
    real_open, opened = os.open, []

    def open_stale_first(path: str, *args: object) -> int:
        opened.append(path)
        return stale if len(opened) == 1 else real_open(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module.os, "open", open_stale_first)
    lock = StoreLock(db)
    monkeypatch.undo()
    try:
        assert len(opened) == 2 and Path(lock.path).exists()
        with pytest.raises(InUseError):
            StoreLock(db)
    finally:
        lock.release()
    Path(lock.path).write_text("12345\n")  # left by a holder killed outright
    StoreLock(db).release()
    assert not Path(lock.path).exists()


def test_store_lock_is_not_inherited_by_children(tmp_path: Path) -> None:
    """The decision worker is a child: it must not keep the store locked after the
    controller is gone.

    close_fds=False, so only close-on-exec keeps the lock's descriptor from the child.
    The child says when it runs: with close_fds=False, Popen uses posix_spawn, which
    returns as soon as the child has left the parent's memory (vfork), before the
    kernel has closed the child's close-on-exec descriptors; tried in that window, the
    lock is still held by the child for a moment (InUseError, "another process").
    Once the child's Python runs, its exec is complete: an inherited descriptor would
    still be open (and the lock held for the child's 60 s), a close-on-exec one is gone.
    """
    db = tmp_path / "c.sqlite"
    lock = StoreLock(db)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(60)"],
        close_fds=False,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        lock.release()
        StoreLock(db).release()  # the child, still alive, holds nothing
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
        child.stdout.close()  # type: ignore[union-attr]


def test_server_options_turn_port_reuse_off() -> None:
    options = dict(server_options())
    assert options["grpc.so_reuseport"] == 0
    first = grpc.server(concurrent.futures.ThreadPoolExecutor(1), options=server_options())
    second = grpc.server(concurrent.futures.ThreadPoolExecutor(1), options=server_options())
    try:
        port = first.add_insecure_port("127.0.0.1:0")
        first.start()
        with pytest.raises(RuntimeError):
            if second.add_insecure_port(f"127.0.0.1:{port}") == 0:
                raise RuntimeError("not bound")
    finally:
        first.stop(None)
        second.stop(None)


def test_message_limit_beyond_grpc_int_is_clamped() -> None:
    assert dict(server_options(2**40))["grpc.max_receive_message_length"] == MAX_GRPC_INT


@pytest.mark.parametrize("case", ["missing-folder", "folder", "text-file"])
def test_store_paths_that_cannot_be_stores(tmp_path: Path, case: str) -> None:
    path = {
        "missing-folder": tmp_path / "nope" / "c.sqlite",
        "folder": tmp_path,
        "text-file": tmp_path / "notes.txt",
    }[case]
    if case == "text-file":
        path.write_text("not sqlite\n" * 100)
    with pytest.raises(InputError) as info:
        Store(path)
    message = str(info.value)
    assert "\n" not in message
    assert {
        "missing-folder": "does not exist",
        "folder": "is a folder",
        "text-file": "not an SQLite database",
    }[case] in message


def test_a_failed_start_releases_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A metrics port taken between the probe and the bind: start() undoes what it began
    (gRPC server, store, lock) and raises InUseError; the same store then starts."""
    busy = socket.socket()
    busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    real = server_module.probe_port
    monkeypatch.setattr(
        server_module,
        "probe_port",
        lambda host, port, what: None if what == "metrics" else real(host, port, what),
    )
    db = tmp_path / "c.sqlite"
    config = ControllerConfig(
        port=0, db_path=str(db), metrics_port=busy.getsockname()[1], drain_seconds=0.0
    )
    try:
        with pytest.raises(InUseError, match="metrics port .* is in use"):
            EmbeddedController(config).start()
    finally:
        busy.close()
    StoreLock(db).release()
    ctl = EmbeddedController(replace(config, metrics_port=None))
    ctl.start()
    try:
        with pytest.raises(InUseError, match="in use by another controller"):
            EmbeddedController(replace(config, metrics_port=None)).start()
    finally:
        ctl.stop()


@pytest.mark.parametrize(
    "host, expected",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("controller.example", False),
    ],
)
def test_is_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_exposure_rules(tmp_path: Path) -> None:
    for name in ("ca.crt", "s.crt", "s.key"):
        (tmp_path / name).write_text("x")
    bare = ControllerConfig(host="0.0.0.0")
    assert unauthenticated_services(bare) == ["admin", "worker"]
    with pytest.raises(
        InputError, match="the admin service and the worker service unauthenticated"
    ):
        check_exposure(bare)
    with pytest.raises(InputError, match="the worker service unauthenticated"):
        check_exposure(replace(bare, admin_token="t"))
    with pytest.raises(InputError, match="the admin service unauthenticated"):
        check_exposure(replace(bare, worker_tokens={"d": "w"}))
    check_exposure(replace(bare, admin_token="t", worker_tokens={"d": "w"}))
    check_exposure(replace(bare, insecure=True))
    check_exposure(ControllerConfig(host="127.0.0.1"))
    mtls = replace(
        bare,
        tls_cert=str(tmp_path / "s.crt"),
        tls_key=str(tmp_path / "s.key"),
        tls_client_ca=str(tmp_path / "ca.crt"),
    )
    check_exposure(mtls)  # every client needs a certificate: authenticated
    assert any("any client certificate" in w for w in exposure_warnings(mtls))
    assert not any("TLS off" in w for w in exposure_warnings(mtls))
    lines = exposure_warnings(replace(bare, insecure=True))
    assert [w.split(" ")[0] for w in lines] == ["admin", "worker", "TLS"]
    assert exposure_warnings(replace(bare, admin_token="t", worker_tokens={"d": "w"})) == [
        "TLS off: calls and tokens travel in plain text (0.0.0.0, not loopback)"
    ]


def test_config_types_are_checked(tmp_path: Path) -> None:
    base = ControllerConfig()
    for change, words in (
        ({"port": True}, "port must be a port number"),
        ({"host": ""}, "host must be a non-empty string"),
        ({"db_path": 5}, "db_path must be a non-empty string"),
        ({"max_message_bytes": 0}, "max_message_bytes"),
        ({"grace_seconds": float("inf")}, "grace_seconds"),
        ({"tick_seconds": 0.0}, "tick_seconds must be > 0"),
        ({"insecure": 1}, "insecure must be true or false"),
        ({"admin_token": ""}, "admin_token must be a non-empty string"),
        ({"pool_max_moving": 0}, "pool_max_moving must be an integer >= 1"),
        ({"pool_max_moving": 1.5}, "pool_max_moving must be an integer >= 1"),
        ({"decision_cpu_share": 0.0}, r"decision_cpu_share must be a number in \(0, 1\]"),
        ({"decision_cpu_share": 1.5}, "decision_cpu_share must be"),
        ({"decision_cpu_share": float("nan")}, "decision_cpu_share must be"),
        ({"decision_cpu_share": "half"}, "decision_cpu_share must be"),
        ({"cpu_cores": -1}, r"cpu_cores must be a finite number >= 0 \(0: no bound\)"),
        ({"cpu_cores": float("inf")}, "cpu_cores must be"),
        ({"cpu_cores": "one"}, "cpu_cores must be"),
        ({"contingency_take_mb_per_second": 0.0}, "contingency_take_mb_per_second must be"),
        ({"contingency_take_mb_per_second": float("inf")}, "contingency_take_mb_per_second"),
        ({"contingency_take_mb_per_second": "fast"}, "contingency_take_mb_per_second"),
    ):
        with pytest.raises(InputError, match=words):
            validate_config(replace(base, **change))  # type: ignore[arg-type]
    empty = tmp_path / "token"
    empty.write_text("\n")
    (tmp_path / "c.toml").write_text(f'[server]\nadmin_token_file = "{empty}"\n')
    with pytest.raises(InputError, match="is empty"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "c.toml").write_text("[server]\ninsecure = true\npool_max_moving = 2\n")
    assert load_config(tmp_path / "c.toml").insecure is True
    assert load_config(tmp_path / "c.toml").pool_max_moving == 2


def test_the_server_hands_its_rates_and_share_to_the_controller(tmp_path: Path) -> None:
    """What `[server]` says about the decision worker's share and the pool members'
    contingency takes is what the controller it builds runs with."""
    import asyncio

    from rebalancer.controller.server import ControllerServer

    (tmp_path / "c.toml").write_text(
        "[server]\nport = 0\n"
        f'db_path = "{tmp_path / "c.sqlite"}"\n'
        "decision_cpu_share = 0.25\ncontingency_take_mb_per_second = 4\ncpu_cores = 1.5\n"
    )

    async def build() -> tuple[float, float, float]:
        server = ControllerServer(load_config(tmp_path / "c.toml"))
        try:
            budget = server.controller.decisions.budget
            return (
                budget.max_share,
                budget.cores,
                server.controller.contingency.take_bytes_per_second,
            )
        finally:
            server._opened.close()

    assert asyncio.run(build()) == (0.25, 1.5, 4e6)
