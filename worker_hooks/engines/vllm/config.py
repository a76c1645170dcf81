"""The vLLM adapter's settings, read from the environment of vLLM's worker processes.

vLLM starts its workers itself; the plugin and the worker extension read the same
`REBALANCER_*` variables as the SGLang adapter, once per process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rebalancer.errors import InputError
from rebalancer.wire.link import Link
from worker_hooks.config import WindowConfig
from worker_hooks.engines.env import ENV_PREFIX, EngineEnv, check_link, check_windows
from worker_hooks.warm import DEFAULT_WARM_START_SECONDS, check_warm_start_seconds

# The deployment the adapter registers as when REBALANCER_DEPLOYMENT is unset.
DEFAULT_DEPLOYMENT = "vllm"


@dataclass(frozen=True)
class VLLMAdapterConfig:
    # The link (rebalancer.wire.link.LINK_ENV): REBALANCER_ADDRESS (unix:/path of the
    # sidecar, or host:port), REBALANCER_DEPLOYMENT (default "vllm"), the token read from
    # REBALANCER_TOKEN_FILE, REBALANCER_TLS_CA / _TLS_CERT / _TLS_KEY (TLS, mutual TLS),
    # REBALANCER_WORKER_ID (default: host and pid) and REBALANCER_POOL.
    link: Link
    # REBALANCER_WINDOW_STEPS: engine steps per counts window (windows.steps).
    windows: WindowConfig = field(default_factory=WindowConfig)
    # REBALANCER_COUNT_DUPLICATES: how many ranks count each routed token (vLLM's window
    # counts every token once per DP rank under the naive all-to-all, once per TP rank
    # inside an EP rank); the windows sent are divided by it. 1 for DeepEP-style dispatch.
    count_duplicates: int = 1
    # In a pool (link.pool), a fresh group is offered the pool's placement and answers
    # vLLM's first policy call with it, when the offer came within
    # REBALANCER_WARM_START_SECONDS of the adapter's start (0: never wait).
    warm_start_seconds: float = DEFAULT_WARM_START_SECONDS

    def __post_init__(self) -> None:
        check_link(self.link)
        check_windows(self.windows)
        if self.count_duplicates < 1:
            raise InputError(
                f"{ENV_PREFIX}COUNT_DUPLICATES must be >= 1, got {self.count_duplicates}"
            )
        check_warm_start_seconds(self.warm_start_seconds, f"{ENV_PREFIX}WARM_START_SECONDS")

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> VLLMAdapterConfig | None:
        """The settings in `env` (default os.environ); None when REBALANCER_ADDRESS is
        unset (vLLM's own EPLB then runs unchanged). InputError on a bad value."""
        e = EngineEnv(env)
        d = VLLMAdapterConfig  # its defaults
        link = e.link(DEFAULT_DEPLOYMENT)
        if link is None:
            return None
        return VLLMAdapterConfig(
            link,
            windows=e.windows(),
            count_duplicates=int(e.number("COUNT_DUPLICATES", int, d.count_duplicates)),
            warm_start_seconds=float(
                e.number("WARM_START_SECONDS", float, DEFAULT_WARM_START_SECONDS)
            ),
        )
