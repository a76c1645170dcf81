"""SetPolicy over real gRPC: the flat Policy message lands in PolicyConfig's sections (the
estimator the deployment's loop runs, the cost its gate charges, the row the store keeps),
and a bad value in a section is refused with INVALID_ARGUMENT, changing nothing."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.store import Store
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import client_options
from tests.integration.conftest import start_controller

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=6, num_gpus=2, expert_bytes=10
)


def test_set_policy_reaches_the_sections_and_bad_values_change_nothing(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    ctl = start_controller(db, PolicyConfig(paused=True))
    try:
        assert ctl.server is not None
        with grpc.insecure_channel(ctl.server.address, options=client_options()) as channel:
            pb_grpc.WorkerServiceStub(channel).Register(
                pb.RegisterRequest(deployment="d", rank=0, shape=SHAPE, worker_id="w0"), timeout=10
            )
            admin = pb_grpc.AdminServiceStub(channel)
            policy = admin.GetPolicy(pb.DeploymentRef(deployment="d"), timeout=10)
            policy.estimate_window, policy.link_bandwidth_gbps, policy.decay = 4, 5.0, 0.6
            admin.SetPolicy(pb.SetPolicyRequest(deployment="d", policy=policy), timeout=10)

            def sections() -> tuple[object, ...]:
                dep = ctl.server.controller.deployments["d"]  # type: ignore[union-attr]
                return dep.policy.estimator, dep.loop.estimator.config, dep.policy.cost

            estimator, running, cost = ctl.call(sections)
            assert (estimator.window, estimator.decay, cost.inter_node_gbps) == (4, 0.6, 5.0)
            assert running == estimator

            bad = admin.GetPolicy(pb.DeploymentRef(deployment="d"), timeout=10)
            bad.link_bandwidth_gbps = 0.0
            with pytest.raises(grpc.RpcError) as err:
                admin.SetPolicy(pb.SetPolicyRequest(deployment="d", policy=bad), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "link_bandwidth_gbps" in (err.value.details() or "")
            assert ctl.call(sections) == (estimator, running, cost)
            assert admin.GetPolicy(pb.DeploymentRef(deployment="d"), timeout=10) == policy
    finally:
        ctl.stop()
    (row,) = Store(db).load_deployments()
    assert (
        row.policy["estimate_window"],
        row.policy["link_bandwidth_gbps"],
        row.policy["decay"],
    ) == (4, 5.0, 0.6)
