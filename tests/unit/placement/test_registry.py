"""Placement algorithms are picked by name from one registry: the names the config's
Literal allows, the error an unknown name gets (library and CLI), and a registered
algorithm reaching `compute_placement`."""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest

from rebalancer.cli import main
from rebalancer.cli.plan_cmd import register as register_plan
from rebalancer.errors import InputError
from rebalancer.placement import ALGORITHMS, compute_placement, engine, trivial_placement
from rebalancer.sim.engine import FIT_ALGORITHMS

L, E, P, G = 3, 8, 12, 4


def _load() -> np.ndarray:
    return np.random.default_rng(0).pareto(1.2, size=(L, E)) * 100 + 1


def test_the_literal_names_every_registered_algorithm() -> None:
    assert get_args(engine.AlgorithmName) == ALGORITHMS == engine.algorithm_names()
    # The simulator's from-scratch fits are names of the same registry.
    assert set(FIT_ALGORITHMS) <= set(ALGORITHMS)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(InputError) as err:
        compute_placement(_load(), P, G, algorithm="gredy")
    message = str(err.value)
    assert "'gredy'" in message and all(name in message for name in ALGORITHMS)
    with pytest.raises(InputError, match="unknown algorithm"):
        compute_placement(_load(), P, G, algorithm=None)  # type: ignore[arg-type]


def test_what_a_name_can_serve_is_the_registry_s() -> None:
    previous = np.asarray(trivial_placement(L, E, P, G))
    with pytest.raises(InputError, match="algorithm 'migration' needs a previous placement"):
        compute_placement(_load(), P, G, algorithm="migration")
    with pytest.raises(
        InputError, match="a move budget needs algorithm 'auto' or 'migration', not 'greedy'"
    ):
        compute_placement(
            _load(), P, G, previous=previous, max_moved_fraction=0.5, algorithm="greedy"
        )
    assert compute_placement(_load(), P, G).algorithm == "balanced"
    assert compute_placement(_load(), P, G, previous=previous).algorithm == "migration"


def test_a_registered_algorithm_is_picked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def contiguous(req: engine.PlacementRequest) -> tuple[np.ndarray, np.ndarray | None]:
        rows = np.arange(req.num_slots) % req.load.shape[1]
        return np.tile(rows, (req.load.shape[0], 1)), None

    monkeypatch.setitem(
        engine._REGISTRY, "contiguous", engine.PlacementAlgorithm("contiguous", contiguous)
    )
    result = compute_placement(_load(), P, G, algorithm="contiguous")
    assert result.algorithm == "contiguous"
    np.testing.assert_array_equal(result.phy2log, trivial_placement(L, E, P, G))
    assert "contiguous" in engine.algorithm_names()
    with pytest.raises(ValueError, match="already taken"):
        engine.register_algorithm("greedy")(contiguous)


def test_plan_cli_unknown_algorithm_exit_2_one_line(tmp_path, capsys) -> None:
    counts = tmp_path / "c.json"
    counts.write_text('{"logical_count": ' + str(_load().round().astype(int).tolist()) + "}")
    assert (
        main(
            [
                "plan",
                "--counts",
                str(counts),
                "--gpus",
                str(G),
                "--slots",
                str(P),
                "--algorithm",
                "gredy",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown algorithm 'gredy'" in err[0]
    assert all(name in err[0] for name in ALGORITHMS)


def test_plan_cli_help_names_every_algorithm() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    register_plan(parser.add_subparsers())
    (plan,) = parser._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
    (action,) = [a for a in plan._actions if "--algorithm" in a.option_strings]
    assert all(name in action.help for name in ALGORITHMS)
