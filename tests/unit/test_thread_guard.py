"""The suite's thread guard (tests/conftest.py, no_thread_left_behind) fails a test that
leaves a thread running, naming it and its target, and passes one that ends its threads.

Run on a copy of the guard in a subprocess pytest of its own (a failing test here must
not fail this run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import threading, time

def spin_until(stop):
    stop.wait(30)

STOP = threading.Event()

def test_leaves_a_non_daemon_thread():
    threading.Thread(target=spin_until, args=(STOP,), name="left-running").start()

def test_leaves_a_daemon_thread():
    threading.Thread(target=spin_until, args=(STOP,), name="left-daemon", daemon=True).start()

def test_ends_its_thread():
    stop = threading.Event()
    thread = threading.Thread(target=spin_until, args=(stop,), name="ended")
    thread.start()
    stop.set()

def test_thread_ends_within_the_grace():
    threading.Thread(target=time.sleep, args=(0.3,), name="short").start()

def test_zz_release():
    STOP.set()
"""


def test_the_guard_fails_a_test_that_leaves_a_thread(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_threads.py").write_text(TESTS)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "-rA",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "ERROR" in out and "test_leaves_a_non_daemon_thread" in out
    assert "'left-running' (target test_threads.spin_until, non-daemon)" in out
    assert "'left-daemon' (target test_threads.spin_until, daemon)" in out
    for name in ("test_ends_its_thread", "test_thread_ends_within_the_grace", "test_zz_release"):
        assert f"PASSED test_threads.py::{name}" in out, out
    assert "5 passed, 2 errors" in out, out
