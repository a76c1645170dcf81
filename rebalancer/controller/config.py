"""Controller settings: the TOML file (deploy/controller.toml) and its checks.

Safe by default: a service is authenticated when it has its token (admin token,
[worker_tokens]) or when mutual TLS makes every client present a certificate. A
controller with an unauthenticated service listens on loopback only; a non-loopback
host is refused (`check_exposure`) unless `insecure` (`--insecure`, `server.insecure`)
says that is meant, and the server logs a WARNING at start naming what is open.
"""

from __future__ import annotations

import ipaddress
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rebalancer.controller.contingency import TAKE_BYTES_PER_SECOND
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.decision_runner import DEFAULT_DECISION_CPU_SHARE
from rebalancer.controller.replica_pools import DEFAULT_MAX_MOVING
from rebalancer.errors import InputError
from rebalancer.wire.channel import MAX_MESSAGE_BYTES
from rebalancer.wire.shards import MAX_SHARDS, owner_shard


@dataclass(frozen=True)
class ShardConfig:
    """This controller's place among the controller shards that split a fleet (the
    `[shard]` section, `--shard` and `--shards`; docs/shards.md). Each replica pool, and
    each deployment outside a pool, belongs to one shard by the rule of
    rebalancer.wire.shards, which the sidecars and the engines compute too; a Register
    for one another shard owns is refused (FAILED_PRECONDITION, naming that shard)."""

    index: int = 0
    """This controller's shard, 0 .. count - 1: in a StatefulSet, its pod's ordinal."""
    count: int = 1
    """How many controller shards split the fleet (the StatefulSet's replicas, the
    clients' REBALANCER_SHARDS). 1: this controller owns everything, nothing refused."""

    def owner(self, deployment: str, pool: str) -> int:
        """The shard that owns `deployment` in `pool` ("": none)."""
        return owner_shard(deployment, pool, self.count)

    def refusal(self, deployment: str, pool: str) -> str:
        """Why this shard refuses `deployment` in `pool` (one line), "" when it owns it."""
        owner = self.owner(deployment, pool)
        if owner == self.index:
            return ""
        what = f"pool {pool!r}" if pool else f"deployment {deployment!r}"
        return (
            f"{what} belongs to controller shard {owner} of {self.count}, this is shard "
            f"{self.index}: connect to shard {owner} (REBALANCER_SHARDS={self.count} and an "
            "address with {shard} pick it)"
        )


@dataclass
class ControllerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    db_path: str = "rebalancer.sqlite"
    admin_token: str | None = None  # required on every admin call when set
    # deployment -> bearer token its ranks must present; empty: workers unauthenticated.
    worker_tokens: dict[str, str] = field(default_factory=dict)
    tls_cert: str | None = None  # server certificate chain (PEM): TLS on
    tls_key: str | None = None
    tls_client_ca: str | None = None  # CA of client certificates: mutual TLS required
    metrics_port: int | None = None  # Prometheus exposition on its own port (0: any free)
    # Also export per-layer and per-rank series (rebalancer_layer_imbalance,
    # rebalancer_rank_load_share): L + L x G per deployment, 4,453 for DeepSeek-V3 at EP72.
    per_layer_metrics: bool = False
    max_message_bytes: int = MAX_MESSAGE_BYTES
    tick_seconds: float = 0.2  # plan timeouts are checked this often
    persist_seconds: float = 5.0  # ingest cursor saved at most this often per deployment
    # Cursor bytes the periodic saves hand the store per second, all deployments together:
    # past it a deployment saves less often than persist_seconds (fold.py persist_interval),
    # so a large fleet's cursors neither fill the disk's bandwidth nor hold the store's write
    # lock the plan rows wait for.
    cursor_mb_per_second: float = 8.0
    # Contingency sets the members of replica pools take from their pool's, in MB a second
    # all together (contingency.py TAKE_BYTES_PER_SECOND): each take writes the set to the
    # store and sends it to the member's ranks, 2.1 MB each at DeepSeek-V3 EP32. Higher
    # covers a large fleet sooner, at more of the event loop's and the store's time.
    contingency_take_mb_per_second: float = TAKE_BYTES_PER_SECOND / 1e6
    # Cumulative window acks at most this often per stream (0: one ack per window). An ack
    # only lets the sender drop windows it would resend after a reconnect (folding never
    # waits for it); a stopping rank or sidecar ends its stream and gets the last ack at
    # once, so the interval does not slow stops. Writing acks was a quarter of the event
    # loop at 2,048 streams of one window a second (issue 32): 5 s writes a fifth of them.
    ack_interval_seconds: float = 5.0
    # The decision worker's share of a core in the long run (0 < share <= 1; 1: no
    # limit). Past it a due deployment decides at one of its next windows: a fleet of
    # thousands due every window would otherwise keep the worker busy beside ingest.
    decision_cpu_share: float = DEFAULT_DECISION_CPU_SHARE
    # Cores the controller process and its decision worker may use together (0: no such
    # bound). The worker's share is then what the controller's own CPU leaves of them
    # (between 0.05 and decision_cpu_share): ingest comes first, and a pod given one core
    # (its request) stays within it while a large fleet's first plans and contingency sets
    # are computed, at the cost of computing them later.
    cpu_cores: float = 0.0
    drain_seconds: float = 1.0  # NOT_SERVING before the port closes, on shutdown
    grace_seconds: float = 5.0  # calls in flight may finish this long after
    # Listen on a non-loopback host although a service is unauthenticated (no token and
    # no mutual TLS); without it such a config is refused (check_exposure).
    insecure: bool = False
    # Replica pools (docs/operations.md "Pools"): members of one pool with a plan toward
    # the pool placement in flight at once (the rolling cap).
    pool_max_moving: int = DEFAULT_MAX_MOVING
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # Controller shards (docs/shards.md): which shard this controller is, of how many.
    shard: ShardConfig = field(default_factory=ShardConfig)


_SECTIONS = {"server", "tls", "worker_tokens", "policy", "shard"}
_SERVER_KEYS = {
    "host",
    "port",
    "db_path",
    "admin_token",
    "admin_token_file",
    "metrics_port",
    "per_layer_metrics",
    "max_message_bytes",
    "tick_seconds",
    "grace_seconds",
    "drain_seconds",
    "persist_seconds",
    "cursor_mb_per_second",
    "contingency_take_mb_per_second",
    "ack_interval_seconds",
    "decision_cpu_share",
    "cpu_cores",
    "insecure",
    "pool_max_moving",
}
_TLS_KEYS = {"cert": "tls_cert", "key": "tls_key", "client_ca": "tls_client_ca"}
_SHARD_KEYS = {"index", "count"}
_SECONDS = (
    "tick_seconds",
    "grace_seconds",
    "drain_seconds",
    "persist_seconds",
    "ack_interval_seconds",
)


def read_text_file(path: Path, what: str) -> str:
    """The UTF-8 text of `path`; InputError naming `what` and the reason otherwise."""
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise InputError(f"{what} {path}: is a folder, not a file") from None
    except FileNotFoundError:
        raise InputError(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise InputError(f"{what} {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {path}: not UTF-8 text (byte {exc.start})") from None


def _table(doc: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise InputError(f"{path}: {name} must be a table ([{name}]), got {type(value).__name__}")
    return value


def load_config(path: str | Path) -> ControllerConfig:
    """Read a TOML config file (see deploy/controller.toml); InputError names what is wrong."""
    path = Path(path)
    text = read_text_file(path, "config")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not valid TOML ({exc})") from None
    except RecursionError:
        raise InputError(f"{path}: not valid TOML (nested too deeply)") from None
    unknown = set(doc) - _SECTIONS
    if unknown:
        raise InputError(
            f"{path}: unknown section(s) {sorted(unknown)}; expected {sorted(_SECTIONS)}"
        )
    values: dict[str, Any] = {}
    server = _table(doc, "server", path)
    bad = set(server) - _SERVER_KEYS
    if bad:
        raise InputError(f"{path}: unknown [server] key(s) {sorted(bad)}")
    if "admin_token_file" in server:
        server = dict(server)
        token_file = server.pop("admin_token_file")
        if not isinstance(token_file, str) or not token_file:
            raise InputError(f"{path}: admin_token_file must be a file name, got {token_file!r}")
        values["admin_token"] = read_admin_token(Path(token_file), f"{path}: admin_token_file")
    values.update(server)
    tls = _table(doc, "tls", path)
    bad = set(tls) - set(_TLS_KEYS)
    if bad:
        raise InputError(f"{path}: unknown [tls] key(s) {sorted(bad)}")
    values.update({_TLS_KEYS[k]: v for k, v in tls.items()})
    tokens = _table(doc, "worker_tokens", path)
    if not all(isinstance(v, str) and v for v in tokens.values()):
        raise InputError(f"{path}: [worker_tokens] maps deployment names to non-empty strings")
    values["worker_tokens"] = dict(tokens)
    values["policy"] = PolicyConfig.from_dict(_table(doc, "policy", path))
    shard = _table(doc, "shard", path)
    bad = set(shard) - _SHARD_KEYS
    if bad:
        raise InputError(f"{path}: unknown [shard] key(s) {sorted(bad)}; expected index, count")
    values["shard"] = ShardConfig(**shard)
    config = ControllerConfig(**values)
    try:
        validate_config(config)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
    return config


def read_admin_token(path: Path, what: str) -> str:
    """The token in `path` (surrounding whitespace dropped); an empty file is refused."""
    token = read_text_file(path, what).strip()
    if not token:
        raise InputError(f"{what} {path}: is empty")
    if not token.isprintable():
        raise InputError(f"{what} {path}: a token is one line of printable characters")
    return token


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_config(config: ControllerConfig) -> None:
    """InputError naming the first setting of the wrong type or range (files are checked
    to exist here; that they hold usable PEM is checked as the server starts)."""
    for name in ("port", "metrics_port"):
        value = getattr(config, name)
        if value is None and name == "metrics_port":
            continue
        if not _is_int(value) or not 0 <= value < 65536:
            raise InputError(f"{name} must be a port number (0-65535), got {value!r}")
    for name in ("host", "db_path"):
        value = getattr(config, name)
        if not isinstance(value, str) or not value.strip():
            raise InputError(f"{name} must be a non-empty string, got {value!r}")
    if config.admin_token is not None and (
        not isinstance(config.admin_token, str) or not config.admin_token
    ):
        raise InputError("admin_token must be a non-empty string (or unset)")
    if not _is_int(config.max_message_bytes) or config.max_message_bytes <= 0:
        raise InputError(
            f"max_message_bytes must be a positive integer, got {config.max_message_bytes!r}"
        )
    if not _is_int(config.pool_max_moving) or config.pool_max_moving < 1:
        raise InputError(f"pool_max_moving must be an integer >= 1, got {config.pool_max_moving!r}")
    for name in _SECONDS:
        value = getattr(config, name)
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            raise InputError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    if config.tick_seconds <= 0:
        raise InputError(f"tick_seconds must be > 0, got {config.tick_seconds!r}")
    for name in ("cursor_mb_per_second", "contingency_take_mb_per_second"):
        rate = getattr(config, name)
        if not _is_number(rate) or not math.isfinite(rate) or rate <= 0:
            raise InputError(f"{name} must be a finite number > 0, got {rate!r}")
    share = config.decision_cpu_share
    if not _is_number(share) or not math.isfinite(share) or not 0 < share <= 1:
        raise InputError(f"decision_cpu_share must be a number in (0, 1], got {share!r}")
    cores = config.cpu_cores
    if not _is_number(cores) or not math.isfinite(cores) or cores < 0:
        raise InputError(f"cpu_cores must be a finite number >= 0 (0: no bound), got {cores!r}")
    for name in ("insecure", "per_layer_metrics"):
        if not isinstance(getattr(config, name), bool):
            raise InputError(f"{name} must be true or false, got {getattr(config, name)!r}")
    if not isinstance(config.worker_tokens, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in config.worker_tokens.items()
    ):
        raise InputError("worker_tokens maps deployment names to non-empty strings")
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise InputError(f"{name} must be a file name, got {value!r}")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise InputError("TLS needs both a certificate (tls.cert) and its key (tls.key)")
    if config.tls_client_ca and not config.tls_cert:
        raise InputError("mutual TLS (tls.client_ca) needs server TLS (tls.cert, tls.key)")
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        value = getattr(config, name)
        if value and Path(value).is_dir():
            raise InputError(f"{name} {value}: is a folder, not a file")
        if value and not Path(value).is_file():
            raise InputError(f"{name} {value}: no such file")
    check_shard(config.shard)
    config.policy.validate()


def check_shard(shard: ShardConfig) -> None:
    """InputError naming the setting: a count from 1 to MAX_SHARDS, an index below it."""
    if not isinstance(shard, ShardConfig):
        raise InputError(f"shard must be a ShardConfig, got {type(shard).__name__}")
    if not _is_int(shard.count) or not 1 <= shard.count <= MAX_SHARDS:
        raise InputError(
            f"shard count must be a whole number from 1 to {MAX_SHARDS}, got {shard.count!r}"
        )
    if not _is_int(shard.index) or not 0 <= shard.index < shard.count:
        raise InputError(
            f"shard index must be a whole number from 0 to {shard.count - 1} (the shard "
            f"count is {shard.count}), got {shard.index!r}"
        )


# ------------------------------------------------------------------ exposure


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only ("localhost", 127.0.0.0/8, ::1)."""
    name = host.strip().strip("[]").lower()
    if name in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def mutual_tls(config: ControllerConfig) -> bool:
    return bool(config.tls_cert and config.tls_key and config.tls_client_ca)


def unauthenticated_services(config: ControllerConfig) -> list[str]:
    """ "admin" / "worker" for each service anyone who reaches the port may call: no token
    of its own and no mutual TLS."""
    if mutual_tls(config):
        return []
    out = []
    if not config.admin_token:
        out.append("admin")
    if not config.worker_tokens:
        out.append("worker")
    return out


def check_exposure(config: ControllerConfig) -> None:
    """Refuse (InputError) a non-loopback host while a service is unauthenticated, unless
    `config.insecure`."""
    open_services = unauthenticated_services(config)
    if not open_services or is_loopback(config.host) or config.insecure:
        return
    what = " and ".join(f"the {s} service" for s in open_services)
    raise InputError(
        f"refusing to listen on {config.host} with {what} unauthenticated: set "
        + " and ".join(
            {"admin": "an admin token (--admin-token-file)", "worker": "[worker_tokens]"}[s]
            for s in open_services
        )
        + ", or mutual TLS, or listen on 127.0.0.1; --insecure (server.insecure = true) accepts it"
    )


def exposure_warnings(config: ControllerConfig) -> list[str]:
    """One line per thing left open, for the WARNING log at start (empty: nothing)."""
    local = is_loopback(config.host)
    who = (
        "any process on this machine (loopback only)"
        if local
        else f"anyone who reaches the port ({config.host}, not loopback)"
    )
    where = "loopback only" if local else f"{config.host}, not loopback"
    lines = []
    for service in unauthenticated_services(config):
        why = {"admin": "no admin token", "worker": "no [worker_tokens]"}[service]
        lines.append(f"{service} service unauthenticated ({why}, no mutual TLS): {who} may call it")
    if mutual_tls(config) and not config.admin_token:
        lines.append(
            "admin service has no admin token: any client certificate of the client CA may call it"
        )
    if not config.tls_cert:
        lines.append(f"TLS off: calls and tokens travel in plain text ({where})")
    return lines
