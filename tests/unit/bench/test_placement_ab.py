"""bench.placement_ab against this tree's own engine: same results everywhere, exit 0."""

from __future__ import annotations

from pathlib import Path

from bench.placement_ab import main
from rebalancer.placement import engine


def test_the_same_engine_gives_the_same_results(capsys) -> None:
    assert main(["--old-engine", str(Path(engine.__file__)), "--rounds", "1", "--calls", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("same result True") == 4 and "new vs old" in out
