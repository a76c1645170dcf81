"""The fallback YAML reader agrees with PyYAML on every file under deploy/ and refuses
what it does not understand."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.deploy.conftest import DEPLOY
from tests.unit.deploy.yamlish import HAVE_PYYAML, YamlError, load_all, load_all_fallback

FILES = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))


@pytest.mark.skipif(not HAVE_PYYAML, reason="PyYAML not installed")
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_fallback_agrees_with_pyyaml(path: Path) -> None:
    text = path.read_text()
    assert load_all_fallback(text) == load_all(text)


def test_fallback_reads_the_subset() -> None:
    text = (
        "# c\na: 1\nb: \"x # y\"  # comment\nc: 'it''s'\nd: [\"ALL\", 2]\ne:\n- k: v\n  j: true\n- 0.5\n"
        "f: |\n  one\n\n  two\ng: ~\n---\nh: []\n"
    )
    assert load_all_fallback(text) == [
        {"a": 1, "b": "x # y", "c": "it's", "d": ["ALL", 2], "e": [{"k": "v", "j": True}, 0.5],
         "f": "one\n\ntwo\n", "g": None},
        {"h": []},
    ]


@pytest.mark.parametrize("text", [
    "a: &x 1\n", "a: >\n  folded\n", "a: {b: 1}\n", "a: 1\na: 2\n", "a:\n\tb: 1\n", "a: 0440\n",
    "a: 'open\n", "a: b: c\n", "a:\n  b: 1\n   c: 2\n",
])
def test_fallback_refuses_what_it_does_not_read(text: str) -> None:
    with pytest.raises(YamlError):
        load_all_fallback(text)
