"""The reliability campaign, short (bench/chaos.py; the long one is in RELIABILITY.md): a real
controller process on an SQLite store, a sidecar per pod, real gloo ranks on real routing
data, every gRPC link through the loopback fault proxy. Each fault kind of the short list
is injected (at least once, at plan phases in turn), and after every episode the store,
the controller and every rank agree again; from the ranks' own step logs every step ran
one version on every rank, outputs equal the unbalanced reference, no rank ran a version
that is not committed, no step waited on the rebalancer; nothing is left running."""

from __future__ import annotations

import pytest

from bench.chaos import LINK_FAULTS, ChaosConfig, run_chaos

pytestmark = pytest.mark.slow

# One of each family: a process killed (each kind of process), frozen, every link fault,
# and the store faults; a worker kill restarts the group (the costliest episode).
SHORT_KINDS = (
    "sigkill_controller", "sigterm_sidecar", "sigkill_worker", "sigstop_controller",
    *LINK_FAULTS, "store_torn_wal", "store_disk_full",
)


def test_short_chaos_campaign_keeps_every_invariant() -> None:
    config = ChaosConfig(seconds=15.0, seed=11, workers=2, pods=2, kinds=SHORT_KINDS, progress=False)
    result = run_chaos(config)
    assert result["invariant_violations"] == 0, result["violations"]
    assert result["leaked_processes"] == 0
    assert set(result["faults_by_kind"]) == set(SHORT_KINDS), result["faults_by_kind"]
    assert result["controller_restarts"] >= 2 and result["group_restarts"] >= 1
    assert result["controller_recovery_seconds_p99"] < config.recovery_bound_seconds
    assert result["max_step_wait_ms"] <= config.step_wait_bound_ms
    assert result["steps_logged"] > 0 and result["plans_committed"] >= 1
