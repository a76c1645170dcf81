"""Hypothesis profiles for the fuzz suite.

`ci` (default): a modest number of examples per test, derandomized so every run tries
the same inputs (a failure reproduces, CI stays deterministic), no per-example deadline
(the machines are shared). `long`: many more examples with fresh randomness, for a
campaign run by hand: HYPOTHESIS_PROFILE=long pytest tests/fuzz.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)

settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_COMMON)
settings.register_profile("long", max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
