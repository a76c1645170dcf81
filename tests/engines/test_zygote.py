"""The zygote the engine tests fork their ranks from (tests/engines/zygote.py): a forked
rank is `python -m MODULE ARGS` as the interpreter would run it, and none outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engines import zygote
from tests.engines.vllm.vllm_env import ROOT

PROBE = "tests.engines.zygote_probe"


@pytest.fixture
def starter() -> zygote.Zygote:
    z = zygote.Zygote(["json"], dict(os.environ), ROOT)
    yield z
    z.close()


def _start(z: zygote.Zygote, tmp_path: Path, *args: str, **env: str):  # noqa: ANN202
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    log = open(tmp_path / "out.log", "w")  # noqa: SIM115 - closed below
    try:
        return z.popen(
            [sys.executable, "-m", PROBE, *args],
            cwd=tmp_path,
            env={**os.environ, "TMPDIR": str(tmp), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()


def _said(tmp_path: Path) -> tuple[dict, str]:
    lines = (tmp_path / "out.log").read_text().splitlines()
    return json.loads(lines[0]), "\n".join(lines[1:])


def test_a_forked_rank_runs_its_module_as_main_with_its_own_argv_env_folder_and_output(
    starter: zygote.Zygote, tmp_path: Path
) -> None:
    rank = _start(starter, tmp_path, "0", "--flag", PROBE="seen")
    assert rank.wait(timeout=60) == 0
    said, rest = _said(tmp_path)
    assert said["argv"] == ["0", "--flag"]
    assert said["probe"] == "seen"
    assert said["cwd"] == str(tmp_path)
    assert said["tmp"] == str(tmp_path / "tmp")  # TMPDIR read again, not the zygote's
    assert said["main"] == "__main__"
    assert said["pid"] == rank.pid and said["ppid"] == starter.process.pid
    assert "to stderr" in rest  # stderr goes where stdout goes (STDOUT)


@pytest.mark.parametrize(("action", "code"), [("3", 3), ("raise", 1)])
def test_a_forked_rank_ends_with_the_code_python_would(
    starter: zygote.Zygote, tmp_path: Path, action: str, code: int
) -> None:
    rank = _start(starter, tmp_path, action)
    assert rank.wait(timeout=60) == code
    assert rank.poll() == code
    if action == "raise":
        assert "ValueError: a rank failed" in _said(tmp_path)[1]


def test_a_killed_rank_says_the_signal_and_wait_times_out_like_popen(
    starter: zygote.Zygote, tmp_path: Path
) -> None:
    rank = _start(starter, tmp_path, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        rank.wait(timeout=0.5)
    assert rank.poll() is None
    rank.kill()
    assert rank.wait(timeout=30) == -signal.SIGKILL


def test_closing_the_zygote_ends_its_ranks(tmp_path: Path) -> None:
    z = zygote.Zygote(["json"], dict(os.environ), ROOT)
    try:
        rank = _start(z, tmp_path, "sleep")
        deadline = time.monotonic() + 30
        while not (tmp_path / "out.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        z.close()
    assert rank.wait(timeout=30) < 0
    assert not Path(f"/proc/{rank.pid}").exists()


def test_a_preload_that_starts_grpc_is_refused() -> None:
    with pytest.raises(RuntimeError, match="grpc"):
        zygote.Zygote(["grpc"], dict(os.environ), ROOT)


def test_a_command_that_is_not_a_module_run_is_started_as_a_process(
    starter: zygote.Zygote, tmp_path: Path
) -> None:
    with open(tmp_path / "out.log", "w") as log:
        proc = starter.popen(
            [sys.executable, "-c", "print('plain')"],
            cwd=tmp_path,
            env=dict(os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "out.log").read_text().strip() == "plain"


def test_a_killed_test_process_leaves_neither_the_zygote_nor_its_ranks(tmp_path: Path) -> None:
    """The test process SIGKILLed: the zygote (PR_SET_PDEATHSIG, and its parent watch) and the
    ranks it forked (theirs) end with it."""
    script = (
        "import os, subprocess, sys, time\n"
        "from pathlib import Path\n"
        "from tests.engines import zygote\n"
        "z = zygote.Zygote(['json'], dict(os.environ), Path(sys.argv[1]))\n"
        "log = open(sys.argv[2], 'w')\n"
        f"r = z.popen([sys.executable, '-m', '{PROBE}', 'sleep'], cwd=sys.argv[1], "
        "env=dict(os.environ),\n"
        "            stdout=log, stderr=subprocess.STDOUT)\n"
        "print(z.process.pid, r.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(ROOT), str(tmp_path / "out.log")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
