"""The sidecar's settings: one typed dataclass, filled from flags or the pod's environment.

Kubernetes conventions: the link to the controller (its address, the token and TLS
files, deployment, pool) from the `REBALANCER_*` names every engine reads too
(rebalancer.wire.link.LINK_ENV: `REBALANCER_ADDRESS`, `REBALANCER_TLS_CA`, ...), a flag
taking precedence; pod name and namespace from the downward API (`POD_NAME`,
`POD_NAMESPACE`), and in a LeaderWorkerSet the pod's ranks from `LWS_GROUP_SIZE` /
`LWS_WORKER_INDEX` with `--ranks-per-pod` (pod i of the group holds ranks i*n .. i*n +
n - 1). Credentials are read from files (mounted secrets), never from flags or the
environment themselves.

Flags are checked at start (a wrong one is a manifest bug, found at the first rollout);
the credential files are not: they come from Secrets that may be missing or not yet
projected, and a sidecar that exits for that would keep the inference pod from starting
(its startup probe gates the engine). They are read at every connection attempt instead
(`channel()`), by the upstream link, which reports what is missing and serves the ranks
locally meanwhile.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, get_args

from rebalancer.errors import InputError
from rebalancer.wire.channel import check_address
from rebalancer.wire.layout import MAX_SLOTS
from rebalancer.wire.link import LINK_ENV, Link

DEFAULT_LISTEN = "unix:///run/rebalancer/agent.sock"

# Who may connect to the socket: its owner only (directory 0700, socket 0600), or also
# its group (0750, 0660: an engine container running as another user of the pod's
# fsGroup).
SocketAccess = Literal["owner", "group"]
SOCKET_ACCESS: tuple[SocketAccess, ...] = get_args(SocketAccess)
MODES: dict[SocketAccess, tuple[int, int]] = {"owner": (0o700, 0o600), "group": (0o750, 0o660)}

# How the sidecar takes part in merging its EP group's pods (MergeConfig.role).
MergeRole = Literal["off", "leader", "follower"]
MERGE_ROLES: tuple[MergeRole, ...] = get_args(MergeRole)

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class MergeConfig:
    """Merging an EP group's pods at one sidecar (rebalancer/sidecar/merge.py): the
    leader pod's sidecar (a LeaderWorkerSet's leader, by configuration: no election) sums
    the group's windows and holds its one session; the other pods' sidecars stream to it.
    Checked by SidecarConfig."""

    role: MergeRole = "off"
    """off: this pod's ranks are a group session of their own (the default); leader:
    this sidecar also serves its group's follower sidecars on `listen` and registers the
    group's ranks upstream as one session; follower: its upstream is the leader's sidecar
    at `leader` (the controller while the leader is away)."""
    listen: str = ""
    """leader: the host:port the followers reach (TCP; port 0 picks one)."""
    group_ranks: tuple[int, ...] = ()
    """leader: every rank of the EP group, its own pod's and the followers' (its own
    included); the followers' ranks are waited for up to `wait_seconds`."""
    leader: str = ""
    """follower: the leader sidecar's host:port (in a LeaderWorkerSet
    `$(LWS_LEADER_ADDRESS):<port>`), reached with the link's TLS files and token."""
    tls_cert_file: str | None = None
    """leader: the server certificate (PEM) followers check with the link's CA: TLS on
    `listen` when set (with `tls_key_file`)."""
    tls_key_file: str | None = None
    """leader: the private key of `tls_cert_file` (PEM)."""
    wait_seconds: float = 10.0
    """leader: how long it waits for every follower before it registers the ranks it
    has (a follower that comes later makes it register the group again); follower: how
    long the leader may be unreachable (or refuse it) before this sidecar streams
    straight to the controller."""
    retry_leader_seconds: float = 5.0
    """follower, streaming straight to the controller: how often it asks whether the
    leader serves again, and then goes back to it."""

    def check(self, own: tuple[int, ...]) -> None:
        """InputError, one line, for settings that do not fit the role or `own` ranks."""
        if self.role not in MERGE_ROLES:
            raise InputError(f"merge role {self.role!r} is not one of {MERGE_ROLES}")
        for name in ("wait_seconds", "retry_leader_seconds"):
            if not getattr(self, name) > 0:
                raise InputError(f"merge {name} must be > 0, got {getattr(self, name)}")
        if self.role == "leader":
            if not self.listen:
                raise InputError(
                    "a merging leader needs the address its followers reach (--merge-listen)"
                )
            host, _, port = self.listen.rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise InputError(
                    f"merge listen address {self.listen!r} must be host:port "
                    "(port 0-65535; 0: any free)"
                )
            missing = sorted(set(own) - set(self.group_ranks))
            if missing:
                raise InputError(
                    f"the group's ranks {format_ranks(self.group_ranks)} must include this "
                    f"pod's own (rank {missing[0]} is not one of them)"
                )
            if len(set(self.group_ranks)) != len(self.group_ranks):
                raise InputError(f"group ranks {list(self.group_ranks)} name a rank twice")
            if bool(self.tls_cert_file) != bool(self.tls_key_file):
                raise InputError("TLS for the followers needs both a certificate and its key")
        elif self.role == "follower":
            if not self.leader:
                raise InputError("a follower needs its leader sidecar's address (--merge-leader)")
            check_address(self.leader)


@dataclass(frozen=True)
class SidecarConfig:
    """Everything the daemon needs; checked on construction (InputError, one line)."""

    # Upstream: the controller's gRPC target (host:port); credentials as files (TLS with the
    # controller's CA, mutual TLS with a client certificate and key, the deployment's bearer
    # token in `token_file`, read at each connection attempt); the deployment ("" = the one
    # the ranks register with); the replica pool ("" = none, or what the ranks name), told
    # upstream at Register: a fresh group is offered the pool's placement
    # (ControllerMessage.warm_start).
    link: Link
    ranks: tuple[int, ...]  # the EP ranks of this pod
    listen: str = DEFAULT_LISTEN  # unix:///absolute/path of the ranks' socket
    socket_access: SocketAccess = "group"
    pod: str = ""  # namespace/name, for logs and the controller
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None  # None: no /metrics server; 0 picks a port
    max_buffered_windows: int = 64  # merged windows held while upstream is down
    fold_lag: int = 2  # a rank this many windows behind is not waited for
    rpc_timeout_seconds: float = 5.0  # deadline of upstream unary calls
    backoff_initial_seconds: float = 0.2
    # A restarted controller is back in about a second (several on a starved node): a pod
    # tries again within 1 s (1.5 s with jitter), so every rank is resynced within a few
    # seconds (RELIABILITY.md), at the cost of one connection attempt per pod a second
    # while the controller is down.
    backoff_max_seconds: float = 1.0
    grace_seconds: float = 2.0  # on SIGTERM: calls in flight and last windows
    merge: MergeConfig = MergeConfig()  # merging the EP group's pods at its leader's sidecar

    def __post_init__(self) -> None:
        if not self.link.address:
            raise InputError(
                f"the controller's address is needed (--controller or {LINK_ENV['address']})"
            )
        check_address(self.link.address)
        if not self.ranks:
            raise InputError(
                "the pod's ranks are needed "
                "(--ranks, or LWS_GROUP_SIZE/LWS_WORKER_INDEX with --ranks-per-pod)"
            )
        if len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise InputError(f"ranks {list(self.ranks)} must be distinct and >= 0")
        socket_path(self.listen)  # raises on a target that is not unix:///absolute/path
        if self.socket_access not in SOCKET_ACCESS:
            raise InputError(f"socket access {self.socket_access!r} is not one of {SOCKET_ACCESS}")
        if self.max_buffered_windows < 1:
            raise InputError(f"max buffered windows must be >= 1, got {self.max_buffered_windows}")
        if self.fold_lag < 1:
            raise InputError(f"fold lag must be >= 1, got {self.fold_lag}")
        for name in ("rpc_timeout_seconds", "backoff_initial_seconds", "backoff_max_seconds"):
            if not getattr(self, name) > 0:
                raise InputError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.backoff_max_seconds < self.backoff_initial_seconds:
            raise InputError("backoff max must be >= backoff initial")
        if self.grace_seconds < 0:
            raise InputError(f"grace must be >= 0, got {self.grace_seconds}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InputError(
                "metrics port must be a port number (0-65535; 0: any free), "
                f"got {self.metrics_port}"
            )
        # The credential flags must fit together; their files are read at each connection.
        self.link.check()
        self.merge.check(self.ranks)

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """The ranks this sidecar may speak for upstream: the EP group's when it leads the
        group's merge, else its pod's."""
        return tuple(sorted(self.merge.group_ranks)) if self.merge.role == "leader" else self.ranks

    @property
    def socket(self) -> Path:
        return socket_path(self.listen)

    @property
    def modes(self) -> tuple[int, int]:
        """(directory mode, socket mode)."""
        return MODES[self.socket_access]

    @property
    def ranks_label(self) -> str:
        return format_ranks(self.ranks)

    def channel(self) -> Link:
        """The upstream link, files read now: TLS / mutual TLS (InputError, one line, if a
        certificate file is missing or unreadable: never fall back to plain text) and the
        bearer token (None when its file is missing or empty: `token_missing` says why;
        mutual TLS, or a controller without [worker_tokens], needs none)."""
        token, _ = read_token(self.link.token_file)
        link = replace(self.link, token=token)
        link.credentials()  # reads the certificate files
        return link

    def token_missing(self) -> str:
        """Why a configured token file gives no token ("" when it does, or none is configured)."""
        return read_token(self.link.token_file)[1]


def read_token(path: str | None) -> tuple[str | None, str]:
    """(the token in `path`, stripped, or None; why there is none, "" if none was asked for)."""
    if not path:
        return None, ""
    try:
        token = Path(path).read_text().strip()
    except FileNotFoundError:
        return None, f"{path}: no such file (worker token)"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path}: {getattr(exc, 'strerror', None) or exc} (worker token)"
    return (token, "") if token else (None, f"{path}: the worker token file is empty")


def socket_path(target: str) -> Path:
    """The path of a `unix:///absolute/path` (or `unix:/absolute/path`) target."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            path = Path(target[len(prefix) :])
            if path.is_absolute() and path.name:
                if len(str(path).encode()) > 107:
                    raise InputError(
                        f"socket path {path} is longer than the 107 bytes a Unix socket allows"
                    )
                return path
            break
    raise InputError(f"listen address {target!r} must be unix:///absolute/path")


def parse_ranks(text: str) -> tuple[int, ...]:
    """`0-7`, `8,9,10` or `0-3,8-11` -> the ranks, in order."""
    ranks: list[int] = []
    for part in text.split(","):
        m = _RANGE.match(part)
        if m is None:
            raise InputError(f"ranks {text!r}: {part.strip()!r} is not a rank or a range like 0-7")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise InputError(f"ranks {text!r}: range {lo}-{hi} is empty")
        if hi >= MAX_SLOTS:  # checked before the range is spelled out
            raise InputError(
                f"ranks {text!r}: rank {hi} is out of range (a deployment has at most "
                f"{MAX_SLOTS} ranks: 0-{MAX_SLOTS - 1})"
            )
        ranks.extend(range(lo, hi + 1))
    if len(set(ranks)) != len(ranks):
        raise InputError(f"ranks {text!r} name a rank twice")
    return tuple(ranks)


def format_ranks(ranks: tuple[int, ...]) -> str:
    rs = sorted(ranks)
    if rs and rs[-1] - rs[0] == len(rs) - 1:
        return f"{rs[0]}-{rs[-1]}" if len(rs) > 1 else str(rs[0])
    return ",".join(map(str, rs))


def lws_ranks(env: Mapping[str, str], ranks_per_pod: int) -> tuple[int, ...]:
    """This pod's ranks in a LeaderWorkerSet group: pod LWS_WORKER_INDEX of LWS_GROUP_SIZE."""
    if ranks_per_pod < 1:
        raise InputError(f"--ranks-per-pod must be >= 1, got {ranks_per_pod}")
    try:
        size, index = int(env["LWS_GROUP_SIZE"]), int(env["LWS_WORKER_INDEX"])
    except KeyError as exc:
        raise InputError(
            f"{exc.args[0]} is not set: give --ranks, or run in a LeaderWorkerSet"
        ) from None
    except ValueError:
        raise InputError("LWS_GROUP_SIZE and LWS_WORKER_INDEX must be integers") from None
    if size < 1 or not 0 <= index < size:
        raise InputError(f"LWS_WORKER_INDEX={index} is not in a group of LWS_GROUP_SIZE={size}")
    if (index + 1) * ranks_per_pod > MAX_SLOTS:
        raise InputError(
            f"pod {index} of {ranks_per_pod} ranks ends past rank {MAX_SLOTS - 1} "
            f"(a deployment has at most {MAX_SLOTS} ranks)"
        )
    return tuple(range(index * ranks_per_pod, (index + 1) * ranks_per_pod))


def pod_identity(env: Mapping[str, str]) -> str:
    """`namespace/name` from the downward API; the host name outside Kubernetes."""
    name = env.get("POD_NAME") or socket.gethostname()
    namespace = env.get("POD_NAMESPACE", "")
    return f"{namespace}/{name}" if namespace else name
