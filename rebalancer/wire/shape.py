"""The model shape of a deployment's EP group: what the controller, the decision and the
simulator know of it (`ClusterShape`), its wire form (`pb.ModelShape`) and the one
conversion between them, checked against the layout limits (wire/layout.py) before
anything of its size is allocated; and the one rule for when two reported shapes are one
deployment's (`merge_shape`), which the controller's registry and the sidecar both ask."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

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
        check_expert_bytes(self.expert_bytes)
        check_dispatch_mode(self.dispatch_mode)
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, (int, np.integer))
            or not 0 <= self.top_k <= self.num_logical
        ):
            raise InputError(f"top_k must be an integer in [0, num_logical], got {self.top_k!r}")


def check_expert_bytes(value: object, what: str = "expert_bytes") -> int:
    """`value` as one expert's bytes, or InputError naming `what`: an integer in [0,
    MAX_EXPERT_BYTES] (it may come from a command line's JSON, so any type may arrive)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        text = repr(value)
        text = text if len(text) <= 40 else text[:37] + "..."
        raise InputError(f"{what} must be an integer, got {text}")
    if not 0 <= value <= MAX_EXPERT_BYTES:
        raise InputError(f"{what} must be in [0, 2**40], got {value}")
    return int(value)


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
            f"shape.num_layers x shape.num_physical_slots "
            f"({shape.num_layers} x {shape.num_slots} = {cells}) "
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


def shape_key(shape: ClusterShape) -> dict[str, Any]:
    """The shape as stored and compared: plain ints (the dispatch mode: its name)."""
    return {k: v if isinstance(v, str) else int(v) for k, v in asdict(shape).items()}


def dispatch_shape(shape: ClusterShape, dispatch_mode: str, top_k: int) -> ClusterShape:
    """A Register's shape with its dispatch mode ("" = split) and top_k, checked."""
    out = replace(shape, dispatch_mode=dispatch_mode or DEFAULT_DISPATCH_MODE, top_k=int(top_k))
    out.validate()
    return out


# Shape fields a stored row may lack: added after deployments were first stored, or
# (expert_bytes) not known to the Register that created it. A row without one loads with
# the field unknown (registry.load), and top_k 0 means unknown wherever it comes from.
LATER_SHAPE_FIELDS = ("dispatch_mode", "top_k", "expert_bytes")

# A Register with expert_bytes 0 does not know it yet: SGLang's warm start registers before
# the engine loaded its weights (worker_hooks/engines/sglang/warm_start.py). The shape
# holds the default bytes (shape_of, above) with the field unknown, until a rank reports it.
UNKNOWN_EXPERT_BYTES = frozenset({"expert_bytes"})


def stored_shape(shape: ClusterShape, unknown: frozenset[str]) -> dict[str, Any]:
    """The shape as stored: without the fields not known yet (they load as unknown)."""
    return {k: v for k, v in shape_key(shape).items() if k not in unknown}


def merge_shape(
    stored: ClusterShape,
    reported: ClusterShape,
    unknown: frozenset[str],
    reported_unknown: frozenset[str] = frozenset(),
) -> ClusterShape | None:
    """The deployment's shape once a rank reports `reported`, or None if the two disagree.

    1. A stored field that is unknown (in `unknown`: absent from an older store, or from
       the Register that created it; top_k 0) takes the reported value, so ranks that now
       send their dispatch mode, top_k and expert bytes join a deployment saved before.
    2. A rank reporting top_k 0 or expert bytes it does not know (in `reported_unknown`)
       accepts the stored value.
    3. Everything else must be equal (a rank sending no dispatch mode means split).
    """
    merged = stored
    if "dispatch_mode" in unknown:
        merged = replace(merged, dispatch_mode=reported.dispatch_mode)
    if merged.top_k == 0 or "top_k" in unknown:
        merged = replace(merged, top_k=reported.top_k or merged.top_k)
    if "expert_bytes" in unknown and "expert_bytes" not in reported_unknown:
        merged = replace(merged, expert_bytes=reported.expert_bytes)
    seen = reported if reported.top_k else replace(reported, top_k=merged.top_k)
    if "expert_bytes" in reported_unknown:
        seen = replace(seen, expert_bytes=merged.expert_bytes)
    return merged if shape_key(merged) == shape_key(seen) else None


def unknown_of(msg: pb.ModelShape) -> frozenset[str]:
    """The fields a Register's shape does not know yet: expert bytes 0."""
    return frozenset() if msg.expert_bytes else UNKNOWN_EXPERT_BYTES


def shapes_agree(a: pb.ModelShape, b: pb.ModelShape) -> bool:
    """Whether two ranks' Register shapes can be one deployment's, by the controller's rule
    (`merge_shape`: a field one side does not know yet matches any); a shape the
    controller would refuse agrees with none. The sidecar asks it of its pod's ranks."""
    try:
        return merge_shape(shape_of(a), shape_of(b), unknown_of(a), unknown_of(b)) is not None
    except InputError:
        return False
