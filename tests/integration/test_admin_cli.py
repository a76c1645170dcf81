"""`rebalancer admin` as an operator meets it: --json after the action, an exit-code list
in its help that matches what it returns, and a status that agrees with the history
(the last decision and its plan version, across a restart; windows folded counted as the
decisions count them, windows received as the metric does), what an operator reads in
its text (times, no balancedness before there is one), and a force that starts no plan
exits 4 naming why. A real controller, real worker agents, a real SQLite store."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from rebalancer.cli import main as cli
from rebalancer.cli.admin_cmd import EXIT_CODES, EXIT_MEANINGS, EXIT_OTHER, EXIT_SHARD_DOWN
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.launch.instant import DEPLOYMENT, E, G, InstantRank, L, P
from tests.integration.conftest import start_controller
from tests.unit.deploy.live import wait_for

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
    # the call (InputError, argparse), done, interrupted (rebalancer.cli.main), a controller
    # shard that did not answer (--shards).
    returned = set(EXIT_CODES.values()) | {0, EXIT_OTHER, 2, 130, EXIT_SHARD_DOWN}
    assert set(listed) == returned == set(EXIT_MEANINGS)
    for status, code in EXIT_CODES.items():
        assert status in listed[code], f"{status} missing from the line of exit code {code}"


def test_json_after_the_action(tmp_path: Path) -> None:
    ctl = start_controller(tmp_path / "c.sqlite")
    try:
        for args in (("--json", "status"), ("status", "--json")):
            code, out, _ = admin(ctl, *args)
            assert code == 0 and json.loads(out) == {"deployments": [], "pools": []}, args
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
    wait_for(
        lambda: (
            DEPLOYMENT in ctl.call(lambda: controller.deployments)
            and ctl.call(lambda: controller.deployments[DEPLOYMENT].stats.windows_ingested)
            == WINDOWS * G
            and ctl.call(lambda: controller.deployments[DEPLOYMENT].estimator.windows) >= WINDOWS
        ),
        30,
        "windows folded",
    )
    return ranks


def test_status_agrees_with_history_across_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    ctl = start_controller(db, PolicyConfig(paused=True, min_windows=1))
    ranks: list[InstantRank] = []
    try:
        ranks = _feed(ctl)
        code, out, _ = admin(ctl, "status", DEPLOYMENT, "--json")
        assert code == 0
        # Folded as the decisions count them (once per sequence number over both ranks);
        # received once per rank's window, as rebalancer_windows_ingested_total counts them.
        windows = int(json.loads(out)["deployments"][0]["windows_folded"])
        controller = ctl.server.controller  # type: ignore[union-attr]
        assert windows == ctl.call(lambda: controller.deployments[DEPLOYMENT].estimator.windows)
        assert WINDOWS <= windows < WINDOWS * G
        assert int(json.loads(out)["deployments"][0]["windows_ingested"]) == WINDOWS * G
        code, out, err = admin(ctl, "force", DEPLOYMENT, "--json")
        assert code == 0, err
        forced = json.loads(out)
        assert forced["outcome"] == "forced" and forced["plan_version"] == 1
        wait_for(
            lambda: ctl.call(lambda: controller.deployments[DEPLOYMENT].version) == 1,
            30,
            "plan v1 committed",
        )
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
        assert int(status["windows_folded"]) == windows and status["placement_version"] == 1
        assert int(status.get("windows_ingested", 0)) == 0  # received by this controller
    finally:
        ctl.stop()


def _connect(ctl: EmbeddedController) -> list[InstantRank]:
    ranks = [InstantRank(r, ctl.server.address) for r in range(G)]  # type: ignore[union-attr]
    for r in ranks:
        r.agent.start()
    for r in ranks:
        assert r.agent.connected.wait(30)
    return ranks


def _send(
    ctl: EmbeddedController, ranks: list[InstantRank], logical: np.ndarray, windows: int
) -> None:
    """`windows` windows of the same counts from every rank, waited until folded."""
    controller = ctl.server.controller  # type: ignore[union-attr]
    start = ctl.call(lambda: controller.deployments[DEPLOYMENT].estimator.windows)
    for seq in range(windows):
        for r in ranks:
            r.agent.submit_window(seq * 4, 4, 0, logical, np.full((L, P), 10))
    wait_for(
        lambda: (
            ctl.call(lambda: controller.deployments[DEPLOYMENT].estimator.windows)
            >= start + windows
        ),
        30,
        "windows folded",
    )


def test_a_force_with_no_rank_connected_exits_4_with_its_reason(tmp_path: Path) -> None:
    """No rank connected: `admin force` says why on one line and exits 4 (it printed
    `skip_ranks ...` and exited 0); --json prints the decision, with its reason, and exits
    4 too. The decision is in the history."""
    ctl = start_controller(tmp_path / "c.sqlite", PolicyConfig(paused=True, min_windows=1))
    controller = ctl.server.controller  # type: ignore[union-attr]
    ranks = _feed(ctl)
    for r in ranks:
        r.agent.stop()
    try:
        wait_for(
            lambda: ctl.call(lambda: controller.deployments[DEPLOYMENT].connected_ranks) == 0,
            30,
            "ranks gone",
        )
        code, out, err = admin(ctl, "force", DEPLOYMENT)
        assert (code, out) == (4, ""), (code, out, err)
        assert err == (
            f"rebalancer admin: error: no plan started for {DEPLOYMENT!r}: skip_ranks: "
            f"only 0 of {G} ranks connected (missing: ranks 0-{G - 1})\n"
        )
        code, out, err = admin(ctl, "force", DEPLOYMENT, "--json")
        decision = json.loads(out)
        assert code == 4 and err.count("\n") == 1 and "skip_ranks" in err
        assert decision["outcome"] == "skip_ranks" and decision["plan_version"] == 0
        assert decision["reason"] == f"only 0 of {G} ranks connected (missing: ranks 0-{G - 1})"
        history = json.loads(admin(ctl, "history", DEPLOYMENT, "--json")[1])
        assert [d["outcome"] for d in history["decisions"][:2]] == ["skip_ranks", "skip_ranks"]
        assert ctl.call(lambda: controller.deployments[DEPLOYMENT].version) == 0
    finally:
        ctl.stop()


def test_a_force_that_would_move_nothing_starts_no_plan(tmp_path: Path) -> None:
    """Counts the trivial placement already balances: the candidate moves 0 slots, so no
    plan starts (the version stays 0; a plan moving nothing was started and committed),
    exit 4 and the reason on one line; a dry run still shows it, exit 0."""
    ctl = start_controller(tmp_path / "c.sqlite", PolicyConfig(paused=True, min_windows=1))
    controller = ctl.server.controller  # type: ignore[union-attr]
    ranks = _connect(ctl)
    try:
        _send(ctl, ranks, np.full((L, E), 100), 3)
        code, out, _ = admin(ctl, "force", DEPLOYMENT, "--dry-run", "--json")
        assert code == 0 and json.loads(out)["moved_fraction"] == 0.0
        code, out, err = admin(ctl, "force", DEPLOYMENT)
        assert (code, out) == (4, ""), (code, out, err)
        assert (
            err.startswith(
                f"rebalancer admin: error: no plan started for {DEPLOYMENT!r}: skip_gain: forced, "
                "but the candidate equals the current placement"
            )
            and err.count("\n") == 1
        )
        assert ctl.call(
            lambda: (
                controller.deployments[DEPLOYMENT].version,
                controller.deployments[DEPLOYMENT].plan,
            )
        ) == (0, None)
        assert ctl.call(lambda: controller.store.plans(DEPLOYMENT, 5)) == []
    finally:
        for r in ranks:
            r.agent.stop()
        ctl.stop()


STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ"


def test_what_status_and_history_say_before_and_after_windows(tmp_path: Path) -> None:
    """Before any window, status shows no balancedness (it showed "actual 0.000"); forced
    and dry-run decisions carry their time (they said 0.0); history's text lines start
    with their UTC time (they had none)."""
    import time

    ctl = start_controller(tmp_path / "c.sqlite", PolicyConfig(paused=True, min_windows=1))
    ranks = _connect(ctl)
    try:
        code, text, _ = admin(ctl, "status", DEPLOYMENT)
        assert code == 0, text
        assert (
            "balancedness actual - (no window measured yet), on estimate - (no counts folded yet); "
            "0 windows folded (0 received since start)"
        ) in text
        assert "0.000" not in text
        rng = np.random.default_rng(5)
        _send(ctl, ranks, rng.integers(0, 50, (L, E)) * (1 + np.arange(E)), 3)
        code, text, _ = admin(ctl, "status", DEPLOYMENT)
        assert re.search(
            r"balancedness actual [01]\.\d{3}, on estimate [01]\.\d{3}; "
            r"3 windows folded \(6 received",
            text,
        ), text
        before = time.time()
        dry = json.loads(admin(ctl, "force", DEPLOYMENT, "--dry-run", "--json")[1])
        code, out, err = admin(ctl, "force", DEPLOYMENT, "--json")
        forced = json.loads(out)
        assert code == 0 and forced["outcome"] == "forced", err
        assert before - 1 <= dry["time"] <= forced["time"] <= time.time() + 1
        history = json.loads(admin(ctl, "history", DEPLOYMENT, "--json")[1])
        assert history["decisions"][0]["time"] == forced["time"]  # what was recorded
        code, text, _ = admin(ctl, "history", DEPLOYMENT)
        lines = text.splitlines()
        plans, decisions = (
            lines[1 : lines.index("decisions:")],
            lines[lines.index("decisions:") + 1 :],
        )
        sets = decisions[decisions.index("contingency sets:") + 1 :]
        decisions = decisions[: decisions.index("contingency sets:")]
        assert plans and decisions  # a contingency set may still be computed
        for line in plans + decisions + sets:
            assert re.match(rf"  {STAMP} ", line), line
        assert time.strftime("%Y-%m-%d %H:%M", time.gmtime(forced["time"])) in decisions[0]
    finally:
        for r in ranks:
            r.agent.stop()
        ctl.stop()


def test_contingency_lists_every_planned_loss(tmp_path: Path) -> None:
    """`admin contingency DEP`: each single loss with its balancedness after, the slots to
    refill and the experts from storage, planned by the controller once counts arrived;
    an unknown deployment exits 3 with NOT_FOUND."""
    ctl = start_controller(tmp_path / "c.sqlite", PolicyConfig(paused=True, min_windows=1))
    ranks: list[InstantRank] = []
    try:
        ranks = _feed(ctl)
        controller = ctl.server.controller  # type: ignore[union-attr]
        wait_for(
            lambda: ctl.call(lambda: controller.contingency.get(DEPLOYMENT)) is not None,
            30,
            "contingency set",
        )
        code, out, err = admin(ctl, "contingency", DEPLOYMENT, "--json")
        assert code == 0, err
        reply = json.loads(out)
        assert reply["planned"] and int(reply["base_version"]) == 0
        assert [loss["lost_ranks"] for loss in reply["losses"]] == [[r] for r in range(G)]
        for loss in reply["losses"]:
            assert loss["kind"] == "rank" and (
                loss["unserved"] > 0 or 0 < loss["balancedness"] <= 1
            )
        code, out, _ = admin(ctl, "contingency", DEPLOYMENT)
        assert code == 0 and "planned on v0" in out and out.count("\n  rank ") == G
        code, _, err = admin(ctl, "contingency", "nope")
        assert code == 3 and "NOT_FOUND" in err
    finally:
        for r in ranks:
            r.agent.stop()
        ctl.stop()


def test_policy_scale_down_nodes_is_set_shown_and_refused_precisely(tmp_path: Path) -> None:
    """`admin policy DEP scale_down_nodes=...`: a list travels and is stored; a count this
    one-node deployment cannot scale down to is refused by the controller (exit 2, the
    reason on stderr, nothing changed); a count that is not a whole number is refused
    before any call."""
    ctl = start_controller(tmp_path / "c.sqlite", PolicyConfig(paused=True, min_windows=1))
    ranks: list[InstantRank] = []
    try:
        ranks = _feed(ctl)
        code, out, err = admin(ctl, "policy", DEPLOYMENT)
        assert code == 0 and "scale_down_nodes = none" in out, err
        code, out, err = admin(ctl, "policy", DEPLOYMENT, "scale_down_nodes=1")
        assert code == 2 and out == ""
        assert (
            "scale_down_nodes: 1 nodes is no scale-down of a deployment of 1 node (at most 0)"
            in err
        )
        code, out, err = admin(ctl, "policy", DEPLOYMENT, "scale_down_nodes=2,x")
        assert code == 2 and out == "" and "'x' is not a whole number of nodes" in err
        code, out, err = admin(ctl, "policy", DEPLOYMENT, "scale_down_nodes=", "--json")
        assert code == 0, err
        assert json.loads(out).get("scale_down_nodes", {}).get("counts", []) == []
        controller = ctl.server.controller  # type: ignore[union-attr]
        assert (
            ctl.call(lambda: controller.deployment(DEPLOYMENT).policy.contingency.scale_down_nodes)
            == []
        )
    finally:
        for r in ranks:
            r.agent.stop()
        ctl.stop()
