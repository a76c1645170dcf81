"""docs/operations.md names every metric the controller exports, every alert, every
admin action and every exit code of `rebalancer admin`."""

from __future__ import annotations

import re

from rebalancer.cli.admin_cmd import EXIT_CODES
from tests.unit.deploy.conftest import PROMETHEUS, ROOT, documents

DOC = ROOT / "docs" / "operations.md"


def test_every_exported_metric_is_explained(exported_metrics: set[str]) -> None:
    text = DOC.read_text()
    documented = {m.split("{")[0] for m in re.findall(r"^\| `(rebalancer_[a-z_]+(?:\{[^`]*\})?)` \|", text, re.M)}
    documented = {n[: -len("_total")] if n.endswith("_total") else n for n in documented}
    assert exported_metrics <= documented, f"exported, not in the metrics table: {sorted(exported_metrics - documented)}"
    assert documented <= exported_metrics, f"in the metrics table, not exported: {sorted(documented - exported_metrics)}"


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
    assert set(table) == {"0", "1", *map(str, EXIT_CODES.values())}
    for status, code in EXIT_CODES.items():
        assert status in table[str(code)], f"exit {code}: {status} not named"
