"""Where the SGLang tests find SGLang: its own folder, never the project's venv.

SGLang pins torch 2.14.1 (the venv has 2.13.0 CPU), so scripts/sglang_env.sh installs
the SGLang wheel and the light packages its EPLB code imports with `--no-deps` into
.ci/tools/sglang-site (CI: `.ci/run --tools`). The tests run SGLang in worker
processes with that folder and cpu_shims (test-only stubs of triton and torchvision)
on PYTHONPATH, and skip with the reason when the folder is missing, except in CI
(.ci/run sets REBALANCER_REQUIRE_SGLANG=1): there they fail, so a CI run without SGLang
never passes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SITE = Path(os.environ.get("REBALANCER_SGLANG_SITE", ROOT / ".ci" / "tools" / "sglang-site"))
SHIMS = Path(__file__).resolve().parent / "cpu_shims"
MISSING = (
    f"SGLang is not provisioned at {SITE}: run scripts/sglang_env.sh (CI: .ci/run --tools)"
)


def available() -> bool:
    return (SITE / "sglang" / "srt" / "eplb" / "eplb_manager.py").is_file()


REQUIRE_ENV = "REBALANCER_REQUIRE_SGLANG"


def needed() -> pytest.MarkDecorator:
    """The mark of a test module that runs SGLang: skip when SGLang is missing, or fail at
    collection when REBALANCER_REQUIRE_SGLANG=1 (CI)."""
    if not available() and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{MISSING} ({REQUIRE_ENV}=1: CI runs these tests)", pytrace=False)
    return pytest.mark.skipif(not available(), reason=MISSING)


def environment(**extra: str) -> dict[str, str]:
    """The environment of a process that imports SGLang: the repo, SGLang's folder, the
    CPU shims (after SGLang's folder, so a real triton there would win)."""
    env = dict(os.environ)
    paths = [str(ROOT), str(SITE), str(SHIMS)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("SGLANG_ROLE_NAMESPACES", "off")
    env.update(extra)
    return env
