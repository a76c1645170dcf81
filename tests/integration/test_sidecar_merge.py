"""An EP group's pods merged at the leader pod's sidecar (rebalancer/sidecar/merge.py), with
real processes: a controller, the leader's sidecar (pod a: ranks 0-1, listening for its
group on TCP), a follower's sidecar (pod b: ranks 2-3) and 4 gloo worker processes
(tests/integration/sidecar_worker.py) whose hooks point at their own pod's socket.

(a) the controller sees ONE session for the group, naming all 4 ranks; what it folded is
    exactly the sum of what the 4 ranks routed; a plan is committed on every rank through
    the fan-out (invariants 1, 2, 5 as in test_sidecar.py);
(b) the leader's sidecar SIGKILLed: the follower streams straight to the controller within
    its wait, windows go on being folded, every rank goes on serving; the leader back:
    the follower returns to it and the group is one session again;
(c) a follower's Register that does not fit (another deployment or shape, the leader's
    own ranks, ranks outside the group, no token or a wrong one) is refused with a precise
    status, and changes nothing: a fitting one is accepted after them;
(d) TLS on the leader's port: a follower checking it with the CA is served, plain text is
    not; a leader whose certificate file is missing still serves its ranks.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from rebalancer.controller.embedded import EmbeddedController
from rebalancer.launch.processes import free_port
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import sync_channel
from rebalancer.wire.link import Link
from tests.integration.conftest import start_controller
from tests.integration.test_end_to_end import FAST_POLICY, small_config
from tests.integration.test_security import pki  # noqa: F401 - the fixture, used below
from tests.integration.test_sidecar import (
    Cluster,
    assert_same_math_and_one_version_per_step,
    on_loop,
    sessions,
    wait_for,
)
from tests.integration.until import stop_together

MERGED = {"ranks 0-3 (pod ns/a)"}  # the group's one session, held by the leader's sidecar


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()  # every process reaped, whatever happened


def leader_flags(port: int, *extra: str) -> tuple[str, ...]:
    return ("--merge-listen", f"127.0.0.1:{port}", "--group-ranks", "0-3", *extra)


def follower_flags(port: int) -> tuple[str, ...]:
    return ("--merge-leader", f"127.0.0.1:{port}", "--merge-wait", "2", "--merge-retry", "1")


def group_ranks(ctl: EmbeddedController) -> list[tuple[int, ...]]:
    """The ranks of each live session of the deployment."""
    return on_loop(
        ctl,
        lambda c: (
            sorted(tuple(s.ranks) for s in c.deployments["demo"].live_sessions())
            if "demo" in c.deployments
            else []
        ),
    )


def tokens_folded(ctl: EmbeddedController) -> int:
    return int(
        on_loop(
            ctl,
            lambda c: c.deployments["demo"].stats.tokens_folded if "demo" in c.deployments else 0,
        )
    )


@pytest.mark.slow
def test_group_merged_at_the_leader_one_session_summed_windows_and_a_plan_on_every_rank(
    cluster: Cluster, tmp_path: Path
) -> None:
    config = small_config(steps=200)
    port = free_port()
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY)
    try:
        assert ctl.server is not None
        address = ctl.server.address
        a = cluster.sidecar("a", address, *leader_flags(port))
        b = cluster.sidecar("b", address, *follower_flags(port))
        workers = cluster.workers(config, ["--wait-version", "1"])  # until a plan commits
        wait_for(lambda: sessions(ctl) == MERGED, 60, "the group as one session")
        assert group_ranks(ctl) == [(0, 1, 2, 3)]
        assert [w.wait(timeout=200) for w in workers] == [0] * 4
        results = cluster.results(config)
        routed = sum(r["steps"] for r in results) * config.tokens * config.top_k * config.layers
        # Every window of every rank reached the controller through the one session: what
        # it folded is the sum of what the ranks routed, exactly (the follower's windows
        # summed with the leader's ranks' per seq, none lost, none twice).
        wait_for(lambda: tokens_folded(ctl) == routed, 30, f"{routed} tokens folded")
        assert sessions(ctl) == MERGED  # never split: the follower went through the leader
        seen = {pod.name: pod.metrics() for pod in (a, b)}
        assert [b.stop(), a.stop()] == [0, 0]  # SIGTERM drains
        dep = on_loop(ctl, lambda c: c.deployments["demo"])
    finally:
        ctl.stop()
    assert dep.stats.plans_committed >= 1
    assert_same_math_and_one_version_per_step(results)
    assert all(r["commits"] and r["version"] == dep.version for r in results)  # every rank
    # The leader got the follower's windows (2 ranks each) beside its own ranks'.
    assert (
        seen["a"]["rebalancer_sidecar_windows_in_total"]
        >= 2 * seen["b"]["rebalancer_sidecar_windows_out_total"]
    )
    for m in seen.values():
        assert m['rebalancer_sidecar_plans_total{outcome="committed"}'] == dep.stats.plans_committed


@pytest.mark.slow
def test_leader_sidecar_killed_follower_goes_direct_then_returns_ranks_keep_serving(
    cluster: Cluster, tmp_path: Path
) -> None:
    config = small_config(steps=10**9, timeout_seconds=150.0)
    stop = tmp_path / "stop"
    port = free_port()
    ctl = start_controller(tmp_path / "c.sqlite", replace(FAST_POLICY, paused=True))
    try:
        assert ctl.server is not None
        address = ctl.server.address
        a = cluster.sidecar("a", address, *leader_flags(port, "--merge-wait", "2"))
        cluster.sidecar("b", address, *follower_flags(port))
        workers = cluster.workers(config, ["--step-sleep", "0.02", "--stop-file", str(stop)])
        wait_for(lambda: sessions(ctl) == MERGED, 60, "the group as one session")
        a.proc.send_signal(signal.SIGKILL)  # the merging sidecar is lost
        a.proc.wait(10)
        killed_at = time.monotonic()
        wait_for(lambda: group_ranks(ctl) == [(2, 3)], 30, "the follower streaming direct")
        direct_after = time.monotonic() - killed_at
        folded = tokens_folded(ctl)
        wait_for(lambda: tokens_folded(ctl) > folded, 15, "windows folded, the leader gone")
        a = cluster.sidecar("a", address, *leader_flags(port, "--merge-wait", "2"))
        wait_for(lambda: group_ranks(ctl) == [(0, 1, 2, 3)], 60, "the follower back at the leader")
        folded = tokens_folded(ctl)
        wait_for(lambda: tokens_folded(ctl) > folded, 15, "windows folded, merged again")
        assert sessions(ctl) == MERGED
        stop_together(stop, range(4))
        assert [w.wait(timeout=120) for w in workers] == [0] * 4
    finally:
        ctl.stop()
    assert direct_after < 20.0  # the follower's wait (2 s) and its backoff, not forever
    for rank in range(4):  # no rank stopped serving for the leader sidecar's loss
        gaps = np.diff(cluster.step_times(rank))
        assert gaps.max() < 2.0, f"rank {rank}: a step took {gaps.max():.1f} s"


def _follower_request(**fields: object) -> pb.RegisterRequest:
    base: dict[str, object] = dict(
        deployment="demo",
        rank=2,
        ranks=[2, 3],
        pod="ns/b",
        shape=SHAPE,
        worker_id="sidecar ns/b",
    )
    base.update(fields)
    return pb.RegisterRequest(**base)  # type: ignore[arg-type]


SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=8, num_gpus=4, num_nodes=1
)


def _refused(
    stub: pb_grpc.WorkerServiceStub, request: pb.RegisterRequest, **kw: object
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.Register(request, timeout=10, **kw)  # type: ignore[arg-type]
    return info.value


def test_a_follower_register_that_does_not_fit_is_refused_precisely_and_changes_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    port = free_port()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    # No controller: the leader serves its group whatever upstream does.
    cluster.sidecar(
        "a",
        f"127.0.0.1:{free_port()}",
        "--deployment",
        "demo",
        "--token-file",
        str(token),
        *leader_flags(port),
    )
    auth = (("authorization", "Bearer s3cret"),)
    with (
        grpc.insecure_channel(cluster.target("a")) as local,
        grpc.insecure_channel(f"127.0.0.1:{port}") as remote,
    ):
        # The leader's own rank 0 tells the group's shape (on its socket: no token there).
        rank0 = pb_grpc.WorkerServiceStub(local).Register(
            pb.RegisterRequest(deployment="demo", rank=0, shape=SHAPE), timeout=10
        )
        assert rank0.session_id
        stub = pb_grpc.WorkerServiceStub(remote)
        no_token = _refused(stub, _follower_request())
        assert no_token.code() == grpc.StatusCode.UNAUTHENTICATED, no_token.details()
        wrong = _refused(stub, _follower_request(), metadata=(("authorization", "Bearer nope"),))
        assert wrong.code() == grpc.StatusCode.PERMISSION_DENIED, wrong.details()
        cases = [
            (
                _follower_request(deployment="other"),
                grpc.StatusCode.FAILED_PRECONDITION,
                "follower ns/b (ranks 2-3) registers for deployment 'other', "
                "this group serves 'demo'",
            ),
            (
                _follower_request(shape=replace_shape(num_logical_experts=8)),
                grpc.StatusCode.FAILED_PRECONDITION,
                "follower ns/b (ranks 2-3) reports shape L=2 E=8",
            ),
            (
                _follower_request(rank=1, ranks=[1, 2]),
                grpc.StatusCode.INVALID_ARGUMENT,
                "follower ns/b (ranks 1-2): rank 1 is this leader pod's own rank",
            ),
            (
                _follower_request(ranks=[3, 5]),
                grpc.StatusCode.INVALID_ARGUMENT,
                "follower ns/b (ranks 3,5): rank 5 is not one of this group's ranks 0-3",
            ),
        ]
        for request, code, words in cases:
            refused = _refused(stub, request, metadata=auth)
            assert (refused.code(), words in (refused.details() or "")) == (code, True), (
                refused.code(),
                refused.details(),
            )
        # Nothing changed: the follower that fits is taken, at the group's first window.
        taken = stub.Register(_follower_request(), timeout=10, metadata=auth)
        assert taken.session_id and taken.next_window_seq == 0
        again = _refused(stub, _follower_request(rank=3, ranks=[3]), metadata=auth)
        assert again.code() == grpc.StatusCode.ALREADY_EXISTS, again.details()
        assert "ranks 2-3 are one follower's session here" in (again.details() or "")
    # A sidecar that does not lead a merge refuses a group session as before.
    cluster.sidecar("b", f"127.0.0.1:{free_port()}")
    with grpc.insecure_channel(cluster.target("b")) as plain:
        refused = _refused(pb_grpc.WorkerServiceStub(plain), _follower_request())
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not merge its EP group" in (refused.details() or "")


def replace_shape(**fields: int) -> pb.ModelShape:
    shape = pb.ModelShape()
    shape.CopyFrom(SHAPE)
    for name, value in fields.items():
        setattr(shape, name, value)
    return shape


def test_merge_flags_that_do_not_fit_are_refused_in_one_line(tmp_path: Path) -> None:
    def sidecar(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "rebalancer",
                "sidecar",
                "--listen",
                f"unix://{tmp_path}/s.sock",
                "--controller",
                "127.0.0.1:1",
                "--ranks",
                "0-1",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    for flags, words in [
        (("--merge-listen", "127.0.0.1:0"), "--merge-listen needs the group's ranks"),
        (("--merge-listen", "127.0.0.1:0", "--group-ranks", "2-3"), "rank 0 is not one of them"),
        (
            ("--merge-listen", "127.0.0.1:0", "--group-ranks", "0-3", "--merge-leader", "x:1"),
            "not both",
        ),
        (("--group-ranks", "0-3"), "give --merge-listen"),
        (("--merge-leader", "notahost:xx"), "notahost"),
    ]:
        done = sidecar(*flags)
        assert done.returncode == 2, (flags, done.returncode, done.stderr)
        assert words in done.stderr and "Traceback" not in done.stderr, (flags, done.stderr)


def test_the_leaders_port_speaks_tls_and_a_missing_certificate_never_stops_the_sidecar(
    cluster: Cluster,
    pki: Path,  # noqa: F811 - the fixture imported above
) -> None:
    port = free_port()
    cluster.sidecar(
        "a",
        f"127.0.0.1:{free_port()}",
        *leader_flags(port),
        "--merge-tls-cert",
        str(pki / "server.crt"),
        "--merge-tls-key",
        str(pki / "server.key"),
    )
    with grpc.insecure_channel(cluster.target("a")) as local:
        pb_grpc.WorkerServiceStub(local).Register(
            pb.RegisterRequest(deployment="demo", rank=0, shape=SHAPE), timeout=10
        )
    with sync_channel(Link(f"127.0.0.1:{port}", ca_file=str(pki / "ca.crt"))) as secure:
        taken = pb_grpc.WorkerServiceStub(secure).Register(_follower_request(), timeout=10)
        assert taken.session_id
    with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:
        refused = _refused(pb_grpc.WorkerServiceStub(plain), _follower_request(rank=3, ranks=[3]))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused.details()
    # The certificate's Secret not there (yet): the sidecar serves its ranks all the same
    # (Cluster.sidecar waits for its startup probe) and does not listen for followers.
    port = free_port()
    b = cluster.sidecar(
        "b",
        f"127.0.0.1:{free_port()}",
        "--merge-listen",
        f"127.0.0.1:{port}",
        "--group-ranks",
        "0-3",
        "--merge-tls-cert",
        str(pki / "missing.crt"),
        "--merge-tls-key",
        str(pki / "server.key"),
    )
    assert b.proc.poll() is None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as nobody:
        gone = _refused(pb_grpc.WorkerServiceStub(nobody), _follower_request())
        assert gone.code() == grpc.StatusCode.UNAVAILABLE
