"""Processes the launch toolkit starts: free ports, children that die with this process,
reaping.

No child outlives its launcher: each is reaped on every way out by whoever started it
(`reap`), and each asked the kernel to SIGKILL it should the launcher itself be killed
(PR_SET_PDEATHSIG, Linux: tied to the thread that started it, so launch from a thread that
outlives the children, e.g. the main one).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

# Run argv[2:] in place of this process (exec) once the kernel is told to SIGKILL it when
# its parent, pid argv[1], ends: a launcher killed outright leaves no child behind.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        os._exit(1)  # the parent died before the request took effect\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class LaunchFailed(RuntimeError):
    """A launched process failed (one that ended early, one never ready): said in one line."""


def bound_to_this_process(cmd: Sequence[str]) -> list[str]:
    """`cmd` (an executable path first) run as a child that dies with this process."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous or a server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_text(code: int) -> str:
    """How a process ended, from its return code (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def reap(
    procs: Sequence[subprocess.Popen[Any]], terminate: bool = True, seconds: float = 10.0
) -> None:
    """End every process still running and wait for all: SIGTERM first (a sidecar drains)
    and SIGKILL after `seconds`, or SIGKILL at once; killed anyway if interrupted."""
    try:
        if terminate:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + seconds
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
