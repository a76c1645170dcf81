"""Pools through the AdminService, `rebalancer admin` and the Prometheus exposition, on a
real server whose ranks are real WorkerAgents naming a pool (plans answered at once, as
in test_admin.py): status grouped by pool, `force --pool` rolling the pool placement
out, precise errors for an unknown pool and a mismatched member, promtool on the
exposition with the pool series."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from rebalancer import placement
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.launch.instant import InstantRank
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec
from rebalancer.wire.channel import client_options
from rebalancer.wire.link import Link
from rebalancer.wire.shape import shape_of
from tests.integration.conftest import start_controller
from tests.integration.test_admin import admin, real_counts
from tests.unit.deploy.conftest import find_tool, missing
from worker_hooks.agent import AgentConfig, WorkerAgent

L, E, P, G = 4, 256, 288, 4
SHAPE = pb.ModelShape(
    num_layers=L, num_logical_experts=E, num_physical_slots=P, num_gpus=G, expert_bytes=1 << 20
)


class PoolRank(InstantRank):
    def __init__(self, deployment: str, rank: int, address: str, pool: str) -> None:
        self.version = 0
        self.agent = WorkerAgent(
            AgentConfig(Link(address, deployment=deployment, pool=pool), rank, shape_of(SHAPE)),
            self,
            lambda: self.version,
        )


def settled(ctl: EmbeddedController) -> bool:
    """No pool decision or plan in flight, every member on the pool placement (if any)."""

    def check(c: Any) -> bool:
        pool = c.fleet.pools["fleet"]
        deps = [c.deployments[d] for d in ("m1", "m2")]
        return (
            not pool.deciding
            and all(d.plan is None for d in deps)
            and (pool.phy2log is None or all(np.array_equal(d.phy2log, pool.phy2log) for d in deps))
        )

    return bool(ctl.call(lambda: check(ctl.server.controller)))  # type: ignore[union-attr]


def wait_for(fn: object, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not fn():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[EmbeddedController, list[PoolRank]]]:
    # The policy never finds a gain worth it (threshold 1.0): plans here are forced.
    # ready: the pool's first decision must not wait on the decision process's imports,
    # which took longer than `settled`'s wait beside a CPU hog.
    ctl = start_controller(
        tmp_path / "c.sqlite",
        PolicyConfig(min_windows=1, gain_threshold=1.0),
        ready=True,
        metrics_port=0,
    )
    assert ctl.server is not None
    ranks = [
        PoolRank(dep, r, ctl.server.address, "fleet") for dep in ("m1", "m2") for r in range(G)
    ]
    try:
        for r in ranks:
            r.agent.start()
        for r in ranks:
            assert r.agent.connected.wait(10)
        counts = real_counts()
        for seq in range(3):
            for r in ranks:
                r.agent.submit_window(seq * 8, 8, 0, counts // G, None)
        wait_for(
            lambda: (
                ctl.call(lambda: ctl.server.controller.fleet.pools["fleet"].loop.estimator.windows)
                >= 6
            )
        )  # type: ignore[union-attr]
        wait_for(lambda: settled(ctl))
        yield ctl, ranks
    finally:
        for r in ranks:
            r.agent.stop()
        ctl.stop()


def test_status_force_pool_and_metrics(live: tuple[EmbeddedController, list[PoolRank]]) -> None:
    ctl, ranks = live
    code, out, err = admin(ctl, "force", "--pool", "nope", token=None)
    assert code != 0 and "unknown pool 'nope'" in err
    code, _, err = admin(ctl, "force", token=None)
    assert code == 2 and "a deployment or --pool" in err
    code, out, err = admin(ctl, "--json", "force", "--pool", "fleet", token=None)
    assert code == 0, err
    assert json.loads(out)["outcome"] == "forced" and json.loads(out)["pool"] == "fleet"
    # Rolled out one member at a time, both end on the pool placement.
    wait_for(lambda: settled(ctl))
    assert all(r.version >= 1 for r in ranks)
    pool_phy2log, placements = ctl.call(
        lambda: (  # type: ignore[union-attr]
            ctl.server.controller.fleet.pools["fleet"].phy2log,
            [ctl.server.controller.deployments[d].phy2log for d in ("m1", "m2")],
        )
    )
    assert all(np.array_equal(p, pool_phy2log) for p in placements)
    code, out, _ = admin(ctl, "--json", "status", token=None)
    reply = json.loads(out)
    (pool,) = reply["pools"]
    assert (
        pool["pool"] == "fleet"
        and pool["members"] == ["m1", "m2"]
        and int(pool["members_at_target"]) == 2
    )
    assert {d["deployment"]: d["pool"] for d in reply["deployments"]} == {
        "m1": "fleet",
        "m2": "fleet",
    }
    code, text, _ = admin(ctl, "status", token=None)
    assert text.startswith("pool fleet: placement ") and "2 members (0 diverged)" in text
    assert "2/2 on the pool placement" in text
    # A member of another shape: refused with the field named, nothing created.
    with grpc.insecure_channel(ctl.server.address, options=client_options()) as channel:  # type: ignore[union-attr]
        stub = pb_grpc.WorkerServiceStub(channel)
        other = pb.ModelShape()
        other.CopyFrom(SHAPE)
        other.num_physical_slots = 260
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(
                pb.RegisterRequest(deployment="m3", rank=0, shape=other, pool="fleet"), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "num_slots is 260, the pool's 288" in refused.value.details()
    assert ctl.call(lambda: "m3" not in ctl.server.controller.deployments)  # type: ignore[union-attr]
    port = ctl.server.metrics_port  # type: ignore[union-attr]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'rebalancer_pool_members{pool="fleet"} 2.0' in text
    assert 'rebalancer_pool_members_at_target{pool="fleet"} 2.0' in text
    assert 'rebalancer_pool_member_diverged{deployment="m1",pool="fleet"} 0.0' in text
    promtool = find_tool("promtool")
    if promtool is None:
        missing("promtool", ".ci/run provides it; `.ci/run --tools` alone")
    assert promtool is not None
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_fresh_member_is_offered_the_pool_placement_at_register(
    live: tuple[EmbeddedController, list[PoolRank]],
) -> None:
    ctl, ranks = live
    assert admin(ctl, "force", "--pool", "fleet", token=None)[0] == 0
    wait_for(lambda: settled(ctl))
    joiner = WorkerAgent(
        AgentConfig(Link(ctl.server.address, deployment="m9", pool="fleet"), 0, shape_of(SHAPE)),
        ranks[0],  # type: ignore[union-attr]
        lambda: 0,
    )
    joiner.start()
    try:
        assert joiner.warm_offered.wait(10) and joiner.warm_start is not None
        assert joiner.warm_start.version == 1  # the first version of the new deployment
        pool_phy2log = ctl.call(lambda: ctl.server.controller.fleet.pools["fleet"].phy2log)  # type: ignore[union-attr]
        from rebalancer.wire import codec

        assert np.array_equal(codec.decode(joiner.warm_start.phy2log, "warm"), pool_phy2log)
    finally:
        joiner.stop()


def test_pool_dry_run_shows_each_members_own_move(
    live: tuple[EmbeddedController, list[PoolRank]],
) -> None:
    """Issue 34: `force --pool P --dry-run` showed the pool placement against the pool's last
    one only, while a member that had been balanced on its own serves another placement and
    moves more. Each member's own move is shown: what its plan would move from the
    placement it serves, and the dry run starts nothing."""
    ctl, _ = live
    # m2 balanced on its own (as a member does while diverged): it serves v1, m1 still v0.
    code, _, err = admin(ctl, "force", "m2", token=None)
    assert code == 0, err
    wait_for(
        lambda: ctl.call(
            lambda: (
                ctl.server.controller.deployments["m2"].plan is None  # type: ignore[union-attr]
                and ctl.server.controller.deployments["m2"].version == 1
            )
        )
    )  # type: ignore[union-attr]
    with grpc.insecure_channel(ctl.server.address, options=client_options()) as channel:  # type: ignore[union-attr]
        reply = pb_grpc.AdminServiceStub(channel).ForceRebalance(
            pb.ForceRebalanceRequest(pool="fleet", dry_run=True), timeout=10
        )
    candidate = codec.decode(reply.placement.phy2log, "phy2log")
    served = ctl.call(
        lambda: {
            d: (
                ctl.server.controller.deployments[d].version,  # type: ignore[union-attr]
                ctl.server.controller.deployments[d].phy2log.copy(),
            )  # type: ignore[union-attr]
            for d in ("m1", "m2")
        }
    )
    moves = {m.deployment: m for m in reply.members}
    assert sorted(moves) == ["m1", "m2"]
    for name, (version, phy2log) in served.items():
        slots = int(placement.transfers(phy2log, candidate, G, 1).shape[0])
        m = moves[name]
        assert (m.placement_version, m.slots_moved, m.bytes_to_move, m.diverged) == (
            version,
            slots,
            slots * (1 << 20),
            False,
        ), (name, m)
        assert m.moved_fraction == pytest.approx(slots / (L * P))
    # The pool's own number is m1's (the pool's base); m2's move is its own, not that one.
    assert moves["m1"].slots_moved == round(reply.decision.moved_fraction * L * P)
    assert moves["m2"].slots_moved != moves["m1"].slots_moved
    code, out, err = admin(ctl, "force", "--pool", "fleet", "--dry-run", token=None)
    assert code == 0, err
    m2 = moves["m2"]
    assert "each member's own move, from the placement it serves:" in out, out
    assert (
        f"  m2 (v1): {m2.slots_moved} slots ({m2.moved_fraction:.1%}), "
        f"{m2.bytes_to_move / 1e6:.1f} MB" in out
    ), out
    code, out, err = admin(ctl, "--json", "force", "--pool", "fleet", "--dry-run", token=None)
    assert code == 0, err
    assert {m["deployment"]: int(m["slots_moved"]) for m in json.loads(out)["members"]} == {
        name: m.slots_moved for name, m in moves.items()
    }
    # Nothing started: no plan in flight, both members where they were.
    assert ctl.call(
        lambda: [
            (d.version, d.plan)
            for d in (
                ctl.server.controller.deployments["m1"],  # type: ignore[union-attr]
                ctl.server.controller.deployments["m2"],
            )
        ]
    ) == [(0, None), (1, None)]  # type: ignore[union-attr]
