"""AdminService and `rebalancer admin` against a real server fed real DeepSeek-V3 counts.

Ranks here are real WorkerAgents (the worker library's gRPC client) whose plan
handlers answer at once, so the admin paths run against a live deployment
without weight moves (those are covered by test_end_to_end)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rebalancer import placement
from rebalancer.cli import main as cli
from rebalancer.controller.admin import policy_from_msg, policy_msg
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.controller.estimate import EstimatorConfig
from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3
from rebalancer.formats import read_placement
from rebalancer.launch.instant import InstantRank
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.shape import shape_of
from tests.integration.conftest import start_controller

L, E, P, G = 4, 256, 288, 32
TOKEN = "admin-secret"
SHAPE = pb.ModelShape(
    num_layers=L,
    num_logical_experts=E,
    num_physical_slots=P,
    num_gpus=G,
    num_nodes=4,
    expert_bytes=44 << 20,
)


def real_counts() -> np.ndarray:
    counts = load_deepseek_v3(deepseek_v3_files()[0])
    return counts[[0, 15, 30, 45]]  # 4 real MoE layers [4, 256]


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EmbeddedController, list[InstantRank]]]:
    db = tmp_path_factory.mktemp("admin") / "c.sqlite"
    # Paused: only forced plans happen here.
    policy = PolicyConfig(paused=True, min_windows=1)
    ctl = start_controller(db, policy, admin_token=TOKEN, metrics_port=0)
    assert ctl.server is not None
    ranks = [InstantRank(r, ctl.server.address, "dsv3", shape=shape_of(SHAPE)) for r in range(G)]
    for r in ranks:
        r.agent.start()
    for r in ranks:
        assert r.agent.connected.wait(10)
    counts = real_counts()
    for seq in range(3):
        for r in ranks:  # each rank sees its share of the traffic
            r.agent.submit_window(seq * 8, 8, 0, counts // G, None)
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and ctl.call(lambda: ctl.server.controller.deployments["dsv3"].stats.windows_ingested)
        < 3 * G
    ):  # type: ignore[union-attr]
        time.sleep(0.05)
    yield ctl, ranks
    for r in ranks:
        r.agent.stop()
    ctl.stop()


def admin(ctl: EmbeddedController, *args: str, token: str | None = TOKEN) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    base = ["admin", "--address", ctl.server.address]  # type: ignore[union-attr]
    if token:
        base += ["--token", token]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli([*base, *args])
    return code, out.getvalue(), err.getvalue()


def test_status(live: tuple[EmbeddedController, list[InstantRank]]) -> None:
    ctl, _ = live
    code, out, _ = admin(ctl, "--json", "status")
    assert code == 0
    (dep,) = json.loads(out)["deployments"]
    assert dep["deployment"] == "dsv3" and dep["connected_ranks"] == G
    # Windows folded into the estimate (as the decisions count them), one per seq over all
    # ranks; and received, one per rank's window.
    folded = ctl.call(lambda: ctl.server.controller.deployments["dsv3"].estimator.windows)  # type: ignore[union-attr]
    assert int(dep["windows_folded"]) == folded and 3 <= folded < 3 * G
    assert int(dep["windows_ingested"]) == 3 * G
    assert 0.3 < dep["balancedness_estimated"] < 0.9
    code, out, _ = admin(ctl, "status", "dsv3")
    assert code == 0 and "32/32 ranks" in out


def test_dry_run_predicts_what_the_engine_reports(
    live: tuple[EmbeddedController, list[InstantRank]],
) -> None:
    ctl, _ = live
    before = ctl.call(
        lambda: (
            ctl.server.controller.deployments["dsv3"].version,
            len(ctl.server.store.plans("dsv3")),
        )
    )  # type: ignore[union-attr]
    code, out, _ = admin(ctl, "--json", "force", "dsv3", "--dry-run")
    assert code == 0
    reply = json.loads(out)
    assert reply["outcome"] == "dry_run" and reply["plan_version"] == 0 and reply["transfers"] > 0
    dep = ctl.call(lambda: ctl.server.controller.deployments["dsv3"])  # type: ignore[union-attr]
    estimate = ctl.call(lambda: dep.estimator.estimate())  # type: ignore[attr-defined]
    engine = placement.compute_placement(
        estimate, P, G, 4, previous=dep.phy2log, max_moved_fraction=dep.policy.max_moved_fraction
    )  # type: ignore[attr-defined]
    assert reply["balancedness_candidate"] == pytest.approx(engine.balancedness, abs=1e-9)
    assert reply["balancedness_current"] == pytest.approx(
        placement.balancedness(dep.phy2log, estimate, G), abs=1e-9
    )  # type: ignore[attr-defined]
    assert reply["balancedness_candidate"] > reply["balancedness_current"]
    after = ctl.call(
        lambda: (
            ctl.server.controller.deployments["dsv3"].version,
            len(ctl.server.store.plans("dsv3")),
        )
    )  # type: ignore[union-attr]
    assert after == before  # a dry run changes nothing


def test_force_commits_and_history_and_placement_export(
    live: tuple[EmbeddedController, list[InstantRank]], tmp_path: Path
) -> None:
    ctl, ranks = live
    code, out, _ = admin(ctl, "--json", "force", "dsv3", "--max-moved-fraction", "0.2")
    assert code == 0
    reply = json.loads(out)
    assert (
        reply["outcome"] == "forced"
        and reply["plan_version"] >= 1
        and reply["moved_fraction"] <= 0.2 + 1e-9
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(r.version != reply["plan_version"] for r in ranks):
        time.sleep(0.05)
    assert all(r.version == reply["plan_version"] for r in ranks)
    code, out, _ = admin(ctl, "--json", "history", "dsv3")
    assert code == 0
    history = json.loads(out)
    assert (
        history["plans"][0]["state"] == "committed" and history["plans"][0]["trigger"] == "forced"
    )
    assert any(d["outcome"] == "forced" for d in history["decisions"])
    code, _, _ = admin(
        ctl,
        "placement",
        "dsv3",
        "--out",
        str(tmp_path / "p.json"),
        "--sglang",
        str(tmp_path / "s.json"),
    )
    assert code == 0
    saved = read_placement(tmp_path / "p.json")
    assert (
        saved.version == reply["plan_version"]
        and saved.phy2log.shape == (L, P)
        and saved.num_gpus == G
    )
    assert (
        json.loads((tmp_path / "s.json").read_text())["physical_to_logical_map"]
        == saved.phy2log.tolist()
    )


def test_pause_resume_and_policy(live: tuple[EmbeddedController, list[InstantRank]]) -> None:
    ctl, _ = live
    assert admin(ctl, "pause", "dsv3")[0] == 0
    assert json.loads(admin(ctl, "--json", "status", "dsv3")[1])["deployments"][0]["paused"] is True
    assert admin(ctl, "resume", "dsv3")[0] == 0
    assert (
        json.loads(admin(ctl, "--json", "status", "dsv3")[1])["deployments"][0].get("paused", False)
        is False
    )
    code, out, _ = admin(
        ctl, "--json", "policy", "dsv3", "gain_threshold=0.05", "max_moved_fraction=0.3"
    )
    assert code == 0 and json.loads(out)["gain_threshold"] == 0.05
    assert json.loads(admin(ctl, "--json", "policy", "dsv3")[1])["max_moved_fraction"] == 0.3
    # Bad values: refused with exit 2, policy unchanged.
    code, _, err = admin(ctl, "policy", "dsv3", "max_moved_fraction=1.5")
    assert code == 2 and "max_moved_fraction" in err
    code, _, err = admin(ctl, "policy", "dsv3", "nonsense=1")
    assert code == 2 and "key one of" in err
    assert json.loads(admin(ctl, "--json", "policy", "dsv3")[1])["max_moved_fraction"] == 0.3
    # The estimator's shrinkage: a boolean and a fraction; a bad boolean is refused.
    code, out, _ = admin(ctl, "--json", "policy", "dsv3", "shrink=false", "prior_decay=0.95")
    assert (
        code == 0 and json.loads(out)["shrink"] is False and json.loads(out)["prior_decay"] == 0.95
    )
    code, _, err = admin(ctl, "policy", "dsv3", "shrink=maybe")
    assert code == 2 and "true or false" in err
    # A message without the optional fields keeps their current values.
    base = PolicyConfig(estimator=EstimatorConfig(shrink=False, prior_decay=0.95))
    msg = policy_msg(base)
    msg.ClearField("shrink")
    msg.ClearField("prior_decay")
    kept = policy_from_msg(msg, base)
    assert kept.estimator.shrink is False and kept.estimator.prior_decay == 0.95


def test_refusals_change_nothing(live: tuple[EmbeddedController, list[InstantRank]]) -> None:
    ctl, _ = live
    before = admin(ctl, "--json", "status")[1]
    code, _, err = admin(ctl, "status", "nope")
    assert code == 3 and "unknown deployment" in err
    code, _, err = admin(ctl, "pause", "dsv3", token=None)
    assert code == 6 and "UNAUTHENTICATED" in err
    code, _, err = admin(ctl, "force", "dsv3", token="wrong")
    assert code == 6 and "PERMISSION_DENIED" in err
    code, _, err = admin(ctl, "force", "dsv3", "--max-moved-fraction", "7")
    assert code == 2
    after = admin(ctl, "--json", "status")[1]
    strip = lambda s: {  # noqa: E731
        k: v
        for k, v in json.loads(s)["deployments"][0].items()
        if k not in ("balancedness_actual",)
    }
    assert strip(after) == strip(before)


def test_metrics_exposition_passes_promtool(
    live: tuple[EmbeddedController, list[InstantRank]], tmp_path: Path
) -> None:
    ctl, _ = live
    port = ctl.server.metrics_port  # type: ignore[union-attr]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in (
        "rebalancer_balancedness",
        "rebalancer_placement_version",
        "rebalancer_connected_ranks",
        "rebalancer_windows_ingested_total",
        "rebalancer_decisions_total",
        "rebalancer_ingest_seconds_bucket",
        "rebalancer_build_info",
        "rebalancer_plans_total",
    ):
        assert name in text, name
    assert 'rebalancer_connected_ranks{deployment="dsv3"} 32.0' in text
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing in CI (.ci/run provides it)")
        pytest.skip("promtool not installed (.ci/run provides it)")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_force_meeting_a_plan_in_flight_is_refused_or_waits_for_it(
    live: tuple[EmbeddedController, list[InstantRank]],
) -> None:
    """A plan in flight (one rank holds its PREPARED back): `force` is refused at once
    with the plan named (exit 4); `force --wait` waits for it to end (said on stderr), then
    starts its own. The tree before had no --wait: the docs' first hour failed so at load."""
    ctl, ranks = live
    held, release = ranks[0], threading.Event()
    original = held.on_prepare

    def late_prepare(prepare: pb.Prepare) -> None:
        threading.Thread(target=lambda: (release.wait(30), original(prepare)), daemon=True).start()

    held.on_prepare = late_prepare  # type: ignore[method-assign]
    try:
        code, out, _ = admin(ctl, "--json", "force", "dsv3", "--max-moved-fraction", "0.05")
        assert code == 0, out
        first = json.loads(out)["plan_version"]
        code, _, err = admin(ctl, "force", "dsv3")
        assert code == 4 and f"plan v{first} is in flight" in err
        threading.Timer(1.0, release.set).start()
        code, out, err = admin(ctl, "--json", "force", "dsv3", "--wait", "30")
        assert f"waiting up to 30 s for plan v{first} in flight to end" in err
        assert code == 0, err
        assert json.loads(out)["plan_version"] > first
        code, _, err = admin(ctl, "force", "dsv3", "--wait", "-1")
        assert code == 2 and "--wait must be a number of seconds >= 0" in err
    finally:
        held.on_prepare = original  # type: ignore[method-assign]
        release.set()
