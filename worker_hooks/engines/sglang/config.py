"""The SGLang adapter's settings, read from the environment of SGLang's processes.

SGLang starts its scheduler and worker processes itself and has no flag for a plugin,
so the adapter is configured like SGLang's own `SGLANG_*` switches: environment
variables, read once per process when the plugin registers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from rebalancer.errors import InputError
from worker_hooks.engines.env import ENV_PREFIX, EngineEnv, check_tls
from worker_hooks.warm import DEFAULT_WARM_START_SECONDS, check_warm_start_seconds

# How a committed plan reaches the weights (worker_hooks/engines/sglang/__init__.py):
# "staged" receives them beside serving and the commit only copies locally and swaps the
# maps; "sglang" runs SGLang's own ExpertLocationUpdater inside the forward loop.
Updater = Literal["staged", "sglang"]
UPDATERS: tuple[Updater, ...] = get_args(Updater)

# The default staging budget per rank. On an H200 (141 GB) SGLang gives the KV cache what
# the weights and activations leave (mem_fraction_static ~0.8-0.9 of the card), so staging
# comes out of the 10-20 GB of headroom beside it, shared with activations and CUDA
# graphs: 4 GiB is ~3 % of the card, well inside that. It holds ~45 bf16 DeepSeek-V3
# experts (3 x 7168 x 2048 x 2 B = 88 MB each) or ~90 in FP8: a from-scratch refit at
# EP32 gains ~9 experts per layer and rank, so ~5 layers (bf16) or ~10 (FP8) per group,
# and the 58 MoE layers commit in 6-12 groups.
DEFAULT_STAGING_BUDGET_BYTES = 4 << 30


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
    updater: Updater = "staged"       # REBALANCER_UPDATER: "staged" or "sglang" (SGLang's own, fallback)
    # REBALANCER_STAGING_BUDGET_BYTES: staged mode receives at most this many bytes of
    # experts per rank before a swap; a larger plan commits in layer groups.
    staging_budget_bytes: int = DEFAULT_STAGING_BUDGET_BYTES

    def __post_init__(self) -> None:
        if not self.address:
            raise InputError(f"{ENV_PREFIX}ADDRESS is empty")
        for name in ("window_steps", "agree_every"):
            if getattr(self, name) < 1:
                raise InputError(f"{ENV_PREFIX}{name.upper()} must be >= 1, got {getattr(self, name)}")
        if self.updater not in UPDATERS:
            raise InputError(f"{ENV_PREFIX}UPDATER must be one of {', '.join(UPDATERS)}, got {self.updater!r}")
        if self.staging_budget_bytes < 1:
            raise InputError(f"{ENV_PREFIX}STAGING_BUDGET_BYTES must be >= 1, got {self.staging_budget_bytes}")
        if not self.agree_timeout_seconds > 0:
            raise InputError(
                f"{ENV_PREFIX}AGREE_TIMEOUT_SECONDS must be > 0, got {self.agree_timeout_seconds}"
            )
        check_tls(self.ca_file, self.cert_file, self.key_file)
        check_warm_start_seconds(self.warm_start_seconds, f"{ENV_PREFIX}WARM_START_SECONDS")

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
            updater=(e.get("UPDATER") or d.updater),  # type: ignore[arg-type]  # checked above
            staging_budget_bytes=int(e.number("STAGING_BUDGET_BYTES", int, d.staging_budget_bytes)),
        )
