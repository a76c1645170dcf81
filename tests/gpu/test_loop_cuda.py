"""The whole loop with the workers' hooks and expert weights on GPUs (skipped without
two): the real controller, two worker processes each on its own GPU, plans moved
between the GPUs by NCCL p2p or by the copy engines (ipc), committed at one agreed step.
Invariants 1 and 2 as in tests/integration/test_end_to_end.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rebalancer.controller.cost import CostParams
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.estimate import EstimatorConfig
from rebalancer.demo import run_demo
from rebalancer.launch.config import DemoConfig
from worker_hooks.config import WindowConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

POLICY = PolicyConfig(
    min_interval_seconds=0.5,
    gain_threshold=0.03,
    horizon_seconds=60.0,
    max_moved_fraction=1.0,
    min_windows=2,
    decision_period_seconds=0.2,
    prepare_timeout_seconds=30.0,
    estimator=EstimatorConfig(decay=0.5),
    cost=CostParams(step_seconds=0.01),
)


@pytest.mark.parametrize(("transport", "spare_rows"), [("p2p", 0), ("ipc", 0), ("ipc", 12)])
def test_loop_on_gpus_keeps_outputs_identical(
    tmp_path: Path, transport: str, spare_rows: int
) -> None:
    config = DemoConfig(
        workers=2,
        layers=4,
        experts=16,
        slots=24,
        tokens=16,
        steps=160,
        windows=WindowConfig(steps=8),
        windows_per_phase=5,
        timeout_seconds=90.0,
        policy=POLICY,
        transport=transport,
        device="cuda",
        db_path=str(tmp_path / "c.sqlite"),
        spare_rows=spare_rows,
    )
    summary = run_demo(config, emit=lambda _: None)
    assert summary["plans_committed"] >= 1
    assert summary["bytes_moved"] > 0
    assert summary["max_output_diff"] == 0.0
    assert summary["weights_match_map"]
    assert summary["ranks_agree_on_versions"]
    if spare_rows:  # 12 spare rows hold anything a rank of 12 slots gains: no copy at commit
        assert summary["experts_copied_at_commit"] == 0
