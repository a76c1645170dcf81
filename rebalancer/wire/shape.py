"""The model shape of a deployment's EP group: what the controller, the decision and the
simulator know of it (`ClusterShape`), its wire form (`pb.ModelShape`) and the one
conversion between them, checked against the layout limits (wire/layout.py) before
anything of its size is allocated."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.dispatch import DEFAULT_DISPATCH_MODE, check_dispatch_mode
from rebalancer.wire.layout import MAX_EXPERT_BYTES, MAX_LAYER_SLOTS, MAX_LAYERS, check_layout

# DeepSeek-V3 routed expert in FP8: gate, up (7168 x 2048 each) and down (2048 x 7168).
DEEPSEEK_V3_EXPERT_BYTES = 3 * 7168 * 2048


@dataclass(frozen=True)
class ClusterShape:
    """What the decision needs to know about a deployment's EP group."""

    num_layers: int
    num_logical: int
    num_slots: int
    num_gpus: int
    num_nodes: int = 1
    num_groups: int = 0  # expert groups for hierarchical placement, 0 = none
    expert_bytes: int = DEEPSEEK_V3_EXPERT_BYTES
    # How the ranks divide an expert's tokens among its replicas (rebalancer.wire.dispatch):
    # a placement's balance is predicted under it. top_k (0: unknown) sizes the shared
    # expert's load under "load+shared" (one shared pick per token).
    dispatch_mode: str = DEFAULT_DISPATCH_MODE
    top_k: int = 0

    def validate(self) -> None:
        if (
            isinstance(self.num_layers, bool)
            or not isinstance(self.num_layers, (int, np.integer))
            or self.num_layers <= 0
        ):
            raise InputError(f"num_layers must be a positive integer, got {self.num_layers!r}")
        check_layout(self.num_logical, self.num_slots, self.num_gpus, self.num_nodes)
        if self.num_groups < 0 or (self.num_groups and self.num_logical % self.num_groups):
            raise InputError(
                f"num_groups ({self.num_groups}) must be 0 or divide num_logical "
                f"({self.num_logical})"
            )
        if self.expert_bytes < 0:
            raise InputError(f"expert_bytes must be >= 0, got {self.expert_bytes}")
        check_dispatch_mode(self.dispatch_mode)
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, (int, np.integer))
            or not 0 <= self.top_k <= self.num_logical
        ):
            raise InputError(f"top_k must be an integer in [0, num_logical], got {self.top_k!r}")


def shape_of(msg: pb.ModelShape) -> ClusterShape:
    """A Register's shape, checked before anything of its size is allocated: the layout
    rules and limits (wire/layout.py: E <= P <= MAX_SLOTS, P / G <= MAX_SLOTS_PER_GPU,
    L <= MAX_LAYERS, L x P <= MAX_LAYER_SLOTS, expert bytes <= MAX_EXPERT_BYTES)."""
    if msg.num_layers > MAX_LAYERS:
        raise InputError(f"shape.num_layers {msg.num_layers} is above the limit {MAX_LAYERS}")
    if msg.expert_bytes > MAX_EXPERT_BYTES:
        raise InputError(
            f"shape.expert_bytes {msg.expert_bytes} is above the limit {MAX_EXPERT_BYTES} (1 TiB)"
        )
    shape = ClusterShape(
        num_layers=msg.num_layers,
        num_logical=msg.num_logical_experts,
        num_slots=msg.num_physical_slots,
        num_gpus=msg.num_gpus,
        num_nodes=msg.num_nodes or 1,
        num_groups=msg.num_groups,
        expert_bytes=msg.expert_bytes or ClusterShape.expert_bytes,
    )
    shape.validate()
    cells = shape.num_layers * shape.num_slots
    if cells > MAX_LAYER_SLOTS:
        raise InputError(
            f"shape.num_layers x shape.num_physical_slots ({shape.num_layers} x {shape.num_slots} = {cells}) "
            f"is above the limit {MAX_LAYER_SLOTS}"
        )
    return shape


def shape_msg(shape: ClusterShape) -> pb.ModelShape:
    return pb.ModelShape(
        num_layers=shape.num_layers,
        num_logical_experts=shape.num_logical,
        num_physical_slots=shape.num_slots,
        num_gpus=shape.num_gpus,
        num_nodes=shape.num_nodes,
        expert_bytes=shape.expert_bytes,
        num_groups=shape.num_groups,
    )
