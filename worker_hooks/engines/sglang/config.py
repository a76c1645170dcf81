"""The SGLang adapter's settings, read from the environment of SGLang's processes.

SGLang starts its scheduler and worker processes itself and has no flag for a plugin,
so the adapter is configured like SGLang's own `SGLANG_*` switches: environment
variables, read once per process when the plugin registers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from rebalancer.errors import InputError
from rebalancer.wire.link import Link
from worker_hooks.config import WindowConfig
from worker_hooks.engines.env import ENV_PREFIX, EngineEnv, check_link, check_windows
from worker_hooks.warm import DEFAULT_WARM_START_SECONDS, check_warm_start_seconds

# How a committed plan reaches the weights (worker_hooks/engines/sglang/__init__.py):
# "staged" receives them beside serving and the commit only copies locally and swaps the
# maps; "sglang" runs SGLang's own ExpertLocationUpdater inside the forward loop, between
# passes, at the agreed pass.
Updater = Literal["staged", "sglang"]
# The setting: "auto" (default) is "staged" where the weights move over gloo (CPU) and
# "sglang" where they would move over NCCL (choose_updater says why).
UpdaterSetting = Literal["auto", "staged", "sglang"]
UPDATERS: tuple[UpdaterSetting, ...] = get_args(UpdaterSetting)

# The default staging budget per rank. On an H200 (141 GB) SGLang gives the KV cache what
# the weights and activations leave (mem_fraction_static ~0.8-0.9 of the card), so staging
# comes out of the 10-20 GB of headroom beside it, shared with activations and CUDA
# graphs: 4 GiB is ~3 % of the card, well inside that. It holds ~45 bf16 DeepSeek-V3
# experts (3 x 7168 x 2048 x 2 B = 88 MB each) or ~90 in FP8: a from-scratch refit at
# EP32 gains ~9 experts per layer and rank, so ~5 layers (bf16) or ~10 (FP8) per group,
# and the 58 MoE layers commit in 6-12 groups.
DEFAULT_STAGING_BUDGET_BYTES = 4 << 30

# The deployment the adapter registers as when REBALANCER_DEPLOYMENT is unset.
DEFAULT_DEPLOYMENT = "sglang"


@dataclass(frozen=True)
class SGLangAdapterConfig:
    # The link (rebalancer.wire.link.LINK_ENV): REBALANCER_ADDRESS (unix:/path of the
    # sidecar, or host:port), REBALANCER_DEPLOYMENT (default "sglang"), the token read from
    # REBALANCER_TOKEN_FILE, REBALANCER_TLS_CA / _TLS_CERT / _TLS_KEY (TLS, mutual TLS),
    # REBALANCER_WORKER_ID (default: the host; the pid appended) and REBALANCER_POOL.
    link: Link
    # REBALANCER_WINDOW_STEPS: forward passes per counts window (windows.steps).
    windows: WindowConfig = field(default_factory=WindowConfig)
    agree_every: int = 4  # REBALANCER_AGREE_EVERY: passes between commit agreements
    # REBALANCER_AGREE_TIMEOUT_SECONDS: the adapter's gloo group gives up on a lost peer
    # after this long (agreements and the per-layer "done" of an update).
    agree_timeout_seconds: float = 60.0
    # In a pool (link.pool), its windows count in the pool's estimate and the pool rolls
    # its placement to it. A fresh group is offered the pool's placement and starts on it
    # (warm_start.py), when the offer came within REBALANCER_WARM_START_SECONDS of SGLang's
    # expert-location step (0: never wait).
    warm_start_seconds: float = DEFAULT_WARM_START_SECONDS
    # REBALANCER_UPDATER: "auto" (staged on gloo, SGLang's own on NCCL: choose_updater),
    # "staged" or "sglang" (SGLang's own updater, between passes).
    updater: UpdaterSetting = "auto"
    # REBALANCER_STAGING_BUDGET_BYTES: staged mode receives at most this many bytes of
    # experts per rank before a swap; a larger plan commits in layer groups.
    staging_budget_bytes: int = DEFAULT_STAGING_BUDGET_BYTES

    def __post_init__(self) -> None:
        check_link(self.link)
        check_windows(self.windows)
        if self.agree_every < 1:
            raise InputError(f"{ENV_PREFIX}AGREE_EVERY must be >= 1, got {self.agree_every}")
        if self.updater not in UPDATERS:
            raise InputError(
                f"{ENV_PREFIX}UPDATER must be one of {', '.join(UPDATERS)}, got {self.updater!r}"
            )
        if self.staging_budget_bytes < 1:
            raise InputError(
                f"{ENV_PREFIX}STAGING_BUDGET_BYTES must be >= 1, got {self.staging_budget_bytes}"
            )
        if not self.agree_timeout_seconds > 0:
            raise InputError(
                f"{ENV_PREFIX}AGREE_TIMEOUT_SECONDS must be > 0, got {self.agree_timeout_seconds}"
            )
        check_warm_start_seconds(self.warm_start_seconds, f"{ENV_PREFIX}WARM_START_SECONDS")

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> SGLangAdapterConfig | None:
        """The settings in `env` (default os.environ); None when REBALANCER_ADDRESS is
        unset (the plugin then leaves SGLang's own EPLB alone). InputError on a bad value."""
        e = EngineEnv(env)
        d = SGLangAdapterConfig  # its defaults
        link = e.link(DEFAULT_DEPLOYMENT)
        if link is None:
            return None
        return SGLangAdapterConfig(
            link,
            windows=e.windows(),
            agree_every=int(e.number("AGREE_EVERY", int, d.agree_every)),
            agree_timeout_seconds=float(
                e.number("AGREE_TIMEOUT_SECONDS", float, d.agree_timeout_seconds)
            ),
            updater=(e.get("UPDATER") or d.updater),  # type: ignore[arg-type]  # checked above
            staging_budget_bytes=int(e.number("STAGING_BUDGET_BYTES", int, d.staging_budget_bytes)),
            warm_start_seconds=float(
                e.number("WARM_START_SECONDS", float, DEFAULT_WARM_START_SECONDS)
            ),
        )


def choose_updater(
    setting: UpdaterSetting, backend: Literal["nccl", "gloo"]
) -> tuple[Updater, str | None]:
    """The updater the adapter runs with `setting` when the weights move over `backend`
    (the adapter's weight group: NCCL for weights on GPU, gloo on CPU), and a warning to
    log, if any.

    The staged update receives the weights with NCCL p2p on a background thread while
    SGLang's forward pass runs its own NCCL collectives on the serving thread: two
    communicators' kernels issued in an order that differs from rank to rank, which NCCL
    does not promise to run without deadlock (vLLM refuses the same pattern for its own
    async EPLB: "NCCL multi-stream conflicts"). The transports that avoid NCCL (ipc,
    outbox: CUDA IPC within one host) map one stacked tensor per weight, and SGLang's
    expert weights are one tensor per layer, so they cannot move them. On NCCL "auto"
    therefore moves the weights between passes, at the agreed pass, with SGLang's own
    updater (serving waits for the move, as with SGLang's own EPLB); "staged" forces the
    staged update there, with a warning. On gloo (CPU) the staged update is safe."""
    if setting == "auto":
        return ("sglang" if backend == "nccl" else "staged"), None
    if setting == "staged" and backend == "nccl":
        return "staged", (
            f"{ENV_PREFIX}UPDATER=staged on NCCL: the staging thread's NCCL p2p runs beside "
            "SGLang's forward collectives (two communicators, an order that may differ per "
            "rank: NCCL may deadlock); unset it to move the weights between passes with "
            "SGLang's updater"
        )
    return setting, None


# SGLang's --expert-distribution-recorder-mode values whose recorder hands the adapter each
# pass's [L, P] count (_StatAccumulator.append); per_pass and per_token keep a record
# per pass for a dump file (_DetailAccumulator) and never do.
RECORDER_MODES_WITH_COUNTS = ("stat", "stat_approx")


def recorder_refusal(mode: str | None) -> str | None:
    """Why the adapter cannot run with SGLang's expert distribution recorder in `mode`
    (None: it can). With EPLB on and the flag unset, SGLang picks "stat"."""
    if mode is None or mode in RECORDER_MODES_WITH_COUNTS:
        return None
    return (
        f"SGLang's --expert-distribution-recorder-mode is {mode}: that recorder keeps each "
        "pass's record for a dump file and hands the rebalancer no counts, so no window "
        "would ever reach the controller; use --expert-distribution-recorder-mode stat "
        "(what --enable-eplb picks when the flag is unset)"
    )
