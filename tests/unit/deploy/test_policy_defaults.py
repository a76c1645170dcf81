"""The [policy] section of deploy/controller.toml, and of the copy the ConfigMap embeds,
against PolicyConfig's defaults (the convention is written in the section's header):

- `# key = value` (commented out) shows the code's default and must equal it;
- `key = value` is in force and must equal the default, unless the line says why it
  overrides it: `key = value  # why: ...`;
- every PolicyConfig setting (by its flat name, `PolicyConfig.setting_names`) appears
  exactly once, so a new setting is documented here too.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

import pytest

from rebalancer.controller.decide import PolicyConfig
from tests.unit.deploy.conftest import CONTROLLER_TOML

# `key = value` or `# key = value`, with an optional trailing `# comment`.
LINE = re.compile(
    r"^(?P<hash>#\s*)?(?P<key>[a-z_]+)\s*=\s*(?P<value>[^#]+?)\s*(?:#\s*(?P<comment>.*))?$"
)
WHY = re.compile(r"^why:\s*\S")


def policy_lines(text: str) -> list[tuple[str, Any, bool, str]]:
    """(key, value, active, comment) of every key line of the [policy] section."""
    out: list[tuple[str, Any, bool, str]] = []
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        header = re.match(r"^\[([a-z_]+)\]", line)
        if header:
            section = header.group(1)
            continue
        if section != "policy":
            continue
        m = LINE.match(line)
        if m is None:
            continue
        value = tomllib.loads(f"v = {m.group('value')}")["v"]
        out.append((m.group("key"), value, m.group("hash") is None, m.group("comment") or ""))
    return out


def check_policy_section(text: str, where: str) -> None:
    defaults = PolicyConfig().to_flat()
    names = list(PolicyConfig.setting_names())
    lines = policy_lines(text)
    keys = [key for key, *_ in lines]
    assert sorted(keys) == sorted(names), (
        f"{where}: [policy] must name every PolicyConfig field once; "
        f"missing {sorted(set(names) - set(keys))}, unknown or repeated "
        f"{sorted(k for k in set(keys) if keys.count(k) > 1 or k not in names)}"
    )
    for key, value, active, comment in lines:
        default = defaults[key]
        # TOML `300` for a float field is fine; `1` for a boolean or `2.0` for a count is not.
        int_for_float = isinstance(default, float) and type(value) is int
        same = value == default and (type(value) is type(default) or int_for_float)
        if not active:
            assert same, (
                f"{where}: `# {key} = {value}` shows a default, but the default is {default!r}"
            )
        elif not same:
            assert WHY.match(comment), (
                f"{where}: {key} = {value!r} overrides the default {default!r}: say why on "
                "the same line (`# why: ...`) or make it equal"
            )
    # What the controller reads: the overrides, the rest as in the code.
    parsed = tomllib.loads(text).get("policy", {})
    assert set(parsed) == {key for key, _, active, _ in lines if active}
    PolicyConfig.from_dict(parsed)


def test_controller_toml_policy_matches_the_code() -> None:
    check_policy_section(CONTROLLER_TOML.read_text(), "deploy/controller.toml")


def test_configmap_policy_matches_the_code(
    manifests: dict[tuple[str, str], dict[str, Any]],
) -> None:
    text = manifests[("ConfigMap", "rebalancer-config")]["data"]["controller.toml"]
    check_policy_section(text, "deploy/kubernetes/base/configmap.yaml")
    # The ConfigMap's [policy] is deploy/controller.toml's, comments included.
    assert policy_text(text) == policy_text(CONTROLLER_TOML.read_text())


def policy_text(text: str) -> str:
    """The [policy] section, header to the next section or the end."""
    section = text.split("\n[policy]\n", 1)[1]
    return re.split(r"^\[", section, maxsplit=1, flags=re.M)[0].strip()


def _policy(lines: str) -> str:
    defaults = PolicyConfig().to_flat()
    rest = "\n".join(
        f"# {name} = {_toml(value)}"
        for name, value in defaults.items()
        if not re.search(rf"^#? ?{name} =", lines, re.M)
    )
    return f"[server]\nport = 1\n\n[policy]\n{lines}\n{rest}\n"


def _toml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def test_the_check_catches_what_it_should() -> None:
    check_policy_section(_policy(""), "defaults")
    check_policy_section(_policy("decay = 0.3"), "equal")
    check_policy_section(_policy("decay = 0.7  # why: a slower estimate for this fleet"), "why")
    with pytest.raises(AssertionError, match="overrides the default"):
        check_policy_section(_policy("decay = 0.7"), "no why")
    with pytest.raises(AssertionError, match="overrides the default"):
        check_policy_section(_policy("decay = 0.7  # tuned"), "not a why")
    with pytest.raises(AssertionError, match="shows a default"):
        check_policy_section(_policy("# decay = 0.7"), "stale comment")
    with pytest.raises(AssertionError, match="every PolicyConfig field"):
        check_policy_section("[policy]\n# decay = 0.3\n", "missing")
