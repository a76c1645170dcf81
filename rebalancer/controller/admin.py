"""AdminService: what operators and `rebalancer admin` speak.

Status, placement, history, force (or dry-run) a rebalance, pause/resume and
policy get/set. When the server is given an admin token, every call must carry
`authorization: Bearer <token>`; the server's interceptor (auth.py) refuses the others
before they reach this service, so they change nothing.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import grpc

from rebalancer.controller.decide import Decision, PolicyConfig
from rebalancer.controller.deployment import Deployment
from rebalancer.controller.replica_pools import ReplicaPool
from rebalancer.controller.service import placement_msg, planned_loss_msg
from rebalancer.controller.state import Controller
from rebalancer.errors import InputError, StateError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec
from rebalancer.wire.service import refuse
from rebalancer.wire.shape import shape_msg

# Policy fields that the v1 message carries; the others keep their current value.
_WIRE_POLICY_FIELDS = tuple(f.name for f in pb.Policy.DESCRIPTOR.fields)


log = logging.getLogger("rebalancer.admin")

# Policy fields that are lists of node counts (a NodeCounts message: present or absent).
_COUNTS_POLICY_FIELDS = tuple(
    f.name
    for f in pb.Policy.DESCRIPTOR.fields
    if f.message_type is not None and f.message_type.full_name == pb.NodeCounts.DESCRIPTOR.full_name
)


def policy_msg(policy: PolicyConfig) -> pb.Policy:
    settings = policy.to_flat()
    values: dict[str, Any] = {
        name: pb.NodeCounts(counts=settings[name])
        if name in _COUNTS_POLICY_FIELDS
        else settings[name]
        for name in _WIRE_POLICY_FIELDS
    }
    return pb.Policy(**values)


# Fields with presence on the wire: absent means "keep the current value".
_OPTIONAL_POLICY_FIELDS = tuple(
    f.name
    for f in pb.Policy.DESCRIPTOR.fields
    if f.has_presence and (f.containing_oneof is not None or f.name in _COUNTS_POLICY_FIELDS)
)


def policy_from_msg(msg: pb.Policy, base: PolicyConfig) -> PolicyConfig:
    """`base` with the message's settings (flat names, `PolicyConfig.with_settings`)."""
    known = set(PolicyConfig.setting_names())
    values = {
        name: list(getattr(msg, name).counts)
        if name in _COUNTS_POLICY_FIELDS
        else getattr(msg, name)
        for name in _WIRE_POLICY_FIELDS
        if name in known and (name not in _OPTIONAL_POLICY_FIELDS or msg.HasField(name))
    }
    current = base.to_flat()
    for name in ("min_windows", "estimate_window"):
        values[name] = int(values.get(name, current[name]))
    policy = base.with_settings(values)
    policy.validate()
    return policy


def decision_msg(decision: Decision | None, plan_version: int = 0) -> pb.Decision:
    if decision is None:
        return pb.Decision()

    def num(x: float) -> float:
        return float(x) if math.isfinite(x) else 0.0

    return pb.Decision(
        time=num(decision.time),
        outcome=decision.outcome,
        reason=decision.reason,
        balancedness_current=num(decision.balancedness_current),
        balancedness_candidate=num(decision.balancedness_candidate),
        bound_balancedness=num(decision.bound_balancedness),
        moved_fraction=num(decision.moved_fraction),
        bytes_to_move=int(decision.bytes_to_move),
        predicted_gain_seconds=num(decision.predicted_gain_seconds),
        migration_cost_seconds=num(decision.migration_cost_seconds),
        plan_version=plan_version,
        load=decision.load,
    )


def regimes_msg(dep: Deployment) -> pb.RegimesResponse:
    """The deployment's regime library as `rebalancer admin regimes` shows it."""
    library = dep.regime_library
    last = dep.last_decision
    out = pb.RegimesResponse(
        enabled=dep.policy.regimes, last_load=last.load if last is not None else ""
    )
    if library is None:
        return out
    summary = library.summary()
    out.current, out.windows = summary["current"], summary["windows"]
    out.recent.extend(summary["recent"])
    out.predictor_errors.update({k: v for k, v in summary["errors"].items() if math.isfinite(v)})
    out.regimes.extend(pb.RegimeSummary(**r) for r in summary["regimes"])
    return out


def decision_record_msg(record: dict[str, Any]) -> pb.Decision:
    """A stored decision (store.decisions) as the wire message: what History lists and
    Status shows as the last decision, so the two agree (plan version and time included)."""
    names = pb.Decision.DESCRIPTOR.fields_by_name
    return pb.Decision(
        **{
            k: v
            for k, v in record.items()
            if k in names and v is not None and not (isinstance(v, float) and not math.isfinite(v))
        }
    )


def pool_status_msg(pool: ReplicaPool, deployments: dict[str, Deployment]) -> pb.PoolStatus:
    """One pool's status: members, diverged members, rolling progress, and the pool
    placement's balancedness on the pool estimate (0: no placement or counts yet)."""
    from rebalancer import placement

    estimate = pool.estimate()
    est = 0.0
    if pool.phy2log is not None and estimate.sum() > 0:
        est = float(placement.balancedness(pool.phy2log, estimate, pool.shape.num_gpus))
    following = [deployments[m] for m in pool.following() if m in deployments]
    return pb.PoolStatus(
        pool=pool.name,
        members=sorted(pool.members),
        diverged=pool.diverged(),
        pool_version=pool.version,
        balancedness_estimated=est,
        members_at_target=sum(
            1 for d in following if pool.phy2log is not None and pool.at_target(d)
        ),
        members_moving=len(pool.members_moving(deployments)),
        max_moving=pool.max_moving,
        last_decision=decision_msg(pool.last_decision),
    )


def status_msg(
    dep: Deployment, last_decision: dict[str, Any] | None = None, pool: ReplicaPool | None = None
) -> pb.DeploymentStatus:
    """One deployment's status. `last_decision`: its newest stored decision (the store
    keeps them across restarts; a dry run is not one). Windows two ways: received since
    this controller started (one per stream and sequence number, as the metric
    rebalancer_windows_ingested_total counts them) and folded into the estimate (one per
    sequence number merged over every rank, what the decisions count; kept across
    restarts with the estimate)."""
    from rebalancer import placement

    estimate = dep.estimate()
    est = (
        placement.balancedness(dep.phy2log, estimate, dep.shape.num_gpus)
        if estimate.sum() > 0
        else 0.0
    )
    actual = dep.stats.balancedness_actual
    return pb.DeploymentStatus(
        deployment=dep.name,
        shape=shape_msg(dep.shape),
        placement_version=dep.version,
        balancedness_actual=actual if math.isfinite(actual) else 0.0,
        balancedness_estimated=float(est),
        connected_ranks=dep.connected_ranks,
        windows_ingested=dep.stats.windows_ingested,
        windows_folded=dep.estimator.windows,
        paused=dep.policy.paused,
        plan_in_flight=dep.plan.version if dep.plan else 0,
        plan_phase=dep.plan.state.value if dep.plan else "",
        last_decision=decision_record_msg(last_decision) if last_decision else pb.Decision(),
        plans_committed=dep.stats.plans_committed,
        plans_aborted=dep.stats.plans_aborted,
        slots_moved=dep.stats.slots_moved,
        bytes_moved=dep.stats.bytes_moved,
        mixed=dep.mixed.describe() if dep.mixed is not None else "",
        pool=pool.name if pool is not None else "",
        diverged=pool is not None and not pool.is_following(dep.name),
    )


def _finite(value: float) -> float:
    """NaN (no loss of that kind) as 0 on the wire, where JSON readers choke on NaN."""
    return value if math.isfinite(value) else 0.0


class AdminService(pb_grpc.AdminServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    async def _deployment(
        self, context: grpc.aio.ServicerContext, name: str, what: str
    ) -> Deployment:
        """The named deployment; NOT_FOUND otherwise."""
        try:
            return self.controller.deployment(name)
        except StateError as exc:
            await refuse(context, exc, what, log)
            raise

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusResponse:
        try:
            deps = (
                [self.controller.deployment(request.deployment)]
                if request.deployment
                else list(self.controller.deployments.values())
            )
        except StateError as exc:
            await refuse(context, exc, "Status", log)
            raise
        store = self.controller.store
        fleet = self.controller.fleet
        pools = sorted({p.name: p for d in deps if (p := fleet.pool_of(d)) is not None}.items())
        return pb.StatusResponse(
            deployments=[
                status_msg(d, next(iter(store.decisions(d.name, 1)), None), fleet.pool_of(d))
                for d in deps
            ],
            pools=[pool_status_msg(p, self.controller.deployments) for _, p in pools],
        )

    async def GetPlacement(
        self, request: pb.DeploymentRef, context: grpc.aio.ServicerContext
    ) -> pb.Placement:
        dep = await self._deployment(context, request.deployment, "GetPlacement")
        return placement_msg(dep.version, dep.phy2log)

    async def ForceRebalance(
        self, request: pb.ForceRebalanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.ForceRebalanceResponse:
        if request.pool:
            return await self._force_pool(request, context)
        try:
            decision, plan = self.controller.force(
                request.deployment,
                dry_run=request.dry_run,
                max_moved_fraction=request.max_moved_fraction,
            )
        except (StateError, InputError) as exc:
            await refuse(context, exc, "ForceRebalance", log)
            raise
        response = pb.ForceRebalanceResponse(
            decision=decision_msg(decision, plan.version if plan else 0)
        )
        if plan is not None:
            response.placement.CopyFrom(placement_msg(plan.version, plan.phy2log))
            response.transfers.CopyFrom(codec.encode(plan.transfers.astype("int32")))
        elif decision.candidate is not None:
            from rebalancer import placement

            dep = self.controller.deployment(request.deployment)
            response.placement.CopyFrom(placement_msg(0, decision.candidate))
            transfers = placement.transfers(
                dep.phy2log, decision.candidate, dep.shape.num_gpus, dep.shape.num_nodes
            )
            response.transfers.CopyFrom(codec.encode(transfers.astype("int32")))
        return response

    async def _force_pool(
        self, request: pb.ForceRebalanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.ForceRebalanceResponse:
        """A pool's rebalance: the response carries the pool placement (version: the pool
        placement's number), no transfers (each member's plan has its own) and each member's
        own move to it."""
        try:
            if request.deployment:
                raise InputError("name a deployment or a pool, not both")
            decision, plans = self.controller.force_pool(
                request.pool, dry_run=request.dry_run, max_moved_fraction=request.max_moved_fraction
            )
        except (StateError, InputError) as exc:
            await refuse(context, exc, "ForceRebalance", log)
            raise
        pool = self.controller.fleet.pool(request.pool)
        msg = decision_msg(decision, plans[0].version if plans else 0)
        msg.pool = pool.name
        response = pb.ForceRebalanceResponse(decision=msg)
        if decision.candidate is not None:
            response.placement.CopyFrom(
                placement_msg(
                    pool.version if decision.take and not request.dry_run else 0, decision.candidate
                )
            )
            # Each member's own move (no await since the force: no plan has ended meanwhile,
            # so each member still serves the placement its plan starts from).
            response.members.extend(
                pb.PoolMemberMove(
                    deployment=m.deployment,
                    placement_version=m.version,
                    slots_moved=m.slots_moved,
                    bytes_to_move=m.bytes_to_move,
                    moved_fraction=m.moved_fraction,
                    diverged=m.diverged,
                )
                for m in self.controller.fleet.member_moves(pool, decision.candidate)
            )
        return response

    async def GetPolicy(
        self, request: pb.DeploymentRef, context: grpc.aio.ServicerContext
    ) -> pb.Policy:
        dep = await self._deployment(context, request.deployment, "GetPolicy")
        return policy_msg(dep.policy)

    async def SetPolicy(
        self, request: pb.SetPolicyRequest, context: grpc.aio.ServicerContext
    ) -> pb.Policy:
        try:
            dep = self.controller.deployment(request.deployment)
            policy = policy_from_msg(request.policy, dep.policy)
            self.controller.set_policy(request.deployment, policy)
        except (StateError, InputError) as exc:
            await refuse(context, exc, "SetPolicy", log)
            raise
        return policy_msg(dep.policy)

    async def Pause(self, request: pb.DeploymentRef, context: grpc.aio.ServicerContext) -> pb.Empty:
        return await self._pause(request, context, True)

    async def Resume(
        self, request: pb.DeploymentRef, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        return await self._pause(request, context, False)

    async def _pause(
        self, request: pb.DeploymentRef, context: grpc.aio.ServicerContext, paused: bool
    ) -> pb.Empty:
        try:
            self.controller.set_paused(request.deployment, paused)
        except StateError as exc:
            await refuse(context, exc, "Pause" if paused else "Resume", log)
            raise
        return pb.Empty()

    async def Contingency(
        self, request: pb.DeploymentRef, context: grpc.aio.ServicerContext
    ) -> pb.ContingencyResponse:
        dep = await self._deployment(context, request.deployment, "Contingency")
        made = self.controller.contingency.get(dep.name)
        if made is None:
            return pb.ContingencyResponse(planned=False)
        losses = [
            planned_loss_msg(loss, made.base_version, len(made.losses)) for loss in made.losses
        ]
        return pb.ContingencyResponse(
            planned=True,
            base_version=made.base_version,
            computed_at=made.computed_at,
            balancedness_now=made.healthy,
            losses=losses,
        )

    async def Regimes(
        self, request: pb.DeploymentRef, context: grpc.aio.ServicerContext
    ) -> pb.RegimesResponse:
        dep = await self._deployment(context, request.deployment, "Regimes")
        return regimes_msg(dep)

    async def History(
        self, request: pb.HistoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.HistoryResponse:
        dep = await self._deployment(context, request.deployment, "History")
        limit = request.limit or 50
        store = self.controller.store
        plans = [pb.PlanRecord(**vars(p)) for p in store.plans(dep.name, limit)]
        decisions = [decision_record_msg(rec) for rec in store.decisions(dep.name, limit)]
        sets = [
            pb.ContingencySummary(
                time=r["time"],
                base_version=r["base_version"],
                balancedness_now=_finite(r["healthy"]),
                rank_loss_worst=_finite(r["rank_worst"]),
                rank_loss_mean=_finite(r["rank_mean"]),
                node_loss_worst=_finite(r["node_worst"]),
                node_loss_mean=_finite(r["node_mean"]),
                node_loss_unserved=r["node_unserved"],
            )
            for r in store.contingency_history(dep.name, limit)
        ]
        return pb.HistoryResponse(plans=plans, decisions=decisions, contingency_sets=sets)
