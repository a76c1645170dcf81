"""`rebalancer admin regimes DEP` and `admin policy DEP regimes=...` against a real
controller, real worker agents and a real store: the library the regimes policy learned
from the windows, its text and JSON, an unknown deployment refused (exit 3, NOT_FOUND),
and the opt-in set and cleared over the wire."""

from __future__ import annotations

import json
from pathlib import Path

from rebalancer.controller.decide import PolicyConfig
from rebalancer.launch.instant import DEPLOYMENT, InstantRank
from tests.integration.conftest import start_controller
from tests.integration.test_admin_cli import _feed, admin
from tests.unit.deploy.live import wait_for


def test_admin_regimes_shows_the_library_the_policy_learned(tmp_path: Path) -> None:
    ctl = start_controller(tmp_path / "c.sqlite", PolicyConfig(regimes=True, min_windows=1))
    ranks: list[InstantRank] = []
    try:
        ranks = _feed(ctl)
        controller = ctl.server.controller  # type: ignore[union-attr]

        def learned() -> int:
            library = controller.deployments[DEPLOYMENT].loop.regimes
            return 0 if library is None else library.windows

        wait_for(lambda: ctl.call(learned) > 0, 30, "a decision of the regimes policy")
        code, out, err = admin(ctl, "regimes", DEPLOYMENT, "--json")
        assert code == 0, err
        reply = json.loads(out)
        assert (
            reply["enabled"]
            and reply["regimes"]
            and int(reply["current"]) in {int(r["id"]) for r in reply["regimes"]}
        )
        assert sum(int(r["windows"]) for r in reply["regimes"]) == int(reply["windows"])
        assert reply["last_load"]  # the decision says what load it used and why
        code, out, _ = admin(ctl, "regimes", DEPLOYMENT)
        assert code == 0 and "regimes policy" in out and f"current {reply['current']}" in out
        assert out.count("\n  ") >= len(reply["regimes"]) + 1
        code, _, err = admin(ctl, "regimes", "nope")
        assert code == 3 and "NOT_FOUND" in err
        code, out, err = admin(ctl, "policy", DEPLOYMENT, "regimes=false")
        assert code == 0 and "regimes = False" in out, err
        assert not ctl.call(lambda: controller.deployment(DEPLOYMENT).policy.regimes)
        code, out, _ = admin(ctl, "regimes", DEPLOYMENT)
        assert code == 0 and "adaptive policy" in out  # the library is kept, not used
        code, out, err = admin(ctl, "policy", DEPLOYMENT, "regimes=maybe")
        assert code == 2 and out == "" and "'maybe' is not true or false" in err
    finally:
        for r in ranks:
            r.agent.stop()
        ctl.stop()
