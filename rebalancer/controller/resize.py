"""When an elastic engine resized a deployment's EP group: the controller takes the new world.

vLLM's elastic EP scales a group down (or up) in place: the survivors serve a placement of
the new shape (the controller's planned survivor placement, or vLLM's own) and their
adapters register again with that shape, stating the world they served before
(`RegisterRequest.resized_from`, proto). The first such registration resizes the
deployment: its shape, its committed placement (a new version, stored as a plan with
trigger "resize"), its windows (the old world's partial windows are dropped: they sum
other ranks) and its sessions (the old world's end; a rank of it that registers again
with the old shape is refused). The estimate of the load per logical expert is kept: the
experts are the same. Later ranks of the same resize, serving the same placement, join
the new world at that version.

Refused, nothing changed: a resize from another version or world than the deployment's
(FAILED_PRECONDITION: a rank that missed a plan, or a stale group), a shape that differs
in more than its world (FAILED_PRECONDITION), and while a plan or decision is under way
(UNAVAILABLE: asked again, it is taken once that ends, or refused if a plan committed).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from rebalancer.controller.deployment import Deployment, Resize
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from rebalancer.wire.shape import ClusterShape, shape_key, stored_shape

log = logging.getLogger("rebalancer.controller")

# The fields a resize changes: the world. Everything else is the model's and stays.
WORLD_FIELDS = ("num_gpus", "num_slots", "num_nodes")


def same_model(a: ClusterShape, b: ClusterShape) -> bool:
    """Whether two shapes differ in their world only (WORLD_FIELDS)."""
    world = {f: getattr(a, f) for f in WORLD_FIELDS}
    return shape_key(replace(b, **world)) == shape_key(a)


def _taken(store: Store, dep: Deployment, resized_from: Resize) -> bool:
    """Whether the deployment's placement is this resize, taken already: in this process
    (`dep.resized_from`), or before a restart (its newest plan row, trigger "resize")."""
    if dep.resized_from == resized_from:
        return True
    newest = store.plans(dep.name, limit=1)
    return (
        bool(newest)
        and newest[0].version == dep.version
        and newest[0].trigger == "resize"
        and newest[0].base_version == resized_from.version
    )


def take(
    store: Store,
    dep: Deployment,
    who: str,
    shape: ClusterShape,
    phy2log: np.ndarray,
    resized_from: Resize,
    unknown: frozenset[str],
    now: float,
) -> None:
    """`who` registers with the new world `shape`, serving `phy2log` `[L, P']`, resized from
    `resized_from`: resize `dep`, or find it resized already by a peer of the same resize
    (module docstring); StateError otherwise."""
    if _taken(store, dep, resized_from) and shape_key(dep.shape) == shape_key(shape):
        if not np.array_equal(dep.phy2log, phy2log):
            raise StateError(
                "FAILED_PRECONDITION",
                f"{who} of {dep.name!r} resized from {resized_from.describe()} serves another "
                f"placement than the ranks that resized first (v{dep.version})",
            )
        return
    if not same_model(dep.shape, shape):
        raise StateError(
            "FAILED_PRECONDITION",
            f"{who} of {dep.name!r}: a resize changes only {', '.join(WORLD_FIELDS)}; the "
            f"deployment is {shape_key(dep.shape)}, {who} reports {shape_key(shape)}",
        )
    if dep.version != resized_from.version or dep.shape.num_gpus != resized_from.num_gpus:
        raise StateError(
            "FAILED_PRECONDITION",
            f"{who} of {dep.name!r} resized from {resized_from.describe()}; the deployment "
            f"is at v{dep.version} on {dep.shape.num_gpus} GPUs",
        )
    if dep.plan is not None or dep.deciding:
        under_way = f"plan v{dep.plan.version}" if dep.plan is not None else "a decision"
        raise StateError(
            "UNAVAILABLE",
            f"{dep.name!r}: {under_way} is under way; the resize is taken once it ends (ask again)",
        )
    version = store.max_version(dep.name) + 1
    reason = (
        f"{who} resized the EP group from {resized_from.num_gpus} to {shape.num_gpus} GPUs "
        f"(v{resized_from.version})"
    )
    store.resize(
        dep.name,
        stored_shape(shape, dep.unknown_fields & unknown),
        version,
        resized_from.version,
        phy2log,
        reason,
        now=now,
    )
    log.warning("%s: %s: the new world serves v%d", dep.name, reason, version)
    dep.resize(shape, version, phy2log, resized_from)
