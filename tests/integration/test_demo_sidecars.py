"""`rebalancer demo` with real processes, through pod sidecars (its default) and direct:
the same summary keys, plans commit, outputs identical to the reference, every rank on
the same versions; no worker or sidecar outlives the demo, whether it ends, is
interrupted (Ctrl-C), terminated (SIGTERM) or killed (SIGKILL), and its temporary folder goes unless
--keep."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO, Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="walks /proc"),
]

SMALL = ["--workers", "4", "--windows", "10", "--layers", "2", "--experts", "16"]
KEYS = {
    "windows",
    "steps",
    "workers",
    "sidecars",
    "plans_proposed",
    "plans_committed",
    "plans_aborted",
    "placement_version",
    "balancedness_first",
    "balancedness_last",
    "balancedness_mean",
    "slots_moved",
    "bytes_moved",
    "max_output_diff",
    "weights_match_map",
    "ranks_agree_on_versions",
    "max_swap_ms",
    "experts_copied_at_commit",
    "seconds",
    "stopped_early",
}  # and "store" when the store outlives the demo (--db, --keep)
TAG = "DEMO_TEST_RUN"  # set for one demo run; every process it starts inherits it


def tagged(token: str) -> dict[int, str]:
    """pid -> command line of every live (non-zombie) process carrying TAG=token."""
    needle = f"{TAG}={token}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if "\nState:\tZ" in (entry / "status").read_text():
                continue
            found[int(entry.name)] = (
                (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
    return found


def assert_none_left(token: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while (left := tagged(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"outlived the demo (killed now): {left}"


def _as_a_foreground_job() -> None:
    """A terminal's foreground job takes SIGINT and SIGQUIT: a suite run in the background
    (`cmd &`, nohup) ignores them, and an ignored signal stays ignored across exec."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def start(args: list[str], token: str) -> subprocess.Popen[str]:
    env = {**os.environ, TAG: token, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "rebalancer", "demo", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        start_new_session=True,  # its own group, like a shell job
        preexec_fn=_as_a_foreground_job,
    )


def run(args: list[str]) -> tuple[int, list[str], dict[str, Any]]:
    token = uuid.uuid4().hex
    proc = start(args, token)
    try:
        out, _ = proc.communicate(timeout=250)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert_none_left(token)
    lines = out.splitlines()
    return proc.returncode, lines, json.loads(lines[-1])


def read_until(stream: IO[str], prefix: str, seconds: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"no line starting with {prefix!r}: {''.join(lines)[-2000:]}")


def temp_folder(lines: list[str]) -> Path:
    (line,) = [ln for ln in lines if ln.startswith("controller on")]
    return Path(line.split(", store ", 1)[1].split("controller.sqlite", 1)[0])


def test_demo_through_two_sidecars() -> None:
    code, lines, summary = run([*SMALL, "--sidecars", "2", "--json"])
    assert code == 0, "\n".join(lines[-30:])
    assert set(summary) == KEYS and summary["stopped_early"] == ""  # no store: it was temporary
    assert summary["sidecars"] == 2 and summary["workers"] == 4
    assert summary["plans_committed"] >= 1
    assert summary["max_output_diff"] == 0.0
    assert summary["ranks_agree_on_versions"] and summary["weights_match_map"]
    assert summary["bytes_moved"] > 0
    assert lines[0].startswith(
        "each window: seq | vN placement it ran on | routed balancedness = mean/max"
    )
    assert any(
        ln.startswith("4 workers in 2 pods via sidecars (ranks 0-1, ranks 2-3") for ln in lines
    )
    assert not temp_folder(lines).exists()  # the temporary folder is gone, and not named as kept


def test_demo_direct_keeps_its_folder_with_keep() -> None:
    code, lines, summary = run([*SMALL, "--sidecars", "0", "--json", "--keep"])
    folder = Path(summary["store"]).parent
    try:
        assert code == 0, "\n".join(lines[-30:])
        assert set(summary) == KEYS | {"store"} and Path(summary["store"]).exists()
        assert summary["sidecars"] == 0
        assert summary["plans_committed"] >= 1 and summary["max_output_diff"] == 0.0
        assert summary["ranks_agree_on_versions"]
        assert "4 workers direct to the controller (one stream per rank)" in lines
        assert f"kept {folder}" in lines and (folder / "rank0.json").exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# How long the demo may take to unwind: it ends its workers (each closes its agreements
# and delivers its last window) and sidecars; on a busy CI machine that takes a while, and
# what the test asserts is that it ends, leaving no process, not how fast.
UNWIND_SECONDS = 150


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_demo_interrupted_or_killed_leaves_no_process(how: str) -> None:
    token = uuid.uuid4().hex
    proc = start([*SMALL, "--windows", "200"], token)
    folder = None
    try:
        assert proc.stdout is not None
        lines = read_until(proc.stdout, "window ", 120)  # sidecars and workers all up
        folder = temp_folder(lines)
        assert any(" via sidecars " in ln for ln in lines)
        assert len(tagged(token)) >= 1 + 2 + 4  # the demo, its sidecars, its workers
        if how == "ctrl-c":  # what a terminal does: SIGINT to the whole foreground group
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(UNWIND_SECONDS) == 130
            assert_none_left(token)
            assert not folder.exists()
        elif how == "sigterm":  # the demo alone: it unwinds as on Ctrl-C
            proc.terminate()
            assert proc.wait(UNWIND_SECONDS) == 128 + signal.SIGTERM
            assert_none_left(token)
            assert not folder.exists()
        else:
            proc.kill()  # the demo alone: its children go with it (PR_SET_PDEATHSIG)
            proc.wait(10)
            assert_none_left(token)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
