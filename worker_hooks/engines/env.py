"""The `REBALANCER_*` settings engine adapters read from their processes' environment.

Engines start their scheduler and worker processes themselves and have no flag for a
plugin, so the adapters are configured like the engines' own switches: environment
variables, read once per process. One reader for every adapter: the same names, the
same errors (InputError naming the variable), the same token file rule. The link's names
(address, token file, TLS files, deployment, worker id, pool) are the table the sidecar
reads too: rebalancer.wire.link.LINK_ENV.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rebalancer.errors import InputError
from rebalancer.wire.channel import check_address
from rebalancer.wire.link import ENV_TLS_NAMES, LINK_ENV, Link, link_from_env
from rebalancer.wire.windows import MAX_WINDOW_STEPS
from worker_hooks.config import WindowConfig

ENV_PREFIX = "REBALANCER_"
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

    def windows(self) -> WindowConfig:
        """The counts window: REBALANCER_WINDOW_STEPS engine passes per window (default
        WindowConfig's), refused below 1 in one line naming the variable."""
        steps = int(self.number("WINDOW_STEPS", int, WindowConfig.steps))
        if steps < 1:
            raise InputError(f"{ENV_PREFIX}WINDOW_STEPS must be >= 1, got {steps}")
        return WindowConfig(steps=steps)

    def link(self, default_deployment: str) -> Link | None:
        """The adapter's link (rebalancer.wire.link.LINK_ENV: address, deployment, token
        file, TLS files, worker id, replica pool), the token read from its file now; None
        when REBALANCER_ADDRESS is unset (adapter off)."""
        link = link_from_env(self.env, deployment=default_deployment)
        if link is None:
            return None
        try:
            check_address(link.address)  # as the sidecar checks its --controller
        except InputError as exc:
            raise InputError(f"{LINK_ENV['address']}: {exc}") from None
        return link.with_token(LINK_ENV["token_file"])


def check_windows(windows: object) -> None:
    """An adapter config's `windows` is a WindowConfig (which checked its own steps)."""
    if not isinstance(windows, WindowConfig):
        raise TypeError(f"windows must be a WindowConfig, got {type(windows).__name__}")


def check_link(link: Link) -> None:
    """A link that could never connect is refused at the adapter's start, in one line
    naming the variable (the agent would otherwise find out at its first connect): the
    address is needed, the TLS files must fit together (Link.check) and exist."""
    if not link.address:
        raise InputError(f"{LINK_ENV['address']} is empty")
    link.check(ENV_TLS_NAMES)
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(link, name)
        if path is not None and not Path(path).is_file():
            raise InputError(f"{LINK_ENV[name]} {path}: no such file")
