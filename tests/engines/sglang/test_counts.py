"""The staged update on SGLang's real code (tests/engines/sglang/worker.py names every
stand-in): what each rank sends is what it routed, expert by expert, across every swap of
every layer group, and a rank whose staging runs late holds every rank's swap.

The worker counts every pick per (layer, expert) and sums the windows the adapter hands
its (real) agent. Totals alone miss counts mapped with the wrong map (slot counts of the
passes before a swap read with the map after it): the check here is per expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.sglang_cpu import NUM_LAYERS
from tests.engines.sglang.test_plugin import (
    EXPERT_BYTES,
    WORLD,
    _check_staged_commits,
    _logs,
    _staged_run,
    sglang_env,
)
from worker_hooks.session.staging import ticket_parts

pytestmark = [pytest.mark.slow, sglang_env.needed()]

TWO_EXPERTS = {"REBALANCER_STAGING_BUDGET_BYTES": str(2 * EXPERT_BYTES)}


def _check_counts(results: dict[int, dict], steps: int) -> None:
    for rank, r in results.items():
        routed, sent = np.asarray(r["routed_logical"]), np.asarray(r["sent_logical"])
        assert routed.sum() == steps * (NUM_LAYERS - 1) * 16 * 2
        np.testing.assert_array_equal(sent, routed, err_msg=f"rank {rank}: counts per expert")
    # Every rank swapped the same groups at the same passes.
    assert len({json.dumps(r["tickets"]) for r in results.values()}) == 1


def test_counts_per_expert_survive_every_layer_group_swap(tmp_path: Path) -> None:
    """A budget of two experts per rank: plans swap in several layer groups, each at an
    agreed pass; between them the map is mixed (logical counts only go up). Every rank
    sends, per (layer, expert), exactly the picks it routed."""
    steps = 160
    codes, results, dep = _staged_run(tmp_path, steps=steps, settings=TWO_EXPERTS)
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert dep.stats.plans_committed >= 1  # type: ignore[attr-defined]
    _check_staged_commits(results, dep)
    assert max(results[0]["groups"]) > 1, results[0]["groups"]
    _check_counts(results, steps)


def test_a_rank_whose_staging_lags_the_agreed_pass_holds_every_ranks_swap(tmp_path: Path) -> None:
    """Rank 3's staging of every layer group after a plan's first ends 1.5 s after its
    transfers (the worker's stand-in for a slow rank: a sleep after the real exchange with
    its peers, before the executor holds the staging): its peers are staged and ready long before
    it, and no rank swaps a group until rank 3's staging of it is done. Every rank swaps
    each group at the same pass, after every pass each layer's weights are its map's,
    and the counts per expert are what each rank routed."""
    # Each group staged after the commit takes rank 3's 1.5 s, about 100 passes: a plan of
    # 8 groups needs about 800 (160 were too few for a plan of 15 slots).
    steps = 1000
    codes, results, dep = _staged_run(
        tmp_path, steps=steps, settings=TWO_EXPERTS, extra={3: ["--lag-staging", "1.5"]}
    )
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert dep.stats.plans_committed >= 1  # type: ignore[attr-defined]
    _check_staged_commits(results, dep)
    _check_counts(results, steps)
    swaps = [(p, ticket_parts(t)) for p, t in results[0]["tickets"][1:]]
    later = [(p, g) for p, (_, g) in swaps if g > 1]
    assert later, swaps  # some plan had a group staged after its commit, under the lag
