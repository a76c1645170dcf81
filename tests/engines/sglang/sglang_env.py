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

from bench.sglang_cpu import MISSING, available

REQUIRE_ENV = "REBALANCER_REQUIRE_SGLANG"


def needed() -> pytest.MarkDecorator:
    """The mark of a test module that runs SGLang: skip when SGLang is missing, or fail at
    collection when REBALANCER_REQUIRE_SGLANG=1 (CI)."""
    if not available() and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{MISSING} ({REQUIRE_ENV}=1: CI runs these tests)", pytrace=False)
    return pytest.mark.skipif(not available(), reason=MISSING)
