"""Where the vLLM tests find vLLM: its own folder, never the project's venv.

vLLM pins CUDA torch (the venv has 2.13.0 CPU), so scripts/vllm_env.sh installs the
vllm 0.33.0 wheel (compiled extensions removed) and the light packages its EPLB code
imports with `--no-deps` into .ci/tools/vllm-site (CI: `.ci/run --tools`, which fails
when it cannot). The tests run vLLM in worker processes with that folder on PYTHONPATH
and VLLM_TARGET_DEVICE=cpu, and skip with the reason when the folder is missing.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from tests.engines import zygote

ROOT = Path(__file__).resolve().parents[3]
SITE = Path(os.environ.get("REBALANCER_VLLM_SITE", ROOT / ".ci" / "tools" / "vllm-site"))
# The tested vLLM: pyproject.toml's `vllm` extra pins it (vllm==VERSION), the one place it is set.
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
    "vllm"
][0].split("==")[1]
MISSING = f"vLLM is not provisioned at {SITE}: run scripts/vllm_env.sh (CI: .ci/run --tools)"


# What a rank imports that costs (about 9 s of CPU): the zygote imports it once
# (tests/engines/zygote.py) and forks the ranks from there.
PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "vllm.config",
    "vllm.distributed.parallel_state",
    "vllm.distributed.eplb.eplb_state",
    "vllm.distributed.eplb.async_worker",
    "vllm.distributed.eplb.rebalance_execute",
    "vllm.distributed.eplb.policy",
    "vllm.distributed.stateless_coordinator",
    "vllm.plugins",
    "vllm.v1.worker.gpu.eplb_utils",
]


def available() -> bool:
    return (SITE / f".provisioned-{VERSION}").is_file()


def environment(**extra: str) -> dict[str, str]:
    """The environment of a process that imports vLLM: the repo, then vLLM's folder."""
    env = dict(os.environ)
    paths = [str(ROOT), str(SITE)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(extra)
    return env


def rank_starter() -> zygote.Zygote:
    """The session's zygote for vLLM ranks: `rank_starter().popen(...)` as subprocess.Popen."""
    return zygote.for_engine(PRELOAD, environment(), ROOT)
