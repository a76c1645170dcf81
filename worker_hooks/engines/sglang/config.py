"""The SGLang adapter's settings, read from the environment of SGLang's processes.

SGLang starts its scheduler and worker processes itself and has no flag for a plugin,
so the adapter is configured like SGLang's own `SGLANG_*` switches: environment
variables, read once per process when the plugin registers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rebalancer.errors import InputError
from worker_hooks.engines.env import ENV_PREFIX, EngineEnv, check_tls
from worker_hooks.warm import DEFAULT_WARM_START_SECONDS, check_warm_start_seconds


@dataclass(frozen=True)
class SGLangAdapterConfig:
    address: str                      # REBALANCER_ADDRESS: unix:/path of the sidecar, or host:port
    deployment: str = "sglang"        # REBALANCER_DEPLOYMENT
    token: str | None = None          # read from REBALANCER_TOKEN_FILE
    ca_file: str | None = None        # REBALANCER_CA_FILE: TLS to the controller
    cert_file: str | None = None      # REBALANCER_CERT_FILE / REBALANCER_KEY_FILE: mutual TLS
    key_file: str | None = None
    window_steps: int = 16            # REBALANCER_WINDOW_STEPS: forward passes per counts window
    agree_every: int = 4              # REBALANCER_AGREE_EVERY: passes between commit agreements
    # REBALANCER_AGREE_TIMEOUT_SECONDS: the adapter's gloo group gives up on a lost peer
    # after this long (agreements and the per-layer "done" of an update).
    agree_timeout_seconds: float = 60.0
    worker_id: str = ""               # REBALANCER_WORKER_ID (default: the host), the pid appended
    # REBALANCER_POOL: the deployment's replica pool ("" = none): its windows count in the
    # pool's estimate and the pool rolls its placement to it. A fresh group is offered the
    # pool's placement and starts on it (warm_start.py), when the offer came within
    # REBALANCER_WARM_START_SECONDS of SGLang's expert-location step (0: never wait).
    pool: str = ""
    warm_start_seconds: float = DEFAULT_WARM_START_SECONDS

    def __post_init__(self) -> None:
        if not self.address:
            raise InputError(f"{ENV_PREFIX}ADDRESS is empty")
        for name in ("window_steps", "agree_every"):
            if getattr(self, name) < 1:
                raise InputError(f"{ENV_PREFIX}{name.upper()} must be >= 1, got {getattr(self, name)}")
        if not self.agree_timeout_seconds > 0:
            raise InputError(
                f"{ENV_PREFIX}AGREE_TIMEOUT_SECONDS must be > 0, got {self.agree_timeout_seconds}"
            )
        check_tls(self.ca_file, self.cert_file, self.key_file)
        try:
            check_warm_start_seconds(self.warm_start_seconds, f"{ENV_PREFIX}WARM_START_SECONDS")
        except ValueError as exc:
            raise InputError(str(exc)) from None

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> SGLangAdapterConfig | None:
        """The settings in `env` (default os.environ); None when REBALANCER_ADDRESS is
        unset (the plugin then leaves SGLang's own EPLB alone). InputError on a bad value."""
        e = EngineEnv(env)
        d = SGLangAdapterConfig  # its defaults
        common = e.link(d.deployment)
        if common is None:
            return None
        return SGLangAdapterConfig(
            **common,  # type: ignore[arg-type]
            window_steps=int(e.number("WINDOW_STEPS", int, d.window_steps)),
            agree_every=int(e.number("AGREE_EVERY", int, d.agree_every)),
            agree_timeout_seconds=float(e.number("AGREE_TIMEOUT_SECONDS", float, d.agree_timeout_seconds)),
            pool=e.get("POOL") or "",
            warm_start_seconds=float(e.number("WARM_START_SECONDS", float, d.warm_start_seconds)),
        )
