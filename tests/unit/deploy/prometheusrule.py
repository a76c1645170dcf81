"""deploy/prometheus/prometheusrule.yaml, the Prometheus Operator's PrometheusRule, is
generated from deploy/prometheus/alerts.yml (the one source of the rules):

    python -m tests.unit.deploy.prometheusrule          # rewrite it
    python -m tests.unit.deploy.prometheusrule --check  # exit 1 if it is stale

test_operator.py checks the same, and runs promtool on the rules the rendered object holds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
OUTPUT = ROOT / "deploy" / "prometheus" / "prometheusrule.yaml"

HEADER = """\
# GENERATED from alerts.yml by `python -m tests.unit.deploy.prometheusrule`: edit alerts.yml
# and run that (tests/unit/deploy/test_operator.py fails while this file is stale).
# A Prometheus picks it up when its ruleSelector and ruleNamespaceSelector match: many
# installs (kube-prometheus-stack) select on a `release: <name>` label; add it in an overlay.
"""


def prometheus_rule(alerts: dict[str, Any]) -> dict[str, Any]:
    """The PrometheusRule object whose spec holds the rule groups of `alerts` unchanged."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "rebalancer",
            "namespace": "rebalancer",
            "labels": {
                "app.kubernetes.io/name": "rebalancer",
                "app.kubernetes.io/component": "controller",
            },
        },
        "spec": {"groups": alerts["groups"]},
    }


def render() -> str:
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        # Block literals for multi-line text, plain or quoted scalars otherwise.
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    alerts = yaml.safe_load(ALERTS.read_text())
    body = yaml.dump(
        prometheus_rule(alerts),
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        width=1 << 20,
        allow_unicode=True,
    )
    return HEADER + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the file is stale, write nothing"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is stale: "
                f"run python -m tests.unit.deploy.prometheusrule",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
