"""A zygote for the engine tests' rank processes: one process per engine environment that
has imported the engine's heavy modules once and forks every rank from itself.

Why: each engine test starts four ranks, and each rank spent most of its life importing
torch and the engine's EPLB code (vLLM's: about 9 s of CPU per process, SGLang's about 7 s
on the 2-core CI machine), four times per test, thirty-odd tests; beside a CPU hog that
alone put CI past its 90 minutes. A forked rank starts with those modules already in
memory and runs its worker module (`python -m MODULE ARGS` as `__main__`) exactly as the
interpreter would: same argv, environment, working folder and output file, same exit code.

Only third-party modules are preloaded (torch, the engine's own): the project's code and
gRPC (whose core must not be started before a fork) are imported by each rank after the
fork, as before. The zygote refuses to start if a preload pulled gRPC in.

`Zygote.popen` takes `subprocess.Popen`'s arguments and returns an object with Popen's
verbs (`pid`, `poll`, `wait`, `kill`, `terminate`, `returncode`); a command that is not
`[sys.executable, "-m", MODULE, ...]` is started by `subprocess.Popen` itself.

No process left behind: the zygote and every rank it forks ask the kernel for SIGKILL when
their parent ends (PR_SET_PDEATHSIG), and `close_all()` (tests/engines/conftest.py, at the
session's end) kills whatever is left.

Protocol, one JSON datagram per message on a SOCK_SEQPACKET Unix socket: the test sends
{module, argv, env, cwd} with the output file's descriptor attached (SCM_RIGHTS); the
zygote answers {"pid": N} once forked and {"code": C} when the rank ended (C as Popen's
returncode: negative for the signal that killed it), or {"error": TEXT}.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

MAX_MESSAGE = 1 << 20
START_SECONDS = 600.0  # importing an engine beside a CPU hog: minutes, not seconds


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)  # the parent ended before the request took effect


# --- the test's side -------------------------------------------------------------------


class ForkedRank:
    """A rank forked by the zygote, with the verbs of `subprocess.Popen` the tests use."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self.pid = pid
        self.returncode: int | None = None

    def _take(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(MAX_MESSAGE)
        except (TimeoutError, BlockingIOError):
            return None
        finally:
            self._conn.settimeout(None)
        # An empty read: the zygote itself ended (killed with its ranks); say so as a kill.
        self.returncode = int(json.loads(data)["code"]) if data else -int(signal.SIGKILL)
        self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._take(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._take(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """One zygote process: `env` and `cwd` are the engine environment it imports `preload`
    in (the ranks' own environment is set per `popen`)."""

    def __init__(self, preload: list[str], env: dict[str, str], cwd: Path) -> None:
        self._folder = tempfile.mkdtemp(prefix="zygote-")
        self.address = os.path.join(self._folder, "socket")
        cmd = [
            sys.executable,
            "-m",
            "tests.engines.zygote",
            str(os.getpid()),
            self.address,
            *preload,
        ]
        self._log = Path(self._folder, "zygote.log")
        with open(self._log, "w") as log:
            self.process = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=log, text=True
            )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], START_SECONDS)
        line = self.process.stdout.readline() if ready else ""
        if line.strip() != "ready":
            said = (line.strip() or self._log.read_text()[-2000:]).strip() or "no answer"
            self.close()
            raise RuntimeError(f"the zygote did not start ({' '.join(preload)}): {said}")

    def popen(
        self,
        cmd: list[str],
        cwd: Path | str,
        env: dict[str, str],
        stdout: IO[Any],
        stderr: Any = None,
    ) -> ForkedRank | subprocess.Popen[bytes]:
        if (
            len(cmd) < 3
            or cmd[0] != sys.executable
            or cmd[1] != "-m"
            or stderr != subprocess.STDOUT
        ):
            return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.address)
        request = {"module": cmd[2], "argv": cmd[3:], "env": env, "cwd": str(cwd)}
        socket.send_fds(conn, [json.dumps(request).encode()], [stdout.fileno()])
        answer = json.loads(conn.recv(MAX_MESSAGE) or b'{"error": "the zygote ended"}')
        if "pid" not in answer:
            conn.close()
            raise RuntimeError(f"the zygote could not fork {cmd[2]}: {answer['error']}")
        return ForkedRank(conn, int(answer["pid"]))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # it kills its ranks on the way out
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        shutil.rmtree(self._folder, ignore_errors=True)


_ZYGOTES: dict[tuple[str, ...], Zygote] = {}


def for_engine(preload: list[str], env: dict[str, str], cwd: Path) -> Zygote:
    """The session's zygote for this engine environment (its PYTHONPATH) and preload, started
    on first use."""
    key = (env.get("PYTHONPATH", ""), *preload)
    if key not in _ZYGOTES or _ZYGOTES[key].process.poll() is not None:
        _ZYGOTES[key] = Zygote(preload, env, cwd)
    return _ZYGOTES[key]


def close_all() -> None:
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].close()


# --- the zygote's side -----------------------------------------------------------------


def _run_rank(inherited: list[socket.socket], request: dict[str, Any], out: int) -> None:
    """In the forked child: become `python -m MODULE ARGV` and never return."""
    import atexit
    import runpy
    import threading

    code = 1
    try:
        for sock in inherited:  # the zygote's sockets, not the rank's
            sock.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        _die_with_parent(int(request["zygote"]))
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # What the preloaded modules set at import (SGLang points torch's caches at its own
        # folders), as a rank importing them itself would have it, unless the test set it.
        for name, value in request["set_by_preload"].items():
            os.environ.setdefault(name, value)
        tempfile.tempdir = None  # read TMPDIR again: each test gives its ranks their own
        sys.argv = [request["module"], *request["argv"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        # As the interpreter ends: wait for non-daemon threads, then the exit handlers.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - the process ends either way
                pass
        os._exit(code)


def _serve(parent: int, address: str, preload: list[str]) -> None:
    _die_with_parent(parent)
    before = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    set_by_preload = {k: v for k, v in os.environ.items() if before.get(k) != v}
    if "grpc" in sys.modules:
        print(
            f"a preload imported grpc, which must not be started before a fork: {preload}",
            flush=True,
        )
        sys.exit(1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    conns: dict[int, socket.socket] = {}  # the rank's pid -> its test's connection
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    while not stopping and os.getppid() == parent:
        try:
            readable, _, _ = select.select([listener], [], [], 0.1)
        except InterruptedError:
            continue
        if readable:
            conn, _ = listener.accept()
            try:
                data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
                request = {
                    **json.loads(data),
                    "zygote": os.getpid(),
                    "set_by_preload": set_by_preload,
                }
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_rank([listener, conn, *conns.values()], request, fds[0])
                os.close(fds[0])
                conn.send(json.dumps({"pid": pid}).encode())
                conns[pid] = conn
            except Exception as e:  # noqa: BLE001 - said to the test, the zygote keeps serving
                conn.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
                conn.close()
        while conns:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = conns.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass  # the test went away
                conn.close()
    for pid in conns:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while conns and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        conns.pop(pid, None)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
