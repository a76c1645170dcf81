"""What a rank's hook is told: `HookConfig`, its model and identity, and one section per job.

    HookConfig(link=Link(address, deployment=..., token=...),  # how it reaches the controller
               rank=r,                                    # who this rank is
               shape=ClusterShape(num_layers=L, num_logical=E, num_slots=P,
                                  num_gpus=G, expert_bytes=0),  # the model's shape (0: unknown)
               windows=WindowConfig(steps=16),            # counting
               dispatch=DispatchConfig(mode="load"),      # tokens among an expert's replicas
               commit=CommitConfig(agree_every=4),        # switching placements
               migration=MigrationConfig(transport="ipc"))  # moving weights
                                                           # (worker_hooks/migration.py)

Every section has defaults that serve; each checks its own fields when built (a
TypeError or ValueError naming the field), and `HookConfig` checks how they fit together.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from rebalancer.errors import InputError
from rebalancer.wire.channel import check_address
from rebalancer.wire.dispatch import (
    DEFAULT_DISPATCH_MODE,
    WATERFILL_PASSES,
    DispatchMode,
    check_dispatch_mode,
    check_waterfill_passes,
    has_shared_replicas,
)
from rebalancer.wire.link import Link
from rebalancer.wire.shape import ClusterShape
from rebalancer.wire.windows import MAX_WINDOW_STEPS
from worker_hooks.warm import DEFAULT_WARM_START_SECONDS, check_warm_start_seconds

__all__ = [
    "TRANSPORTS",
    "ClusterShape",
    "CommitConfig",
    "DispatchConfig",
    "HookConfig",
    "Link",
    "MigrationConfig",
    "Transport",
    "WindowConfig",
]


def _check_ints(
    section: object, names: tuple[str, ...], minimum: int, what: str | None = None
) -> None:
    """Each field in `names` is an int (not a bool) >= minimum: TypeError / ValueError
    naming `what.name` (`what`: the section's class by default)."""
    what = what or type(section).__name__
    for name in names:
        value = getattr(section, name)
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{what}.{name} must be an int, got {type(value).__name__} {value!r}")
        if value < minimum:
            raise ValueError(f"{what}.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class WindowConfig:
    """How routing is counted and sent up."""

    steps: int = 16
    """Forward steps per counts window (a window also closes at each placement switch)."""
    record_physical: bool = True
    """Also count the picks each physical slot received (the controller's measured
    balance, and the count files' per-GPU counts)."""

    def __post_init__(self) -> None:
        _check_ints(self, ("steps",), 1)
        if self.steps > MAX_WINDOW_STEPS:  # the sidecar and the controller would refuse its windows
            raise ValueError(
                f"WindowConfig.steps must be at most {MAX_WINDOW_STEPS} (a window's steps "
                f"travel as a uint32), got {self.steps}"
            )


@dataclass(frozen=True)
class DispatchConfig:
    """How an expert's tokens are divided among its replicas (rebalancer.wire.dispatch)."""

    mode: DispatchMode = DEFAULT_DISPATCH_MODE
    """"split": the hash split (no collective); "load": water-filled against this step's
    per-GPU load (one all-gather of `[G, E + 1]` counts per layer); "load+shared": as
    "load", with the shared expert dispatched too (needs `HookConfig.shared_expert`)."""
    waterfill_passes: int = WATERFILL_PASSES
    """Water-filling passes per layer and step under "load" / "load+shared": more come
    closer to even at 14 kernels each (rebalancer.wire.dispatch.WATERFILL_PASSES)."""
    compile: bool = False
    """Fuse each layer's water-fill with torch.compile (CUDA; compiled at the first step,
    so run a step eagerly before capturing graphs). Off: ~140 small kernels per layer."""

    def __post_init__(self) -> None:
        check_dispatch_mode(self.mode)  # InputError: a ValueError naming the choices
        check_waterfill_passes(self.waterfill_passes)

    @property
    def by_load(self) -> bool:
        """Whether a step's load decides the split (an all-gather per layer)."""
        return self.mode != "split"


@dataclass(frozen=True)
class CommitConfig:
    """How a prepared plan becomes the placement served."""

    agree_every: int = 4
    """Steps between the ranks' commit agreements (an asynchronous all-reduce of their
    ready versions): every rank switches at the same step."""
    spare_rows: int = 0
    """Weight rows per layer on each rank beyond its slots: incoming experts land there
    during prepare and a commit only swaps maps (worker_hooks/rows.py). 0: experts are
    copied into their slots at commit."""

    def __post_init__(self) -> None:
        _check_ints(self, ("agree_every",), 1)
        _check_ints(self, ("spare_rows",), 0)


Transport = Literal["p2p", "ipc", "outbox"]
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)


@dataclass(frozen=True)
class MigrationConfig:
    """How a rank moves weights for a plan (worker_hooks/migration.py, the transports in
    worker_hooks/transports/); checked on construction."""

    transport: Transport = "p2p"
    """One of "p2p", "ipc" or "outbox" (worker_hooks/transports/); "ipc" and "outbox" need
    every rank of the group on this host and the group a gloo group."""
    layers_per_chunk: int = 4
    """p2p: layers exchanged per round of transfers."""
    rounds_in_flight: int = 1
    """p2p: rounds posted before the oldest is waited for; above 1 the packing of a round
    overlaps the transfers of the previous ones (correct on gloo,
    tests/unit/worker_hooks/test_migrate.py; not yet measured on GPU, so the default keeps
    the measured one-round-at-a-time behaviour)."""
    outbox_bytes: int = 1 << 30
    """outbox: size of each of the two outboxes per rank, rounded down to whole experts (at
    least one)."""
    copy_streams: int = 2
    """ipc on GPU: reads from one peer spread round-robin over this many streams (copy
    engines work in parallel)."""
    max_gbps: float = 0.0
    """Any transport: at most this many GB/s received per rank (0: as fast as the links go)."""
    join_seconds: float = 1.5
    """Any transport: how long a rank that took a plan waits for every rank of the group to
    take it before the plan fails everywhere (worker_hooks/fence.py)."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        for name in ("layers_per_chunk", "rounds_in_flight", "outbox_bytes", "copy_streams"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.max_gbps >= 0:
            raise ValueError(f"max_gbps must be >= 0, got {self.max_gbps}")
        if not self.join_seconds > 0:
            raise ValueError(f"join_seconds must be > 0, got {self.join_seconds}")


@dataclass(frozen=True)
class PoolConfig:
    """Starting in a replica pool (docs/operations.md, "Pools"); the pool itself is named
    by `HookConfig.link.pool`, the same on every rank of the group."""

    warm_start_seconds: float = DEFAULT_WARM_START_SECONDS
    """Longest wait at `start` for the pool's placement (RegisterResponse.warm_start):
    a fresh group installs it before its first step, every rank or none. 0: never wait,
    start as without a pool."""

    def __post_init__(self) -> None:
        check_warm_start_seconds(self.warm_start_seconds, "PoolConfig.warm_start_seconds")


@dataclass(frozen=True)
class HookConfig:
    """One rank's hook: who it is, the model's shape, and one section per job."""

    link: Link
    """How this rank reaches the controller and who it is there: the address (the
    controller's `host:port`, or the pod's sidecar `unix:///run/rebalancer/agent.sock`),
    the deployment it serves (one model on one EP group, needed), a worker id for the
    controller's status and logs, the replica pool, and, straight to the controller, the
    token and TLS files (through the sidecar, which holds them itself, none are needed)."""
    rank: int
    """This rank in the EP group, in [0, shape.num_gpus)."""
    shape: ClusterShape
    """The model and its EP group, told to the controller at Register: MoE layers, routed
    (logical) experts per layer, physical slots per layer over the group (a multiple of
    num_gpus), ranks, hosts (the controller prices moves between them), the bytes of one
    expert's weights (the migration cost; 0: unknown, where ClusterShape's default is
    DeepSeek-V3's) and the routed experts per token (top_k, 0: unknown). The rank's
    dispatch mode is `dispatch.mode`: the shape's `dispatch_mode` is left at its default
    or says the same."""
    shared_expert: bool = False
    """The model has a shared expert (DeepSeek-V3/V4): counted as expert E of every layer,
    and under dispatch "load+shared" dispatched like a routed expert with a replica on
    every GPU."""
    windows: WindowConfig = field(default_factory=WindowConfig)
    """Counting routing into windows."""
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    """Dividing an expert's tokens among its replicas."""
    commit: CommitConfig = field(default_factory=CommitConfig)
    """Switching to a prepared plan: agreement period, spare rows."""
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    """Moving weights for a plan (worker_hooks/migration.py: transport, pacing, chunks)."""
    pool: PoolConfig = field(default_factory=PoolConfig)
    """The warm start in the replica pool `link.pool`."""

    def __post_init__(self) -> None:
        if not isinstance(self.link, Link):
            raise TypeError(f"HookConfig.link must be a Link, got {type(self.link).__name__}")
        for name in ("address", "deployment"):
            if not isinstance(getattr(self.link, name), str) or not getattr(self.link, name):
                raise TypeError(
                    f"HookConfig.link.{name} must be a non-empty str, "
                    f"got {getattr(self.link, name)!r}"
                )
        try:
            check_address(self.link.address)  # gRPC would only fail at every connection attempt
        except InputError as exc:
            raise InputError(f"HookConfig.link.address: {exc}") from None
        if not isinstance(self.shape, ClusterShape):
            raise TypeError(
                f"HookConfig.shape must be a ClusterShape, got {type(self.shape).__name__}"
            )
        _check_ints(self, ("rank",), 0)
        _check_ints(
            self.shape,
            (
                "num_layers",
                "num_logical",
                "num_slots",
                "num_gpus",
                "num_nodes",
                "expert_bytes",
                "top_k",
            ),
            0,
            "HookConfig.shape",
        )
        for name, section in (
            ("windows", WindowConfig),
            ("dispatch", DispatchConfig),
            ("commit", CommitConfig),
            ("migration", MigrationConfig),
            ("pool", PoolConfig),
        ):
            if not isinstance(getattr(self, name), section):
                raise TypeError(
                    f"HookConfig.{name} must be a {section.__name__}, "
                    f"got {type(getattr(self, name)).__name__}"
                )
        shape = self.shape
        if shape.num_gpus < 1 or not 0 <= self.rank < shape.num_gpus:
            raise ValueError(
                f"need 0 <= rank < num_gpus, got rank={self.rank}, num_gpus={shape.num_gpus}"
            )
        if shape.num_slots % shape.num_gpus:
            raise ValueError(
                f"num_slots={shape.num_slots} is not a multiple of num_gpus={shape.num_gpus}"
            )
        if shape.dispatch_mode not in (DEFAULT_DISPATCH_MODE, self.dispatch.mode):
            raise ValueError(
                f"HookConfig.shape.dispatch_mode is {shape.dispatch_mode!r} and "
                f"HookConfig.dispatch.mode {self.dispatch.mode!r}: the rank's dispatch mode is "
                "set once, in dispatch.mode"
            )
        shape.validate()  # the layout rules the controller holds a Register to, here at once
        if has_shared_replicas(self.dispatch.mode) and not self.shared_expert:
            raise ValueError('dispatch mode "load+shared" needs shared_expert=True')

    @property
    def registered_shape(self) -> ClusterShape:
        """The shape told to the controller at Register: `shape` under `dispatch.mode`."""
        return replace(self.shape, dispatch_mode=self.dispatch.mode)

    @property
    def slots_per_rank(self) -> int:
        return self.shape.num_slots // self.shape.num_gpus

    @property
    def rows_per_rank(self) -> int:
        """Weight rows per layer on a rank: its slots plus the spare rows."""
        return self.slots_per_rank + self.commit.spare_rows

    @property
    def num_rows(self) -> int:
        """Weight rows per layer over the group (the ids `route` returns are below it)."""
        return self.shape.num_gpus * self.rows_per_rank
