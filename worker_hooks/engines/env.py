"""The `REBALANCER_*` settings engine adapters read from their processes' environment.

Engines start their scheduler and worker processes themselves and have no flag for a
plugin, so the adapters are configured like the engines' own switches: environment
variables, read once per process. One reader for every adapter: the same names, the
same errors (InputError naming the variable), the same token file rule.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rebalancer.errors import InputError
from rebalancer.wire.channel import check_address
from rebalancer.wire.windows import MAX_WINDOW_STEPS
from worker_hooks.warm import DEFAULT_WARM_START_SECONDS

ENV_PREFIX = "REBALANCER_"
# The engines' TLS settings and the sidecar's names for the same files (either is read).
TLS_ALIASES = {"CA_FILE": "TLS_CA", "CERT_FILE": "TLS_CERT", "KEY_FILE": "TLS_KEY"}
# The largest value of an integer setting, where the wire bounds it: a window's steps
# travel as a uint32 (Window.num_steps), which the sidecar and the controller refuse beyond.
MAXIMUM = {"WINDOW_STEPS": MAX_WINDOW_STEPS}


class EngineEnv:
    """`REBALANCER_*` variables of `env` (default os.environ), blank meaning unset."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = os.environ if env is None else env

    def get(self, name: str) -> str | None:
        """REBALANCER_<name>, or None when unset or blank."""
        value = self.env.get(ENV_PREFIX + name, "").strip()
        return value or None

    def number(self, name: str, kind: type[int] | type[float], default: float) -> float:
        """REBALANCER_<name> as `kind`, or `default` when unset."""
        raw = self.get(name)
        if raw is None:
            return default
        try:
            value = kind(raw)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise InputError(f"{ENV_PREFIX}{name}={raw!r} is not {what}") from None
        maximum = MAXIMUM.get(name)
        if maximum is not None and value > maximum:
            raise InputError(f"{ENV_PREFIX}{name}={raw!r} is out of range (at most {maximum})")
        return value

    def link(self, default_deployment: str) -> dict[str, str | float | None] | None:
        """The settings every adapter's config takes alike (address, deployment, token,
        TLS files, worker id, replica pool and its warm-start wait); None when
        REBALANCER_ADDRESS is unset (adapter off)."""
        address = self.get("ADDRESS")
        if address is None:
            return None
        try:
            check_address(address)  # as the sidecar checks its --controller
        except InputError as exc:
            raise InputError(f"{ENV_PREFIX}ADDRESS: {exc}") from None
        return {
            "address": address,
            "deployment": self.get("DEPLOYMENT") or default_deployment,
            "token": self.token(),
            "ca_file": self.tls_file("CA_FILE"),
            "cert_file": self.tls_file("CERT_FILE"),
            "key_file": self.tls_file("KEY_FILE"),
            "worker_id": self.get("WORKER_ID") or "",
            "pool": self.get("POOL") or "",
            "warm_start_seconds": float(
                self.number("WARM_START_SECONDS", float, DEFAULT_WARM_START_SECONDS)
            ),
        }

    def tls_file(self, name: str) -> str | None:
        """REBALANCER_<name> (CA_FILE, CERT_FILE, KEY_FILE), or the sidecar's spelling of the
        same file (REBALANCER_TLS_CA, _TLS_CERT, _TLS_KEY): a name copied from the sidecar's
        settings must not silently mean plain text. Both set to different files: refused."""
        alias = TLS_ALIASES[name]
        ours, theirs = self.get(name), self.get(alias)
        if ours and theirs and ours != theirs:
            raise InputError(
                f"{ENV_PREFIX}{name}={ours!r} and {ENV_PREFIX}{alias}={theirs!r} name different "
                "files for one setting: set one of them"
            )
        return ours or theirs

    def token(self) -> str | None:
        """The bearer token read from REBALANCER_TOKEN_FILE (None: no token)."""
        path = self.get("TOKEN_FILE")
        if path is None:
            return None
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise InputError(f"{ENV_PREFIX}TOKEN_FILE {path}: {exc.strerror}") from None


def check_tls(ca_file: str | None, cert_file: str | None, key_file: str | None) -> None:
    """TLS settings that could never connect are refused at the adapter's start, in one
    line naming the variable (the agent would otherwise find out at its first connect)."""
    if (cert_file or key_file) and not ca_file:
        raise InputError(
            f"{ENV_PREFIX}CERT_FILE and {ENV_PREFIX}KEY_FILE (mutual TLS) need "
            f"{ENV_PREFIX}CA_FILE, the controller's CA"
        )
    if bool(cert_file) != bool(key_file):
        raise InputError(f"mutual TLS needs both {ENV_PREFIX}CERT_FILE and {ENV_PREFIX}KEY_FILE")
    for name, path in (("CA_FILE", ca_file), ("CERT_FILE", cert_file), ("KEY_FILE", key_file)):
        if path is not None and not Path(path).is_file():
            raise InputError(f"{ENV_PREFIX}{name} {path}: no such file")
