"""docs/operations.md names every metric the controller exports, every alert, every
admin action and every exit code of `rebalancer admin`."""

from __future__ import annotations

import re

from rebalancer.cli.admin_cmd import EXIT_CODES, EXIT_SHARD_DOWN
from tests.unit.deploy.conftest import PROCESS_PREFIX, PROMETHEUS, ROOT, base_name, documents

DOC = ROOT / "docs" / "operations.md"


def test_every_exported_metric_is_explained(exported_metrics: set[str]) -> None:
    text = DOC.read_text()
    documented = {
        m.split("{")[0]
        for m in re.findall(r"^\| `(rebalancer_[a-z_]+(?:\{[^`]*\})?)` \|", text, re.M)
    }
    documented = {n[: -len("_total")] if n.endswith("_total") else n for n in documented}
    # The process collector's families are named below the table, each of them.
    process = {n for n in exported_metrics if n.startswith(PROCESS_PREFIX)}
    assert {n for n in process if f"`{n}`" not in text} == set()
    # The controller's families (the sidecar's have their own list below the table).
    exported_metrics = {
        base_name(n) for n in exported_metrics - process if not n.startswith("rebalancer_sidecar")
    }
    assert exported_metrics <= documented, (
        f"exported, not in the metrics table: {sorted(exported_metrics - documented)}"
    )
    assert documented <= exported_metrics, (
        f"in the metrics table, not exported: {sorted(documented - exported_metrics)}"
    )


def test_every_alert_has_a_runbook_line() -> None:
    text = DOC.read_text()
    (doc,) = documents(PROMETHEUS / "alerts.yml")
    for group in doc["groups"]:
        for rule in group["rules"]:
            assert f"| `{rule['alert']}`" in text, rule["alert"]


def test_admin_actions_and_exit_codes() -> None:
    text = DOC.read_text()
    for action in ("status", "placement", "history", "force", "pause", "resume", "policy"):
        assert re.search(rf"^\| [^|]*`{action}\b", text, re.M), action
    assert "--dry-run" in text
    table = dict(re.findall(r"^\| ([0-9]) \| (.+) \|$", text, re.M))
    assert set(table) == {"0", "1", *map(str, EXIT_CODES.values()), str(EXIT_SHARD_DOWN)}
    for status, code in EXIT_CODES.items():
        assert status in table[str(code)], f"exit {code}: {status} not named"


def _policy_table() -> dict[str, tuple[str, str]]:
    """field -> (default, wire) of the table under "### Policy fields"."""
    text = DOC.read_text()
    section = text.split("### Policy fields", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \| ([^|]+) \|", section, re.M)
    names = [name for name, _, _ in rows]
    assert len(names) == len(set(names)), "a field is listed twice"
    return {name: (default.strip(), wire.strip()) for name, default, wire in rows}


def test_every_policy_field_is_listed_with_its_default_and_wire_number() -> None:
    import tomllib

    from rebalancer.controller.decide import PolicyConfig
    from rebalancer.v1 import rebalancer_pb2 as pb

    table = _policy_table()
    names = set(PolicyConfig.setting_names())
    assert set(table) == names, (
        f"not in the table: {sorted(names - set(table))}; "
        f"not PolicyConfig fields: {sorted(set(table) - names)}"
    )
    wire = {f.name: f.number for f in pb.Policy.DESCRIPTOR.fields}
    assert wire.keys() <= names, f"Policy fields PolicyConfig lacks: {sorted(wire.keys() - names)}"
    defaults = PolicyConfig().to_flat()
    for name, (default, number) in table.items():
        assert number == str(wire.get(name, "none")), (
            f"{name}: wire {number}, proto {wire.get(name)}"
        )
        value = tomllib.loads(f"v = {default}")["v"]
        assert value == defaults[name], f"{name}: documented {default}, code {defaults[name]!r}"
    # "in code": where the setting lives in PolicyConfig (its section and field).
    from rebalancer.controller.policy_config import POLICY_SETTINGS

    section = DOC.read_text().split("### Policy fields", 1)[1].split("\n#", 1)[0]
    where = dict(re.findall(r"^\| `([a-z_]+)` \| [^|]+ \| [^|]+ \| `([a-z_.]+)` \|", section, re.M))
    assert where == {name: ".".join(POLICY_SETTINGS.get(name, (name,))) for name in names}


def test_decision_outcomes_are_those_the_controller_records() -> None:
    """The decisions counter's row lists the outcomes the controller records, no more (it
    listed skip_paused, which a paused deployment never records: its policy does not
    decide) and no fewer (skip_store was missing)."""
    from rebalancer.controller.decision_runner import RECORDED_OUTCOMES

    (row,) = [
        ln for ln in DOC.read_text().splitlines() if ln.startswith("| `rebalancer_decisions_total{")
    ]
    listed = row.split("| counter | decisions: ", 1)[1]
    outcomes = re.findall(r"`([a-z_]+)`", listed.split(" (dry runs")[0])  # not the notes after it
    assert sorted(outcomes) == sorted(RECORDED_OUTCOMES)
