"""The ranks' socket: restrictive modes, one sidecar per path, and the readiness probe.

The socket lives in a directory shared with the engine container (an `emptyDir`); its
directory is made 0700 or 0750 and the socket 0600 or 0660 (`SidecarConfig.socket_access`),
so only the pod's own users reach it and the engine needs no secret. One sidecar per
path: an exclusive lock on `<socket>.lock`, held for the life of the process (the kernel
drops it when the process dies, SIGKILL included), so a second sidecar is refused with
one line while a restarted one takes over a stale socket file at once. (gRPC itself
would silently unlink a live socket and bind over it.) The holder deletes the lock file
as it lets go, while it still holds the lock (a clean stop, or a start that failed after
the lock was taken, leaves no `.lock` behind), so a lock counts only once the path still
names the file locked: a process that opened the file just before it was deleted opens
the path again. One left by a sidecar killed outright is taken over by the next.

`probe` is the readiness check: gRPC health of the socket, SERVING or not (SERVING
whether or not the controller is reachable: ranks are served here either way), with the
controller link's state beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
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
        """Remove the socket and the lock file, then drop the lock (a clean exit, or a
        start that failed after the claim)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        _let_go(lock_path(self.path), self._fd)
        self._fd = None


def lock_path(path: Path) -> Path:
    """The lock file of the socket `path`: `<socket>.lock`."""
    return path.with_name(path.name + ".lock")


def _let_go(lock: Path, fd: int) -> None:
    """Delete the lock file while it is still locked (module docstring), then drop the lock."""
    with contextlib.suppress(
        OSError
    ):  # gone already, or a read-only folder: the next holder takes it over
        os.unlink(lock)
    os.close(fd)  # closing the only descriptor drops the flock


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the open file `fd`."""
    try:
        here, there = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def claim(path: Path, dir_mode: int) -> SocketClaim:
    """Make the socket's folder (mode `dir_mode`) if its parent exists, lock the path for
    this process and remove a stale socket file left by a sidecar that died. InputError if
    the parent folder is missing, a live process listens on the path (a sidecar or
    anything else), or the path is something other than a socket."""
    folder = path.parent
    # The socket's own folder is made (its mode is what keeps the socket private), never
    # a chain of them: a missing parent is a typo or a volume that is not mounted.
    if not folder.is_dir():
        if not folder.parent.is_dir():
            raise InputError(
                f"cannot make the socket's folder {folder}: {folder.parent} does not exist "
                "(mount the pod's shared volume there, or fix --listen)"
            )
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)  # private until the mode below is set
    if folder.stat().st_mode & stat.S_ISVTX:  # /tmp and the like: everyone's, never narrowed
        log.warning(
            "socket directory %s is shared by everyone (sticky, mode %o): leaving its mode; "
            "give the socket a folder of its own",
            folder,
            stat.S_IMODE(folder.stat().st_mode),
        )
    elif folder.stat().st_uid == os.getuid():
        os.chmod(folder, dir_mode)
    else:  # a shared volume made by someone else: its mode is theirs
        log.warning(
            "socket directory %s belongs to uid %d; leaving its mode %o",
            folder,
            folder.stat().st_uid,
            stat.S_IMODE(folder.stat().st_mode),
        )
    lock = lock_path(path)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise InUse(f"{path} is in use by a live sidecar (pid {holder})") from None
        if _names(lock, fd):
            break
        os.close(fd)  # deleted by the holder that just let go: lock the path's file
    try:
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise InputError(f"{path} exists and is not a socket")
            if accepts_connections(
                path
            ):  # a server that does not take the lock: never take its path
                raise InUse(
                    f"{path} is in use by a live process that is not a sidecar "
                    "(it accepts connections)"
                )
            os.unlink(path)  # stale: its sidecar is gone (we hold the lock)
            log.info("removed the stale socket %s", path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        _let_go(lock, fd)  # refused after the lock was taken: leave no lock file
        raise
    return SocketClaim(path, fd)


def accepts_connections(path: Path) -> bool:
    """Whether a process listens on the Unix socket `path`, whatever it speaks (a socket
    left by a dead process refuses the connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe_socket:
        probe_socket.settimeout(1.0)
        try:
            probe_socket.connect(str(path))
        except ConnectionRefusedError:
            return False
        except OSError:  # a full backlog (EAGAIN), a timeout: someone is there
            return True
    return True


@contextlib.contextmanager
def umask_for(mode: int) -> Iterator[None]:
    """Files created meanwhile get at most `mode` (the socket is born restricted)."""
    old = os.umask(0o777 & ~mode)
    try:
        yield
    finally:
        os.umask(old)


# Trailing metadata of the sidecar's health answer: the state of its link to the
# controller and why, for `rebalancer sidecar --check` to print.
UPSTREAM_KEY = "rebalancer-upstream"


def probe(target: str, timeout: float = 2.0) -> tuple[bool, str]:
    """(serving, what was seen): gRPC health of `target` (the overall service), and when a
    sidecar serves, the state of its controller link ("SERVING; controller link: ...")."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply, call = health_pb2_grpc.HealthStub(channel).Check.with_call(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            return (
                False,
                f"{code.name if code else 'error'}: "
                f"{exc.details() if isinstance(exc, grpc.Call) else exc}",
            )
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    upstream = dict(call.trailing_metadata() or ()).get(UPSTREAM_KEY)
    seen = f"{status}; controller link: {upstream}" if upstream else status
    return reply.status == health_pb2.HealthCheckResponse.SERVING, seen
