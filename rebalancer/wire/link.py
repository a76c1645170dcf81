"""The link to the controller: how a process reaches it, and who it is there.

`Link` is the one spelling of "how to reach the controller": its address, the bearer
token (or the file holding it), the TLS files, who this process is there (deployment,
worker id, replica pool) and how many controller shards split the fleet. Every config
that talks to the controller (the hook's, the agent's, the engine adapters', the
sidecar's, the admin CLI's) holds one; `LINK_ENV` is the one table of their
`REBALANCER_*` environment names, read by `link_settings` for the engines and the
sidecar alike. `Link.check` is the one rule the TLS files must fit; `Link.routed` picks
the controller shard that owns the deployment (rebalancer.wire.shards).

Standard library only at import (the CLI builds its flags' help from `LINK_ENV`
without loading gRPC); `credentials` loads gRPC when a channel is opened.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rebalancer.errors import InputError
from rebalancer.wire.shards import (
    SHARD_FIELD,
    check_shards,
    owner_key,
    parse_shards,
    shard_address,
    shard_of,
)

if TYPE_CHECKING:
    import grpc


@dataclass(frozen=True)
class TlsFlags:
    """How a command (or the environment) names the link's TLS files, for its messages."""

    ca: str = "--ca"
    cert: str = "--cert"
    key: str = "--key"


@dataclass(frozen=True)
class Link:
    """How a process reaches the controller and who it is there. Built without checks;
    `check` says whether the TLS files fit together, `credentials` reads them."""

    address: str
    """The controller's gRPC target (`host:port`, `dns:...`), or the pod's sidecar
    (`unix:///run/rebalancer/agent.sock`); rebalancer.wire.channel.check_address says
    what is taken."""
    ca_file: str | None = None
    """The controller's CA certificate (PEM): TLS on when set."""
    cert_file: str | None = None
    """This process's client certificate (PEM), for mutual TLS; needs `key_file` and
    `ca_file`."""
    key_file: str | None = None
    """The private key of `cert_file` (PEM)."""
    token: str | None = None
    """The deployment's bearer token (the controller's `[worker_tokens]`), sent as
    `authorization` metadata; None: none sent (or `token_file`'s, once read)."""
    token_file: str | None = None
    """A file holding the token (a mounted Secret). The sidecar reads it at every
    connection attempt; the engine adapters and the agent once, at start (`with_token`)."""
    deployment: str = ""
    """The deployment the process serves (one model on one EP group); the sidecar's:
    "" takes the one its ranks register with."""
    worker_id: str = ""
    """A name for this process in the controller's status and logs ("" = a default)."""
    pool: str = ""
    """The deployment's replica pool (RegisterRequest.pool; "" = none)."""
    shards: int = 1
    """How many controller shards split the fleet (docs/shards.md): with more than one,
    `address` holds `{shard}`, and each connection goes to the shard that owns the
    deployment's pool, or the deployment outside a pool (`routed`, the rule of
    rebalancer.wire.shards). 1: one controller, at `address`."""

    def check(self, names: TlsFlags = TlsFlags()) -> None:
        """The TLS files fit together (none is read): InputError, one line, naming them as
        `names` spells them (flags by default; ENV_TLS_NAMES for the environment)."""
        if not self.ca_file and (self.cert_file or self.key_file):
            raise InputError(
                f"a client certificate ({names.cert} and {names.key}: mutual TLS) needs "
                f"{names.ca} as well, the controller's CA (TLS)"
            )
        if bool(self.cert_file) != bool(self.key_file):
            raise InputError(
                f"mutual TLS needs both a client certificate and its key ({names.cert} and "
                f"{names.key})"
            )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The channel's TLS credentials, files read now (None: plain text); InputError,
        one line, for files that are missing, unreadable or not a key pair."""
        self.check()
        if not self.ca_file:
            return None
        import grpc

        from rebalancer.wire.channel import check_key_pair, read_file

        root, key, chain = (
            read_file(self.ca_file),
            read_file(self.key_file) if self.key_file else None,
            read_file(self.cert_file) if self.cert_file else None,
        )
        if self.cert_file and self.key_file:
            # gRPC would only fail the handshake, which reads as an unreachable controller.
            check_key_pair(self.cert_file, self.key_file, "client certificate", "client key")
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=chain
        )

    def routed(self, deployment: str | None = None, pool: str | None = None) -> Link:
        """This link to the one controller that owns its deployment: `{shard}` in the
        address replaced by the owning shard's index (rebalancer.wire.shards: the pool's
        name decides for a member of a replica pool, else the deployment's), `shards` 1.
        The link itself when its address has no `{shard}` (one server: the controller, a
        pod's sidecar, a merging sidecar). `deployment` and `pool` stand in for the link's
        own when given (a sidecar learns them from its ranks). InputError, one line, when
        shards are set but nothing names an owner."""
        if SHARD_FIELD not in self.address:
            return self
        check_shards(self.address, self.shards)
        key = owner_key(
            self.deployment if deployment is None else deployment,
            self.pool if pool is None else pool,
        )
        if self.shards > 1 and not key:
            raise InputError(
                f"a link to {self.shards} controller shards needs the deployment (or its "
                "replica pool) to pick the shard that owns it"
            )
        return self.shard(shard_of(key, self.shards))

    def shard(self, index: int) -> Link:
        """This link to shard `index` (0 .. shards - 1), whoever owns what: the admin
        CLI's fan-out."""
        return replace(self, address=shard_address(self.address, index), shards=1)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata: the bearer token, when there is one."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def with_token(self, what: str = "token file") -> Link:
        """This link with `token` read from `token_file` now (stripped), when only the file
        is given; InputError, one line naming the file as `what`, if it cannot be read."""
        if self.token is not None or not self.token_file:
            return self
        try:
            token = Path(self.token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise InputError(f"{what} {self.token_file}: {reason}") from None
        return replace(self, token=token)


# The link's environment names, by field: the one table the engines and the sidecar read.
# `token` has none: a secret is given as a file (REBALANCER_TOKEN_FILE), never in the
# environment itself.
LINK_ENV: dict[str, str] = {
    "address": "REBALANCER_ADDRESS",
    "ca_file": "REBALANCER_TLS_CA",
    "cert_file": "REBALANCER_TLS_CERT",
    "key_file": "REBALANCER_TLS_KEY",
    "token_file": "REBALANCER_TOKEN_FILE",
    "deployment": "REBALANCER_DEPLOYMENT",
    "worker_id": "REBALANCER_WORKER_ID",
    "pool": "REBALANCER_POOL",
    "shards": "REBALANCER_SHARDS",
}
# Older names still read, with a warning naming the new one: the sidecar's address and
# the engines' TLS files, from before the two shared one table.
LINK_ENV_RENAMED: dict[str, str] = {
    "REBALANCER_CONTROLLER": "address",
    "REBALANCER_CA_FILE": "ca_file",
    "REBALANCER_CERT_FILE": "cert_file",
    "REBALANCER_KEY_FILE": "key_file",
}
# How the environment spells the TLS files, for Link.check on the engines' side.
ENV_TLS_NAMES = TlsFlags(LINK_ENV["ca_file"], LINK_ENV["cert_file"], LINK_ENV["key_file"])


def link_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The Link fields `env` sets, by field name (LINK_ENV; a blank value is unset). A
    renamed variable (LINK_ENV_RENAMED) is still read, with a FutureWarning naming the new
    one; both set to different values: InputError, one line."""
    renamed = {field_name: old for old, field_name in LINK_ENV_RENAMED.items()}
    settings: dict[str, str] = {}
    for field_name, name in LINK_ENV.items():
        value = env.get(name, "").strip()
        old = renamed.get(field_name)
        old_value = env.get(old, "").strip() if old else ""
        if old and old_value:
            if value and value != old_value:
                raise InputError(
                    f"{old}={old_value!r} and {name}={value!r} set one setting twice, "
                    f"differently ({old} is its old name): set {name} only"
                )
            warnings.warn(
                f"{old} is deprecated: it is read as {name}; set {name} instead",
                FutureWarning,
                stacklevel=2,
            )
            value = value or old_value
        if value:
            settings[field_name] = value
    return settings


def link_from_settings(settings: Mapping[str, str]) -> Link:
    """The Link of `settings` (field name -> text, as link_settings and the sidecar's flags
    give them): `shards` read as a whole number, and more than one only with an address
    that names every shard (rebalancer.wire.shards.check_shards): InputError, one line,
    naming the variables otherwise."""
    fields: dict[str, Any] = dict(settings)
    if "shards" in fields:
        fields["shards"] = parse_shards(fields["shards"], LINK_ENV["shards"])
        check_shards(fields.get("address", ""), fields["shards"], LINK_ENV["address"])
    return Link(**fields)


def link_from_env(env: Mapping[str, str], **defaults: str) -> Link | None:
    """The Link `env` describes (link_settings), `defaults` for the fields it leaves
    unset; None when it names no address."""
    settings = {**defaults, **link_settings(env)}
    if not settings.get("address"):
        return None
    return link_from_settings(settings)
