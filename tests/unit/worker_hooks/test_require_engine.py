"""An adapter used without its engine says how to install the project beside it; a broken engine
install (the engine there, one of its own dependencies missing) is not mistaken for a missing
engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from worker_hooks.engines import EngineMissingError, require_engine


def test_a_missing_engine_says_how_to_install() -> None:
    """No index serves moe-rebalancer: the message points at the wheel, beside the engine."""
    with pytest.raises(EngineMissingError) as caught:
        require_engine("no_such_engine.srt.eplb", "NoSuch", "nosuch")
    assert str(caught.value) == (
        "the NoSuch adapter needs NoSuch (no_such_engine is not installed): install the "
        'moe-rebalancer wheel into NoSuch\'s own environment (docs/operations.md, "Engine images")'
    )
    assert isinstance(caught.value, ImportError)


def test_a_present_engine_is_returned() -> None:
    assert require_engine("json.decoder", "json", "json") is sys.modules["json.decoder"]


def test_an_engines_own_missing_dependency_is_reported_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "half_engine").mkdir()
    (tmp_path / "half_engine" / "__init__.py").write_text("import not_installed_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as caught:
        require_engine("half_engine", "Half", "half")
    assert not isinstance(caught.value, EngineMissingError)
    assert caught.value.name == "not_installed_dependency"
