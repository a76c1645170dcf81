"""Controller settings: the TOML file (deploy/controller.toml) and its checks."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from rebalancer.controller.decide import PolicyConfig
from rebalancer.errors import InputError
from rebalancer.wire.channel import MAX_MESSAGE_BYTES


@dataclass
class ControllerConfig:
    host: str = "127.0.0.1"
    port: int = 50051                # 0 picks a free port
    db_path: str = "rebalancer.sqlite"
    admin_token: str | None = None   # required on every admin call when set
    # deployment -> bearer token its ranks must present; empty: workers unauthenticated.
    worker_tokens: dict[str, str] = field(default_factory=dict)
    tls_cert: str | None = None      # server certificate chain (PEM): TLS on
    tls_key: str | None = None
    tls_client_ca: str | None = None  # CA of client certificates: mutual TLS required
    metrics_port: int | None = None  # Prometheus exposition on its own port (0: any free)
    max_message_bytes: int = MAX_MESSAGE_BYTES
    tick_seconds: float = 0.2        # plan timeouts are checked this often
    persist_seconds: float = 5.0     # ingest cursor saved at most this often per deployment
    # Cumulative window acks at most this often per stream (0: one ack per window).
    ack_interval_seconds: float = 1.0
    drain_seconds: float = 1.0       # NOT_SERVING before the port closes, on shutdown
    grace_seconds: float = 5.0       # calls in flight may finish this long after
    policy: PolicyConfig = field(default_factory=PolicyConfig)


_SECTIONS = {"server", "tls", "worker_tokens", "policy"}
_SERVER_KEYS = {"host", "port", "db_path", "admin_token", "admin_token_file", "metrics_port",
                "max_message_bytes", "tick_seconds", "grace_seconds", "drain_seconds", "persist_seconds",
                "ack_interval_seconds"}
_TLS_KEYS = {"cert": "tls_cert", "key": "tls_key", "client_ca": "tls_client_ca"}


def load_config(path: str | Path) -> ControllerConfig:
    """Read a TOML config file (see deploy/controller.toml); InputError names what is wrong."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not valid TOML ({exc})") from None
    unknown = set(doc) - _SECTIONS
    if unknown:
        raise InputError(f"{path}: unknown section(s) {sorted(unknown)}; expected {sorted(_SECTIONS)}")
    values: dict[str, Any] = {}
    server = doc.get("server", {})
    bad = set(server) - _SERVER_KEYS
    if bad:
        raise InputError(f"{path}: unknown [server] key(s) {sorted(bad)}")
    if "admin_token_file" in server:
        server = dict(server)
        token_path = Path(server.pop("admin_token_file"))
        try:
            values["admin_token"] = token_path.read_text().strip()
        except OSError as exc:
            raise InputError(f"{path}: admin_token_file {token_path}: {exc.strerror}") from None
    values.update(server)
    tls = doc.get("tls", {})
    bad = set(tls) - set(_TLS_KEYS)
    if bad:
        raise InputError(f"{path}: unknown [tls] key(s) {sorted(bad)}")
    values.update({_TLS_KEYS[k]: v for k, v in tls.items()})
    tokens = doc.get("worker_tokens", {})
    if not all(isinstance(v, str) and v for v in tokens.values()):
        raise InputError(f"{path}: [worker_tokens] maps deployment names to non-empty strings")
    values["worker_tokens"] = dict(tokens)
    values["policy"] = PolicyConfig.from_dict(doc.get("policy", {}))
    config = ControllerConfig(**values)
    validate_config(config)
    return config


def validate_config(config: ControllerConfig) -> None:
    for f in fields(ControllerConfig):
        if f.name in ("port", "metrics_port"):
            value = getattr(config, f.name)
            if value is not None and (not isinstance(value, int) or not 0 <= value < 65536):
                raise InputError(f"{f.name} must be a port number, got {value!r}")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise InputError("TLS needs both a certificate (tls.cert) and its key (tls.key)")
    if config.tls_client_ca and not config.tls_cert:
        raise InputError("mutual TLS (tls.client_ca) needs server TLS (tls.cert, tls.key)")
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        value = getattr(config, name)
        if value and not Path(value).is_file():
            raise InputError(f"{name} {value}: no such file")
    config.policy.validate()
