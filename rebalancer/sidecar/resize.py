"""A resize of the EP group, relayed by the pod's sidecar.

An elastic engine resizes its EP group in place (SGLang's elastic EP after a rank fault,
vLLM's elastic scale-down): each surviving rank registers again as a rank of the smaller
world, with that world's shape, the placement it serves and the world before
(`RegisterRequest.resized_from`; the controller's side: rebalancer/controller/resize.py).
The pod's ranks change numbers (survivor i of the group is rank i of the new world) and
some are gone, so the pod cannot relay rank by rank: it gathers the registrations of one
resize (`PendingResize`), tells each rank's old number by its worker id (the same process
registers again), and takes the new world once every rank of the old one is accounted
for: registered again, or without a stream here `SETTLE_SECONDS` after the resize began
(a rank the engine lost; its stream ends with its process, or its adapter stops it).

Until the controller has taken the resize, a resized rank is answered UNAVAILABLE (its
agent asks again, backing off): the pod registers the new world upstream as one group
session resized from the old one, and a rank's next Register is answered with the version
the controller committed the resize under, which the rank then serves
(worker_hooks/session/rank.py `_join_resized_world`).

Refused, nothing changed: a resized rank of another deployment, or one that serves
another placement than its peers of the same resize (FAILED_PRECONDITION), and one
without the placement it serves (INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from rebalancer.errors import StateError
from rebalancer.v1 import rebalancer_pb2 as pb

# How long a rank of the old world may be without a stream here before the pod takes the
# new world without it: a survivor's agent stops its old stream before it registers the
# new world (a moment apart), a lost rank never comes back.
SETTLE_SECONDS = 3.0


def describe(resize: pb.Resize) -> str:
    return f"v{resize.version} on {resize.num_gpus} GPUs"


@dataclass
class PendingResize:
    """The registrations of one resize gathered so far."""

    resized_from: pb.Resize
    shape: pb.ModelShape
    placement: pb.Placement  # what every rank of the new world serves (version 0 to them)
    started: float  # when the first of them asked
    workers: dict[int, str] = field(default_factory=dict)  # new rank -> worker id
    old_ranks: set[int] = field(default_factory=set)  # the pod's old ranks they were

    @classmethod
    def of(cls, request: pb.RegisterRequest, now: float) -> PendingResize:
        if not request.HasField("initial_placement"):
            raise StateError(
                "INVALID_ARGUMENT",
                f"rank {request.rank} registers a resized EP group without the "
                "placement it serves (initial_placement)",
            )
        shape, placement = pb.ModelShape(), pb.Placement()
        shape.CopyFrom(request.shape)
        placement.CopyFrom(request.initial_placement)
        resized_from = pb.Resize()
        resized_from.CopyFrom(request.resized_from)
        return cls(resized_from, shape, placement, now)

    def same_resize(self, request: pb.RegisterRequest) -> bool:
        """Whether `request` is a rank of this resize (the same world before and after)."""
        return request.resized_from == self.resized_from and request.shape == self.shape

    def add(self, request: pb.RegisterRequest, old_rank: int | None) -> None:
        """A rank of this resize asked; `old_rank`: its number in the old world, if known."""
        rank = int(request.rank)
        if request.initial_placement.phy2log != self.placement.phy2log:
            raise StateError(
                "FAILED_PRECONDITION",
                f"rank {rank} registers the resize from {describe(self.resized_from)} "
                "serving another "
                "placement than its peers of the same resize",
            )
        if not 0 <= rank < self.shape.num_gpus:
            raise StateError(
                "INVALID_ARGUMENT",
                f"rank {rank} registers a resized EP group of {self.shape.num_gpus} GPUs",
            )
        self.workers[rank] = request.worker_id
        if old_rank is not None:
            self.old_ranks.add(old_rank)

    def complete(self, old_world: Collection[int], connected: Collection[int], now: float) -> bool:
        """Whether every rank of the pod's old world is accounted for (module docstring)."""
        missing = set(old_world) - self.old_ranks
        if not missing:
            return True
        return now - self.started >= SETTLE_SECONDS and not missing & set(connected)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.workers))
