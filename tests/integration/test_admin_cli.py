"""`rebalancer admin` as an operator meets it: --json after the action, an exit-code list
in its help that matches what it returns, and a status that agrees with the history
(the last decision and its plan version, across a restart; windows counted as the
decisions count them). A real controller, real worker agents, a real SQLite store."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from rebalancer.cli import main as cli
from rebalancer.cli.admin_cmd import EXIT_CODES, EXIT_MEANINGS, EXIT_OTHER
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from tests.integration.conftest import start_controller
from tests.unit.deploy.live import DEPLOYMENT, E, G, InstantRank, L, P, wait_for

WINDOWS = 3


def admin(ctl: EmbeddedController, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli(["admin", "--address", ctl.server.address, "--timeout", "5", *args])  # type: ignore[union-attr]
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def help_codes() -> dict[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli(["admin", "--help"])
    text = out.getvalue().split("exit codes:", 1)[1]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\s+(\d+)\s+(.+)$", text, re.M)}


def test_help_lists_every_exit_code_the_command_returns() -> None:
    listed = help_codes()
    # What run() can return: a mapped gRPC status, any other one, bad input found before
    # the call (InputError, argparse), done, interrupted (rebalancer.cli.main).
    returned = set(EXIT_CODES.values()) | {0, EXIT_OTHER, 2, 130}
    assert set(listed) == returned == set(EXIT_MEANINGS)
    for status, code in EXIT_CODES.items():
        assert status in listed[code], f"{status} missing from the line of exit code {code}"


def test_json_after_the_action(tmp_path: Path) -> None:
    ctl = start_controller(tmp_path / "c.sqlite")
    try:
        for args in (("--json", "status"), ("status", "--json")):
            code, out, _ = admin(ctl, *args)
            assert code == 0 and json.loads(out) == {"deployments": []}, args
        code, out, err = admin(ctl, "history", "nope", "--json")
        assert code == 3 and "NOT_FOUND" in err and out == ""
        assert "NOT_FOUND" in help_codes()[code]
    finally:
        ctl.stop()


def _feed(ctl: EmbeddedController) -> list[InstantRank]:
    """Two real ranks on the controller, WINDOWS windows each with dispatch counts."""
    ranks = [InstantRank(r, ctl.server.address) for r in range(G)]  # type: ignore[union-attr]
    for r in ranks:
        r.agent.start()
    for r in ranks:
        assert r.agent.connected.wait(30)
    rng = np.random.default_rng(3)
    for seq in range(WINDOWS):
        logical = rng.integers(0, 50, (L, E)) * (1 + np.arange(E))
        for r in ranks:
            r.agent.submit_window(seq * 4, 4, 0, logical, rng.integers(0, 50, (L, P)))
    controller = ctl.server.controller  # type: ignore[union-attr]
    wait_for(lambda: DEPLOYMENT in ctl.call(lambda: controller.deployments)
             and ctl.call(lambda: controller.deployments[DEPLOYMENT].stats.windows_ingested) == WINDOWS * G
             and ctl.call(lambda: controller.deployments[DEPLOYMENT].estimator.windows) >= WINDOWS, 30, "windows folded")
    return ranks


def test_status_agrees_with_history_across_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    ctl = start_controller(db, PolicyConfig(paused=True, min_windows=1))
    ranks: list[InstantRank] = []
    try:
        ranks = _feed(ctl)
        code, out, _ = admin(ctl, "status", DEPLOYMENT, "--json")
        assert code == 0
        # Counted as the decisions count them (folded into the estimate: once per sequence
        # number over both ranks), not once per rank's window.
        windows = int(json.loads(out)["deployments"][0]["windows_ingested"])
        controller = ctl.server.controller  # type: ignore[union-attr]
        assert windows == ctl.call(lambda: controller.deployments[DEPLOYMENT].estimator.windows)
        assert WINDOWS <= windows < WINDOWS * G
        code, out, err = admin(ctl, "force", DEPLOYMENT, "--json")
        assert code == 0, err
        forced = json.loads(out)
        assert forced["outcome"] == "forced" and forced["plan_version"] == 1
        wait_for(lambda: ctl.call(lambda: controller.deployments[DEPLOYMENT].version) == 1, 30, "plan v1 committed")
        code, out, _ = admin(ctl, "status", DEPLOYMENT, "--json")
        last = json.loads(out)["deployments"][0]["last_decision"]
        history = json.loads(admin(ctl, "history", DEPLOYMENT, "--json")[1])
        assert last == history["decisions"][0]
        assert last["outcome"] == "forced" and int(last["plan_version"]) == 1  # not 0
        code, text, _ = admin(ctl, "status", DEPLOYMENT)
        assert "last decision: forced (plan v1)" in text and f"{windows} windows folded" in text
    finally:
        for r in ranks:
            r.agent.stop()
        ctl.stop()
    # A new controller on the same store: no decision taken since, the last one is still
    # the stored one, and the windows are those the restored estimate holds.
    ctl = start_controller(db, PolicyConfig(paused=True, min_windows=1))
    try:
        status = json.loads(admin(ctl, "--json", "status", DEPLOYMENT)[1])["deployments"][0]
        history = json.loads(admin(ctl, "--json", "history", DEPLOYMENT)[1])
        assert status["last_decision"] == history["decisions"][0] == last
        assert int(status["windows_ingested"]) == windows and status["placement_version"] == 1
    finally:
        ctl.stop()
