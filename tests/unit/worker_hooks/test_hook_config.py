"""HookConfig in sections: each field documented where it is declared, each choice a
Literal, a section of the wrong kind or a bad choice refused by name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

import pytest

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.shape import ClusterShape
from tests.unit.worker_hooks.test_warm import NoPlans
from worker_hooks import config as config_module
from worker_hooks.agent import WorkerAgent
from worker_hooks.config import DispatchConfig, HookConfig, Link, MigrationConfig, WindowConfig
from worker_hooks.hook import agent_config

SECTIONS = ("windows", "dispatch", "commit", "migration", "pool")


def _hook_config() -> HookConfig:
    return HookConfig(
        link=Link("127.0.0.1:1", deployment="d"),
        rank=0,
        shape=ClusterShape(num_layers=2, num_logical=4, num_slots=8, num_gpus=2, expert_bytes=0),
    )


def test_every_field_of_config_py_has_its_docstring() -> None:
    tree = ast.parse(Path(config_module.__file__).read_text())
    undocumented = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                following = body[i + 1] if i + 1 < len(body) else None
                if not (
                    isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)
                ):
                    undocumented.append(f"{cls.name}.{node.target.id}")
    assert undocumented == []


def test_the_choices_are_literals() -> None:
    for section, name in ((DispatchConfig, "mode"), (MigrationConfig, "transport")):
        hint = get_type_hints(section)[name]
        assert get_origin(hint) is Literal and len(get_args(hint)) >= 3, (section.__name__, name)


def test_sections_and_choices_are_checked_by_name() -> None:
    config = _hook_config()
    assert [f.name for f in dataclasses.fields(config)][-len(SECTIONS) :] == list(SECTIONS)
    with pytest.raises(TypeError, match="HookConfig.windows must be a WindowConfig, got dict"):
        dataclasses.replace(config, windows={"steps": 8})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        DispatchConfig(mode="even")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="WindowConfig.steps must be >= 1, got 0"):
        WindowConfig(steps=0)
    with pytest.raises(ValueError, match='"load\\+shared" needs shared_expert=True'):
        dataclasses.replace(config, dispatch=DispatchConfig(mode="load+shared"))
    assert config.rows_per_rank == 4 and config.migration.transport == "p2p"


@pytest.mark.parametrize(
    ("address", "message"),
    [
        (
            "notahost:xx",
            "controller address 'notahost:xx': port 'xx' is not a number from 1 to 65535",
        ),
        ("rebalancer", "controller address 'rebalancer' must be host:port"),
        ("a b:50051", "'a b' is not a host name or IP address"),
    ],
)
def test_a_controller_address_grpc_cannot_use_is_refused(address: str, message: str) -> None:
    """Issue 34: an address gRPC would only fail on at every connection attempt is refused
    when the hook is configured, by name, as the sidecar refuses its --controller and the
    engines their REBALANCER_ADDRESS (one rule: wire.channel.check_address)."""
    with pytest.raises(ValueError) as info:
        dataclasses.replace(_hook_config(), link=Link(address, deployment="d"))
    assert str(info.value).startswith("HookConfig.link.address: ") and message in str(info.value), (
        str(info.value)
    )
    for good in ("unix:///run/rebalancer/agent.sock", "rebalancer.ns.svc:50051", "[::1]:50051"):
        config = dataclasses.replace(_hook_config(), link=Link(good, deployment="d"))
        assert config.link.address == good


def test_a_window_longer_than_the_wire_carries_is_refused() -> None:
    """Issue 34: a window's steps travel as a uint32, which the sidecar and the controller
    refuse beyond; the setting is held to it (as REBALANCER_WINDOW_STEPS is)."""
    with pytest.raises(
        ValueError,
        match=r"WindowConfig.steps must be at most 4294967295 .*got 100000000000000000000",
    ):
        WindowConfig(steps=10**20)
    assert WindowConfig(steps=2**32 - 1).steps == 2**32 - 1


# What a rank told the controller at Register when HookConfig held the shape's fields
# itself (issue 31): its pb.ModelShape spelled field by field, the dispatch mode and top_k.
def _flat_register(
    L: int, E: int, P: int, G: int, N: int, expert_bytes: int, top_k: int, mode: str
) -> tuple[bytes, str, int]:
    shape = pb.ModelShape(
        num_layers=L,
        num_logical_experts=E,
        num_physical_slots=P,
        num_gpus=G,
        num_nodes=N,
        expert_bytes=expert_bytes,
    )
    return shape.SerializeToString(deterministic=True), mode, top_k


@pytest.mark.parametrize(
    ("shape", "dispatch", "shared_expert", "before"),
    [
        (
            ClusterShape(num_layers=2, num_logical=4, num_slots=8, num_gpus=2, expert_bytes=0),
            DispatchConfig(),
            False,
            _flat_register(2, 4, 8, 2, 1, 0, 0, "split"),
        ),
        (
            ClusterShape(
                num_layers=58,
                num_logical=256,
                num_slots=288,
                num_gpus=32,
                num_nodes=4,
                expert_bytes=44 << 20,
                top_k=8,
            ),
            DispatchConfig(mode="load+shared"),
            True,
            _flat_register(58, 256, 288, 32, 4, 44 << 20, 8, "load+shared"),
        ),
        (
            ClusterShape(
                num_layers=3,
                num_logical=8,
                num_slots=12,
                num_gpus=4,
                num_nodes=2,
                expert_bytes=0,
                dispatch_mode="load",
                top_k=2,
            ),
            DispatchConfig(mode="load"),
            False,
            _flat_register(3, 8, 12, 4, 2, 0, 2, "load"),
        ),
    ],
)
def test_the_register_tells_what_it_told_before_the_nested_shape(
    shape: ClusterShape,
    dispatch: DispatchConfig,
    shared_expert: bool,
    before: tuple[bytes, str, int],
) -> None:
    """The nested shape changed no byte of the Register: the same pb.ModelShape (expert
    bytes 0 for unknown, as the flat field's default was), dispatch mode and top_k."""
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="d"),
        rank=1,
        shape=shape,
        dispatch=dispatch,
        shared_expert=shared_expert,
    )
    agent = agent_config(config)
    request = WorkerAgent(agent, NoPlans(), lambda: 0).register_request()
    told = (
        request.shape.SerializeToString(deterministic=True),
        request.dispatch_mode,
        request.top_k,
    )
    assert told == before
    assert (agent.link, agent.rank, request.rank, request.deployment) == (config.link, 1, 1, "d")


def test_the_shape_is_checked_and_the_dispatch_mode_set_once() -> None:
    config = _hook_config()
    with pytest.raises(TypeError, match="HookConfig.shape must be a ClusterShape, got ModelShape"):
        dataclasses.replace(config, shape=pb.ModelShape(num_layers=2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"slots \(8\) must be at least the number of logical"):
        dataclasses.replace(config, shape=dataclasses.replace(config.shape, num_logical=16))
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[0, num_logical\]"):
        dataclasses.replace(config, shape=dataclasses.replace(config.shape, top_k=5))
    with pytest.raises(ValueError, match="the rank's dispatch mode is set once, in dispatch.mode"):
        dataclasses.replace(config, shape=dataclasses.replace(config.shape, dispatch_mode="load"))
    loaded = dataclasses.replace(config, dispatch=DispatchConfig(mode="load"))
    assert loaded.shape.dispatch_mode == "split"  # the default yields to dispatch.mode
    assert loaded.registered_shape == dataclasses.replace(config.shape, dispatch_mode="load")
    assert (
        dataclasses.replace(
            loaded, shape=dataclasses.replace(config.shape, dispatch_mode="load")
        ).registered_shape
        == loaded.registered_shape
    )
