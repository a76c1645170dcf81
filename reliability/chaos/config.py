"""The campaign's settings: the deployment it runs and the controller's configuration."""

from __future__ import annotations

from dataclasses import dataclass

from reliability.chaos.faults import ALL_KINDS

DEPLOYMENT = "chaos"

CONTROLLER_TOML = """
[server]
host = "127.0.0.1"
persist_seconds = 0.0
drain_seconds = 0.2
grace_seconds = 1.0
[policy]
min_interval_seconds = 1.0
gain_threshold = 0.02
horizon_seconds = 60.0
max_moved_fraction = 0.5
decay = 0.5
min_windows = 2
decision_period_seconds = 0.25
prepare_timeout_seconds = {prepare_timeout}
step_seconds = 0.01
"""


@dataclass
class ChaosConfig:
    seconds: float = 300.0
    seed: int = 1
    workers: int = 4
    pods: int = 2
    layers: int = 4
    experts: int = 16
    slots: int = 20
    tokens: int = 16
    top_k: int = 4
    window_steps: int = 8
    agree_every: int = 4
    step_sleep: float = 0.01
    prepare_seconds: float = 0.4  # a prepare's extra time on the last rank (chaos_worker)
    prepare_timeout_seconds: float = 5.0
    kinds: tuple[str, ...] = ALL_KINDS
    # Busy processes beside the whole campaign (a node other work keeps busy).
    hog: int = 0
    # cpu_starve: this many busy processes per CPU, for 2 s to `starve_seconds_max`.
    starve_per_cpu: int = 4
    starve_seconds_max: float = 20.0
    # Invariant 3: a step spends at most this in the rebalancer's code (route + step_end),
    # not counting the time its thread waited for a CPU (a starved node's doing). A step
    # that waited on a link would wait at least the fault's length (0.3-2 s).
    step_wait_bound_ms: float = 250.0
    settle_seconds: float = 30.0  # after an episode, to agreement (invariant 7)
    recovery_bound_seconds: float = 10.0
    keep: bool = False
    progress: bool = True
