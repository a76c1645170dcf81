"""One spelling per concept (issue 31), beside the link (test_one_link.py): the model shape
of a deployment's EP group is `rebalancer.wire.shape.ClusterShape`, and the counts
window's settings are `worker_hooks.config.WindowConfig`.

A config that needs either nests it (`HookConfig.shape`, `SGLangAdapterConfig.windows`,
`DemoConfig.windows`, ...) instead of repeating its fields. A placement, simulator or file
format class may name a few of the shape's fields (what it works on); five or more make
a second model shape.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from rebalancer.errors import InputError
from rebalancer.wire.shape import ClusterShape
from tests.unit.test_one_link import PACKAGES, ROOT, _is_dataclass
from worker_hooks.config import WindowConfig

SHAPE_HOME = ("rebalancer/wire/shape.py", "ClusterShape")
SHAPE_FIELDS = {f.name for f in dataclasses.fields(ClusterShape)}
# Fields of ClusterShape a dataclass may declare before it holds a second model shape.
MOST_SHAPE_FIELDS = 4
# Known second spellings, each with why it is not nested yet; the list only shrinks.
# None left: the simulator's SimConfig nests the shape too (`SimConfig.shape`).
SHAPE_COPIES_LEFT: set[tuple[str, str]] = set()
# Shape fields no other dataclass may declare at all: the bytes of one expert belong to
# the deployment's shape (the simulator's cost model once held a second copy).
SHAPE_ONLY_FIELDS = {"expert_bytes"}
WINDOW_HOME = ("worker_hooks/config.py", "WindowConfig")
WINDOW_FIELDS = {"window_steps"}


def dataclass_classes(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES):  # type: ignore[no-untyped-def]
    """(path, class node) for every dataclass of `packages`."""
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            rel = path.relative_to(root).as_posix()
            for cls in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(cls, ast.ClassDef) and _is_dataclass(cls):
                    yield rel, cls


def _fields(cls: ast.ClassDef) -> list[ast.AnnAssign]:
    return [
        node
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    ]


def dataclass_fields(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES):  # type: ignore[no-untyped-def]
    """(path, class, [annotated field names]) for every dataclass of `packages`."""
    for rel, cls in dataclass_classes(root, packages):
        yield rel, cls.name, [node.target.id for node in _fields(cls)]  # type: ignore[union-attr]


def shape_copies(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """`path: Class (fields)` for every dataclass but ClusterShape declaring more than
    MOST_SHAPE_FIELDS of ClusterShape's fields."""
    found = []
    for rel, name, fields in dataclass_fields(root, packages):
        shared = sorted(SHAPE_FIELDS.intersection(fields))
        left = (rel, name) == SHAPE_HOME or (rel, name) in SHAPE_COPIES_LEFT
        if not left and len(shared) > MOST_SHAPE_FIELDS:
            found.append(f"{rel}: {name} ({', '.join(shared)})")
        elif (rel, name) != SHAPE_HOME and SHAPE_ONLY_FIELDS.intersection(fields):
            found.append(f"{rel}: {name} ({', '.join(sorted(SHAPE_ONLY_FIELDS & set(fields)))})")
    return found


def window_copies(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """`path: Class.field` for every dataclass but WindowConfig declaring a window field."""
    return [
        f"{rel}: {name}.{field}"
        for rel, name, fields in dataclass_fields(root, packages)
        if (rel, name) != WINDOW_HOME
        for field in fields
        if field in WINDOW_FIELDS
    ]


def test_no_second_model_shape() -> None:
    assert shape_copies() == [], "nest a rebalancer.wire.shape.ClusterShape instead"


def wire_shapes_in_configs(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """`path: Class.field` for every `...Config` dataclass holding the wire's ModelShape
    (a config nests ClusterShape; the message is built from it at Register)."""
    return [
        f"{rel}: {cls.name}.{node.target.id}"  # type: ignore[union-attr]
        for rel, cls in dataclass_classes(root, packages)
        if cls.name.endswith("Config")
        for node in _fields(cls)
        if "ModelShape" in ast.unparse(node.annotation)
    ]


def test_no_config_holds_the_wire_shape() -> None:
    assert wire_shapes_in_configs() == [], "nest a rebalancer.wire.shape.ClusterShape instead"


def test_the_walk_finds_a_wire_shape_in_a_config(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "agent.py").write_text(
        "from dataclasses import dataclass\n\n"
        "@dataclass(frozen=True)\nclass AgentConfig:\n    rank: int\n    shape: pb.ModelShape\n\n"
        "@dataclass\nclass Pending:\n    shape: pb.ModelShape\n"  # a relayed message, no config
    )
    assert wire_shapes_in_configs(tmp_path, ("pkg",)) == ["pkg/agent.py: AgentConfig.shape"]


def test_no_second_window_setting() -> None:
    assert window_copies() == [], "nest a worker_hooks.config.WindowConfig instead"


def test_the_homes_are_where_the_walk_looks() -> None:
    """The walk skips the homes by path and name: they must still be there."""
    found = {(rel, name) for rel, name, _ in dataclass_fields()}
    assert {SHAPE_HOME, WINDOW_HOME} <= found


def test_the_copies_left_are_still_copies() -> None:
    """A copy left that was nested (or moved) leaves the list, so it cannot come back."""
    found = {
        (rel, name): len(SHAPE_FIELDS.intersection(fields))
        for rel, name, fields in dataclass_fields()
    }
    for left in sorted(SHAPE_COPIES_LEFT):
        assert found.get(left, 0) > MOST_SHAPE_FIELDS, f"{left} is no copy now: drop it"


def test_the_walk_finds_second_definitions(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "configs.py").write_text(
        "from dataclasses import dataclass\n\n"
        "@dataclass(frozen=True)\nclass Flat:\n"
        "    num_layers: int\n    num_logical: int\n    num_slots: int\n"
        "    num_gpus: int\n    expert_bytes: int = 0\n    window_steps: int = 16\n\n"
        "@dataclass\nclass Placement:\n"  # a few of the shape's fields: what it works on
        "    num_layers: int\n    num_slots: int\n    num_gpus: int\n    num_nodes: int\n\n"
        "@dataclass\nclass Cost:\n"  # one field only the shape may hold
        "    seconds_per_token: float\n    expert_bytes: int\n\n"
        "class NotADataclass:\n"
        "    num_layers: int\n    num_logical: int\n    num_slots: int\n"
        "    num_gpus: int\n    num_nodes: int\n    window_steps: int\n"
    )
    assert shape_copies(tmp_path, ("pkg",)) == [
        "pkg/configs.py: Flat (expert_bytes, num_gpus, num_layers, num_logical, num_slots)",
        "pkg/configs.py: Cost (expert_bytes)",
    ]
    assert window_copies(tmp_path, ("pkg",)) == ["pkg/configs.py: Flat.window_steps"]


@pytest.mark.parametrize("adapter", ["sglang", "vllm"])
def test_the_adapters_read_their_window_into_a_window_config(adapter: str) -> None:
    """REBALANCER_WINDOW_STEPS fills `windows`; a bad value is refused naming the variable."""
    from worker_hooks.engines.sglang.config import SGLangAdapterConfig
    from worker_hooks.engines.vllm.config import VLLMAdapterConfig

    config_class: type[SGLangAdapterConfig] | type[VLLMAdapterConfig] = {
        "sglang": SGLangAdapterConfig,
        "vllm": VLLMAdapterConfig,
    }[adapter]
    env = {"REBALANCER_ADDRESS": "a:1"}
    config = config_class.from_env(env)
    assert config is not None and config.windows == WindowConfig()
    config = config_class.from_env({**env, "REBALANCER_WINDOW_STEPS": "8"})
    assert config is not None and config.windows == WindowConfig(steps=8)
    with pytest.raises(InputError, match=r"^REBALANCER_WINDOW_STEPS must be >= 1, got 0$"):
        config_class.from_env({**env, "REBALANCER_WINDOW_STEPS": "0"})
    with pytest.raises(TypeError, match="windows must be a WindowConfig, got int"):
        config_class(config.link, windows=8)  # type: ignore[arg-type]
