"""One rule for when two reported shapes are one deployment's (rebalancer/wire/shape.py
`merge_shape`): the controller's registry applies it to a Register, and the sidecar asks
the same rule of its pod's ranks (`shapes_agree`) before the controller would."""

from __future__ import annotations

import itertools

import pytest

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.shape import merge_shape, shape_of, shapes_agree, unknown_of

BASE = dict(
    num_layers=4,
    num_logical_experts=16,
    num_physical_slots=24,
    num_gpus=4,
    num_nodes=1,
    num_groups=0,
    expert_bytes=1 << 20,
)


def msg(**changes: int) -> pb.ModelShape:
    return pb.ModelShape(**{**BASE, **changes})


@pytest.mark.parametrize(
    ("a", "b", "agree"),
    [
        (msg(), msg(), True),
        (msg(expert_bytes=0), msg(), True),  # not known yet: matches any
        (msg(), msg(expert_bytes=0), True),
        (msg(expert_bytes=7), msg(), False),
        (msg(num_nodes=0), msg(), True),  # 0 nodes is one node, as the controller reads it
        (msg(num_layers=5), msg(), False),
        (msg(num_physical_slots=28), msg(), False),
        (msg(num_groups=4), msg(), False),
        (msg(num_physical_slots=10), msg(num_physical_slots=10), False),  # refused: P < E
    ],
)
def test_the_sidecars_shape_check_is_the_controllers_rule(
    a: pb.ModelShape, b: pb.ModelShape, agree: bool
) -> None:
    assert shapes_agree(a, b) is agree
    assert shapes_agree(b, a) is agree


def test_shapes_agree_exactly_where_the_registry_would_merge_them() -> None:
    variants = [msg(), msg(expert_bytes=0), msg(expert_bytes=3), msg(num_gpus=8), msg(num_nodes=2)]
    for a, b in itertools.product(variants, repeat=2):
        merged = merge_shape(shape_of(a), shape_of(b), unknown_of(a), unknown_of(b))
        assert shapes_agree(a, b) is (merged is not None), (a, b)
