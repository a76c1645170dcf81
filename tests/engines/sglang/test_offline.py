"""The offline path on every DeepSeek-V3 workload, against SGLang's own loader and EPLB.

Runs bench/sglang_offline.py in a process with SGLang on its path: SGLang's recorder
dump -> `rebalancer plan --sglang-out` -> SGLang's `compute_initial_expert_location_metadata`
installs exactly the planned map, and ours is at least as balanced as SGLang's own
`init_by_eplb` on the same dump, never above the bound.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import sglang_cpu
from tests.engines.sglang import sglang_env

pytestmark = [
    pytest.mark.slow,
    sglang_env.needed(),
]


def test_plan_file_installs_in_sglang_and_beats_its_eplb_on_every_workload() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.sglang_offline", "--json"],
        cwd=sglang_cpu.ROOT,
        env=sglang_cpu.environment(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = summary["workloads"]
    assert len(rows) == 6
    for row in rows:
        assert row["loaded_equals_planned"], row
        assert row["ours"] >= row["sglang_init_by_eplb"], row
        assert row["ours"] <= row["bound"] + 1e-9, row
