"""The vLLM adapter's settings, read from the environment of vLLM's worker processes.

vLLM starts its workers itself; the plugin and the worker extension read the same
`REBALANCER_*` variables as the SGLang adapter, once per process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rebalancer.errors import InputError

ENV_PREFIX = "REBALANCER_"


@dataclass(frozen=True)
class VLLMAdapterConfig:
    address: str                      # REBALANCER_ADDRESS: unix:/path of the sidecar, or host:port
    deployment: str = "vllm"          # REBALANCER_DEPLOYMENT
    token: str | None = None          # read from REBALANCER_TOKEN_FILE
    ca_file: str | None = None        # REBALANCER_CA_FILE: TLS to the controller
    cert_file: str | None = None      # REBALANCER_CERT_FILE / REBALANCER_KEY_FILE: mutual TLS
    key_file: str | None = None
    window_steps: int = 16            # REBALANCER_WINDOW_STEPS: engine steps per counts window
    # REBALANCER_COUNT_DUPLICATES: how many ranks count each routed token (vLLM's window
    # counts every token once per DP rank under the naive all-to-all, once per TP rank
    # inside an EP rank); the windows sent are divided by it. 1 for DeepEP-style dispatch.
    count_duplicates: int = 1
    worker_id: str = ""               # REBALANCER_WORKER_ID (default: host and pid)

    def __post_init__(self) -> None:
        if not self.address:
            raise InputError(f"{ENV_PREFIX}ADDRESS is empty")
        for name in ("window_steps", "count_duplicates"):
            if getattr(self, name) < 1:
                raise InputError(f"{ENV_PREFIX}{name.upper()} must be >= 1, got {getattr(self, name)}")

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> VLLMAdapterConfig | None:
        """The settings in `env` (default os.environ); None when REBALANCER_ADDRESS is
        unset (vLLM's own EPLB then runs unchanged). InputError on a bad value."""
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get(ENV_PREFIX + name, "").strip()
            return value or None

        def integer(name: str) -> int:
            raw = get(name)
            if raw is None:
                return int(getattr(VLLMAdapterConfig, name.lower()))
            try:
                return int(raw)
            except ValueError:
                raise InputError(f"{ENV_PREFIX}{name}={raw!r} is not an int") from None

        address = get("ADDRESS")
        if address is None:
            return None
        token = None
        token_file = get("TOKEN_FILE")
        if token_file is not None:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as exc:
                raise InputError(f"{ENV_PREFIX}TOKEN_FILE {token_file}: {exc.strerror}") from None
        return VLLMAdapterConfig(
            address=address,
            deployment=get("DEPLOYMENT") or VLLMAdapterConfig.deployment,
            token=token,
            ca_file=get("CA_FILE"),
            cert_file=get("CERT_FILE"),
            key_file=get("KEY_FILE"),
            window_steps=integer("WINDOW_STEPS"),
            count_duplicates=integer("COUNT_DUPLICATES"),
            worker_id=get("WORKER_ID") or "",
        )
