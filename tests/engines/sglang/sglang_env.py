"""Where the SGLang tests find SGLang: its own folder, never the project's venv.

Where it is and the environment of a process that imports it are bench/sglang_cpu.py's
(bench/sglang_staged.py runs SGLang too); the tests run SGLang in worker processes with
that environment, and skip with the reason when the folder is missing, except in CI
(.ci/run sets REBALANCER_REQUIRE_SGLANG=1): there they fail, so a CI run without SGLang
never passes.
"""

from __future__ import annotations

import os

import pytest

from bench.sglang_cpu import MISSING, ROOT, available, environment
from tests.engines import zygote

REQUIRE_ENV = "REBALANCER_REQUIRE_SGLANG"
# What a rank imports that costs (about 7 s of CPU): the zygote imports it once
# (tests/engines/zygote.py) and forks the ranks from there.
PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "sglang.srt.configs.model_config",
    "sglang.srt.server_args",
    "sglang.srt.runtime_context",
    "sglang.srt.plugins",
    "sglang.srt.eplb.expert_distribution",
    "sglang.srt.eplb.expert_location",
    "sglang.srt.eplb.expert_location_dispatch",
    "sglang.srt.eplb.expert_location_updater",
    "sglang.srt.eplb.eplb_manager",
    "sglang.srt.eplb.lplb_solver",
    "sglang.srt.eplb.eplb_algorithms.elasticity_aware",
    "sglang.srt.elastic_ep.elastic_ep",
    "sglang.kernels.ops.lplb.torch_solver",
]


def rank_starter() -> zygote.Zygote:
    """The session's zygote for SGLang ranks: `rank_starter().popen(...)` as subprocess.Popen."""
    return zygote.for_engine(PRELOAD, environment(), ROOT)


def needed() -> pytest.MarkDecorator:
    """The mark of a test module that runs SGLang: skip when SGLang is missing, or fail at
    collection when REBALANCER_REQUIRE_SGLANG=1 (CI)."""
    if not available() and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{MISSING} ({REQUIRE_ENV}=1: CI runs these tests)", pytrace=False)
    return pytest.mark.skipif(not available(), reason=MISSING)
