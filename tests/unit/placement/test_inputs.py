"""Bad input is refused with an InputError and a one-line message."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.errors import InputError
from rebalancer.placement import (
    balancedness,
    compute_placement,
    lower_bound_balancedness,
    moved_fraction,
    transfers,
    trivial_placement,
)

LOAD = np.arange(32, dtype=np.float64).reshape(2, 16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"load": -LOAD}, "negative"),
        ({"load": np.where(LOAD == 3, np.nan, LOAD)}, "NaN"),
        ({"load": np.where(LOAD == 3, np.inf, LOAD)}, "infinite"),
        ({"load": LOAD[0]}, "2-D"),
        ({"load": np.zeros((0, 16))}, "at least one"),
        ({"load": np.array([["a"] * 16] * 2)}, "numeric"),
        ({"num_slots": 18}, "multiple of GPUs"),
        ({"num_slots": 8, "num_gpus": 4}, "at least the number"),
        ({"num_nodes": 3}, "multiple of nodes"),
        ({"num_gpus": 0}, "positive"),
        ({"num_groups": 5}, "groups"),
        ({"max_moved_fraction": 1.5, "previous": trivial_placement(2, 16, 16, 4)}, "[0, 1]"),
        ({"max_moved_fraction": -0.1, "previous": trivial_placement(2, 16, 16, 4)}, "[0, 1]"),
        ({"previous": trivial_placement(3, 16, 16, 4)}, "shape"),
        ({"previous": np.zeros((2, 16), dtype=np.int64)}, "no replica"),
        ({"previous": np.full((2, 16), 99)}, "refers to expert"),
        ({"algorithm": "magic"}, "unknown algorithm"),
        ({"algorithm": "migration"}, "needs a previous"),
    ],
)
def test_compute_placement_refuses(kwargs, message):
    args = {"load": LOAD, "num_slots": 16, "num_gpus": 4, "num_nodes": 1}
    args.update(kwargs)
    with pytest.raises(InputError) as info:
        compute_placement(**args)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_metrics_refuse_mismatched_shapes():
    p2l = trivial_placement(2, 16, 16, 4)
    with pytest.raises(InputError, match="layers"):
        balancedness(p2l, LOAD[:1], 4)
    with pytest.raises(InputError, match="shape"):
        moved_fraction(p2l, p2l[:, :8])
    with pytest.raises(InputError, match="multiple"):
        transfers(p2l, p2l, 5)
    with pytest.raises(InputError, match="negative"):
        lower_bound_balancedness(-LOAD, 16, 4)


def test_valid_input_is_not_modified():
    load = LOAD.copy()
    previous = trivial_placement(2, 16, 16, 4)
    before = previous.copy()
    compute_placement(load, 16, 4, previous=previous, max_moved_fraction=0.5)
    assert (load == LOAD).all() and (previous == before).all()


@pytest.mark.parametrize(
    "num_slots, num_gpus, message",
    [
        (4096, 1, "slots (4096) must be at most 2048"),  # 1.4 GB and 4.4 s before the bound
        (65536, 64, "slots (65536) must be at most 2048"),  # 6 GB and 88 s for one layer
        (2**40, 1, "must be at most 2048"),  # a MemoryError before the bound
        (2048, 1, "slots per GPU (2048 / 1 = 2048) must be at most 1024"),
    ],
)
def test_layout_bound_refused_before_allocating(num_slots, num_gpus, message):
    """The engine's time and memory grow with the square of the slots (docs/placement.md,
    "Limits"): every entry point refuses a layout beyond the bound, at once."""
    load = np.ones((64, 4))
    for call in (
        lambda: compute_placement(load, num_slots, num_gpus),
        lambda: lower_bound_balancedness(load, num_slots, num_gpus),
        lambda: trivial_placement(64, 4, num_slots, num_gpus),
    ):
        with pytest.raises(InputError) as info:
            call()
        assert message in str(info.value) and "\n" not in str(info.value)


def test_layout_bound_itself_is_placed():
    from rebalancer.wire.layout import MAX_SLOTS, MAX_SLOTS_PER_GPU

    load = np.random.default_rng(0).pareto(1.5, size=(1, 512)) + 0.1
    result = compute_placement(load, MAX_SLOTS, MAX_SLOTS // MAX_SLOTS_PER_GPU)
    assert result.phy2log.shape == (1, MAX_SLOTS) and 0 < result.balancedness <= 1
