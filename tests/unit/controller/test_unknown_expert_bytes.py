"""Issue 24: a Register with expert_bytes 0 does not know them yet (SGLang's warm start
registers before the engine loaded its weights); the first Register that knows them fills
them in, for the deployment and its pool, and a restarted controller keeps both."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from rebalancer.wire.shape import UNKNOWN_EXPERT_BYTES, ClusterShape

# expert_bytes as wire/shape.py shape_of makes it from a Register's 0: the default.
EARLY = ClusterShape(num_layers=2, num_logical=8, num_slots=8, num_gpus=2)
LOADED = replace(EARLY, expert_bytes=4096)


def _register(
    ctl: Controller,
    name: str,
    shape: ClusterShape,
    worker: str,
    unknown: frozenset[str] = frozenset(),
    pool: str = "p",
) -> None:
    for rank in range(shape.num_gpus):
        session, _ = ctl.register(
            name, rank, shape, 0, None, f"{worker}-{rank}", pool=pool, unknown=unknown
        )
        ctl.detach(session.session_id)


def _stored_bytes(path: Path, name: str) -> int | None:
    (row,) = [r for r in Store(path).load_deployments() if r.name == name]
    return row.shape.get("expert_bytes")


def test_expert_bytes_unknown_at_register_are_filled_in_later(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    ctl = Controller(Store(path), PolicyConfig())
    _register(ctl, "a", EARLY, "early", UNKNOWN_EXPERT_BYTES)
    assert (
        _stored_bytes(path, "a") is None
        and ctl.deployment("a").unknown_fields == UNKNOWN_EXPERT_BYTES
    )
    # A restart in between keeps them unknown.
    ctl = Controller(Store(path), PolicyConfig())
    _register(ctl, "a", LOADED, "loaded")  # before the fix: FAILED_PRECONDITION (shape change)
    dep = ctl.deployment("a")
    assert dep.shape.expert_bytes == 4096 and dep.unknown_fields == frozenset()
    assert _stored_bytes(path, "a") == 4096
    assert ctl.fleet.pools["p"].shape.expert_bytes == 4096
    # Known now: a Register that does not know them takes them; other bytes are refused.
    _register(ctl, "a", EARLY, "early2", UNKNOWN_EXPERT_BYTES)
    with pytest.raises(StateError, match="expert_bytes is 8192") as err:
        _register(ctl, "a", replace(EARLY, expert_bytes=8192), "other")
    assert err.value.code == "FAILED_PRECONDITION"
    assert ctl.deployment("a").shape.expert_bytes == 4096 and _stored_bytes(path, "a") == 4096
    restarted = Controller(Store(path), PolicyConfig())
    assert restarted.deployment("a").shape.expert_bytes == 4096
    assert restarted.deployment("a").unknown_fields == frozenset()
    assert restarted.fleet.pools["p"].shape.expert_bytes == 4096
    assert restarted.fleet.pools["p"].unknown_fields == frozenset()


def test_a_pool_created_by_a_member_without_expert_bytes_takes_the_first_known(
    tmp_path: Path,
) -> None:
    ctl = Controller(Store(tmp_path / "c.sqlite"), PolicyConfig())
    _register(ctl, "a", EARLY, "a-early", UNKNOWN_EXPERT_BYTES)
    _register(ctl, "b", EARLY, "b-early", UNKNOWN_EXPERT_BYTES)  # both unknown: joins
    assert ctl.fleet.pools["p"].unknown_fields == UNKNOWN_EXPERT_BYTES
    _register(ctl, "b", LOADED, "b-loaded")
    assert ctl.fleet.pools["p"].shape.expert_bytes == 4096
    with pytest.raises(
        StateError, match="cannot join pool 'p': its shape field expert_bytes is 8192"
    ):
        _register(ctl, "c", replace(EARLY, expert_bytes=8192), "c")
    assert "c" not in ctl.registry.deployments  # nothing created on a refusal
    _register(ctl, "a", LOADED, "a-loaded")
    assert ctl.deployment("a").shape.expert_bytes == 4096
