"""Fixtures: a real controller on loopback, and real worker processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rebalancer.controller.config import ControllerConfig
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import client_options


def start_controller(
    db: Path | str, policy: PolicyConfig | None = None, ready: bool = False, **kw: object
) -> EmbeddedController:
    """A controller on loopback; `ready`: returns once its decision process can decide
    (its imports take seconds on a loaded machine: an engine test's ranks, forked ready
    from a zygote, would otherwise run their steps before the first plan could start)."""
    kw.setdefault("drain_seconds", 0.0)
    config = ControllerConfig(port=0, db_path=str(db), policy=policy or PolicyConfig(), **kw)  # type: ignore[arg-type]
    ctl = EmbeddedController(config)
    ctl.start()
    if ready:
        assert ctl.server is not None
        ctl.server.decision_process.wait_ready()
    return ctl


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[EmbeddedController]:
    ctl = start_controller(tmp_path / "controller.sqlite")
    yield ctl
    ctl.stop()


@pytest.fixture
def worker_stub(controller: EmbeddedController) -> Iterator[pb_grpc.WorkerServiceStub]:
    assert controller.server is not None
    with grpc.insecure_channel(controller.server.address, options=client_options()) as channel:
        yield pb_grpc.WorkerServiceStub(channel)
