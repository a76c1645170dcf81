"""CI never passes without SGLang (issue 20): `.ci/run` turned a failed SGLang provisioning
into skipped tests.

`.ci/run --tools` runs in a copy of the repo's CI files in a temporary folder, with
promtool and the npm schemas already there (so only SGLang is provisioned) and pip unable
to reach any index: it must exit non-zero with one line naming the cause. And with
REBALANCER_REQUIRE_SGLANG=1 (what .ci/run sets for the test suite) a missing SGLang fails
the SGLang tests at collection instead of skipping them. Neither needs the network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench import sglang_cpu

ROOT = sglang_cpu.ROOT
OPERATOR = Path("tests/unit/deploy/operator")


def _ci_copy(tmp_path: Path) -> Path:
    """The files .ci/run reads, with promtool and the npm schemas already provided."""
    repo = tmp_path / "repo"
    for name in (
        ".ci/run",
        "scripts/sglang_env.sh",
        "pyproject.toml",
        OPERATOR / "package.json",
        OPERATOR / "package-lock.json",
    ):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)
    promtool = repo / ".ci/tools/usr/bin/promtool"
    promtool.parent.mkdir(parents=True)
    promtool.write_text("#!/bin/sh\n")
    promtool.chmod(0o755)
    npm = repo / ".ci/tools/npm"
    (npm / "node_modules/@kubernetes-models/prometheus-operator").mkdir(parents=True)
    shutil.copy2(ROOT / OPERATOR / "package-lock.json", npm / "package-lock.json")
    return repo


def test_a_failed_sglang_provisioning_fails_ci(tmp_path: Path) -> None:
    repo = _ci_copy(tmp_path)
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": "",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if "promtool" not in p
    )
    out = subprocess.run(
        [str(repo / ".ci/run"), "--tools"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0, out.stderr[-2000:]
    assert "[ci] could not provision SGLang (scripts/sglang_env.sh failed)" in out.stderr
    assert not (repo / ".ci/tools/sglang-site/.provisioned-0.5.23").exists()


def test_in_ci_a_missing_sglang_fails_the_tests_instead_of_skipping(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "REBALANCER_SGLANG_SITE": str(tmp_path / "nowhere"),
        "REBALANCER_REQUIRE_SGLANG": "1",
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "tests/engines/sglang/test_offline.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0, out.stdout[-2000:]
    assert (
        "SGLang is not provisioned at" in out.stdout and "REBALANCER_REQUIRE_SGLANG=1" in out.stdout
    )
    env.pop(
        "REBALANCER_REQUIRE_SGLANG"
    )  # a developer's run without SGLang: skipped, with the reason
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            "tests/engines/sglang/test_offline.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "SKIPPED" in out.stdout, out.stdout[-2000:]
