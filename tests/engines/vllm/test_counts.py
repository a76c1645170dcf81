"""What the vLLM adapter sends is what vLLM recorded, expert by expert, across plans.

4 gloo ranks on vLLM's real EPLB code (tests/engines/vllm/worker.py names every
stand-in), a real controller. The worker routes through vLLM's maps into vLLM's load
view while vLLM's `should_record_tensor` is set (as vLLM's router does), keeps what it
recorded per (layer, expert), and sums the windows the adapter hands its (real) agent.
Totals alone miss counts mapped to experts with the wrong map (slot counts of the steps
before a switch read with the map after it): the check here is per expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.engines.vllm import vllm_env
from tests.engines.vllm.test_adapter import DEPLOYMENT, FAST_POLICY, WORLD, _logs, _run_ranks
from tests.integration.conftest import start_controller

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_env.available(), reason=vllm_env.MISSING),
]


def _run(tmp_path: Path, steps: int, flags: list[str]) -> tuple[dict[int, dict], int]:
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY, ready=True)
    assert ctl.server is not None
    try:
        codes, results = _run_ranks(tmp_path, ctl.server.address, steps=steps, common=flags)
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
        committed = ctl.call(lambda: dep.stats.plans_committed)
        nodes = ctl.call(lambda: dep.shape.num_nodes)
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert nodes == (2 if "--nodes" in flags else 1)  # the shape the ranks registered
    return results, committed


def _check_per_expert(results: dict[int, dict]) -> None:
    """Every rank sent, per (layer, expert), exactly what vLLM recorded for it, and every
    rank switched to the same versions at the same steps, its weights matching its map."""
    for r in results.values():
        recorded, sent = np.asarray(r["recorded_logical"]), np.asarray(r["sent_logical"])
        assert recorded.sum() > 0
        np.testing.assert_array_equal(
            sent, recorded, err_msg=f"rank {r['rank']}: counts per expert"
        )
        versions = [v for _, _, v in r["sent_windows"]]
        assert versions == sorted(versions)  # windows go up in the order of the versions served
        assert r["weights_match_map"] and r["dispatch_mismatches"] == 0
    assert len({json.dumps(r["commits"]) for r in results.values()}) == 1


def test_counts_per_expert_survive_every_switch(tmp_path: Path) -> None:
    """Sync mode, the popularity drifting so that several plans commit: the windows
    around each switch carry the counts of the map each step ran on. Two fake nodes: EP
    and EPLB groups of their own, as vLLM builds them (the agreement on EPLB's)."""
    results, committed = _run(tmp_path, 120, ["--drift", "30", "--nodes", "2"])
    assert committed >= 1, _logs(tmp_path)
    _check_per_expert(results)
    for r in results.values():
        assert np.asarray(r["sent_logical"]).sum() == r["routed"]  # window == interval: every step


def test_a_window_larger_than_the_interval_in_async_mode(tmp_path: Path) -> None:
    """vLLM's window (32 steps) longer than its rearrangement interval (8), async mode
    (the per-layer path; vLLM keeps recording while a rearrangement runs past the
    interval): vLLM's ring of rows wraps out of step with the rearrangements, the
    adapter still takes every row once, counted on the map its step ran on."""
    results, committed = _run(tmp_path, 120, ["--async-mode", "--interval", "8", "--window", "32"])
    assert committed >= 1, _logs(tmp_path)
    _check_per_expert(results)
    for r in results.values():
        assert np.asarray(r["sent_logical"]).sum() == r["routed"]  # window > interval: every step


def test_a_window_shorter_than_the_interval_sends_what_vllm_recorded(tmp_path: Path) -> None:
    """vLLM's `should_record` gating: with a window of 4 steps and an interval of 12,
    vLLM records only the last 4 steps before each rearrangement (its router adds nothing
    to the load view otherwise). The adapter sends exactly those, per expert: none of
    the unrecorded steps, none twice."""
    results, _ = _run(tmp_path, 96, ["--interval", "12", "--window", "4"])
    _check_per_expert(results)
    for r in results.values():
        sent = np.asarray(r["sent_logical"]).sum()
        assert 0 < sent < r["routed"]  # the gated steps are not in any window
