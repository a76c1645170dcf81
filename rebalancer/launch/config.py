"""The demo's fleet: its shape, routing, processes and policy (`DemoConfig`), as `rebalancer
demo`, `Fleet`, the benches and the tests launch it, and what follows from it: the workers'
time limit and the pods' ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

from rebalancer.controller.cost import CostParams
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.estimate import EstimatorConfig
from rebalancer.wire.link import Link
from worker_hooks.config import WindowConfig

# The workers' time limit when none is given: this much per forward step (a loaded
# 2-core machine ran ~0.1 s per step of the default 4 workers), at least MIN_TIME_LIMIT.
TIME_LIMIT_PER_STEP = 0.25
MIN_TIME_LIMIT = 110.0

# The deployment's worker token, for workers (worker_hooks.examples.cpu_worker reads it) and
# sidecars attached to a controller that asks for one ([worker_tokens]).
WORKER_TOKEN_ENV = "REBALANCER_WORKER_TOKEN"


@dataclass
class DemoConfig:
    workers: int = 4
    layers: int = 6
    experts: int = 32
    slots: int = 40
    top_k: int = 4
    tokens: int = 32  # per rank per step
    steps: int = 480
    windows: WindowConfig = field(default_factory=WindowConfig)  # the workers' counts windows
    windows_per_phase: int = 5
    seed: int = 7
    db_path: str | None = None  # default: a temporary file
    port: int = 0
    worker_log: str = "WARNING"
    # The workers' time limit; None: derived from the steps (`time_limit`).
    timeout_seconds: float | None = None
    # Weight transfers between the worker processes: "p2p" (gloo send/recv) or "ipc"
    # (each rank reads what it gains from its peers' weights in shared memory).
    transport: str = "p2p"
    # Where the workers keep the hook and the expert weights: "cpu" or "cuda".
    device: str = "cpu"
    # Spare weight rows per layer and rank: with enough, a commit copies no weights.
    spare_rows: int = 0
    # Pods, each with a `rebalancer sidecar` between its workers/sidecars ranks and the
    # controller; 0: every worker talks to the controller directly. `rebalancer demo`
    # defaults to default_sidecars(workers).
    sidecars: int = 0
    # Keep the temporary folder (store, routing profile, rank results, sockets).
    keep: bool = False
    # The embedded controller's Prometheus port (None: none; 0: any free), with the
    # per-layer series on (a demo deployment is small).
    metrics_port: int | None = None
    # Attach to this running controller (its address; the workers bring the demo's worker
    # token) instead of starting one. None: the demo starts its own.
    attach: Link | None = None
    deployment: str = "demo"
    policy: PolicyConfig = field(
        default_factory=lambda: PolicyConfig(
            min_interval_seconds=1.0,
            gain_threshold=0.03,
            horizon_seconds=60.0,
            max_moved_fraction=0.3,
            min_windows=2,
            decision_period_seconds=0.25,
            prepare_timeout_seconds=20.0,
            estimator=EstimatorConfig(decay=0.5),
            cost=CostParams(step_seconds=0.01),
        )
    )


def time_limit(config: DemoConfig) -> float:
    """Seconds the workers may run: `timeout_seconds`, or by default enough for every
    step asked (TIME_LIMIT_PER_STEP each, at least MIN_TIME_LIMIT)."""
    if config.timeout_seconds is not None:
        return config.timeout_seconds
    return max(MIN_TIME_LIMIT, TIME_LIMIT_PER_STEP * config.steps)


def default_sidecars(workers: int) -> int:
    """Two pods of workers/2 ranks (like two 2-GPU pods of the default 4 workers) when the
    workers split evenly, else one pod holding them all."""
    return 2 if workers >= 2 and workers % 2 == 0 else 1


def pod_ranks(workers: int, sidecars: int) -> list[range]:
    """The ranks of each pod: pod i holds i*n .. i*n+n-1, n = workers / sidecars."""
    if sidecars < 1 or workers % sidecars:
        raise ValueError(f"{workers} workers do not split into {sidecars} equal pods")
    n = workers // sidecars
    return [range(i * n, (i + 1) * n) for i in range(sidecars)]
