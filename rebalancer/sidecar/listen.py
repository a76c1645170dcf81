"""The ranks' socket: restrictive modes, one sidecar per path, and the readiness probe.

The socket lives in a directory shared with the engine container (an `emptyDir`); its
directory is made 0700 or 0750 and the socket 0600 or 0660 (`SidecarConfig.socket_access`),
so only the pod's own users reach it and the engine needs no secret. One sidecar per
path: an exclusive lock on `<socket>.lock`, held for the life of the process (the kernel
drops it when the process dies, SIGKILL included), so a second sidecar is refused with
one line while a restarted one takes over a stale socket file at once. (gRPC itself
would silently unlink a live socket and bind over it.)

`probe` is the readiness check: gRPC health of the socket, SERVING or not.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rebalancer.errors import InputError

log = logging.getLogger("rebalancer.sidecar")


class InUse(InputError):
    """The socket path (or the metrics port) belongs to another live process: exit code
    7, as for a controller's store or port in use."""

    exit_code = 7


class SocketClaim:
    """This process's hold on a socket path (its lock file, open and locked)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the socket and drop the lock (a clean exit)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)  # closing drops the flock
        self._fd = None


def claim(path: Path, dir_mode: int) -> SocketClaim:
    """Make the socket's directory (mode `dir_mode`), lock the path for this process and
    remove a stale socket file left by a sidecar that died. InputError if a live sidecar
    holds the path, or the path is something other than a socket."""
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)  # empty until the mode below is set
    if folder.stat().st_uid == os.getuid():
        os.chmod(folder, dir_mode)
    else:  # a shared volume made by someone else: its mode is theirs
        log.warning("socket directory %s belongs to uid %d; leaving its mode %o",
                    folder, folder.stat().st_uid, stat.S_IMODE(folder.stat().st_mode))
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise InUse(f"{path} is in use by a live sidecar (pid {holder})") from None
    try:
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise InputError(f"{path} exists and is not a socket")
            ok, _ = probe(f"unix://{path}", timeout=0.5)
            if ok:  # a server that does not take the lock: never take its path
                raise InUse(f"{path} is in use by a live server")
            os.unlink(path)  # stale: its sidecar is gone (we hold the lock)
            log.info("removed the stale socket %s", path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return SocketClaim(path, fd)


@contextlib.contextmanager
def umask_for(mode: int) -> Iterator[None]:
    """Files created meanwhile get at most `mode` (the socket is born restricted)."""
    old = os.umask(0o777 & ~mode)
    try:
        yield
    finally:
        os.umask(old)


def probe(target: str, timeout: float = 2.0) -> tuple[bool, str]:
    """(serving, what was seen): gRPC health of `target` (the overall service)."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            return False, f"{code.name if code else 'error'}: {exc.details() if isinstance(exc, grpc.Call) else exc}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status
