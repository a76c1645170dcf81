"""No process outlives the controller: a `rebalancer serve` killed with SIGKILL after it
ran a decision (so its decision worker exists and has worked) leaves no child behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from rebalancer.launch.processes import free_port
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="walks /proc")

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=4, num_gpus=1, num_nodes=1
)


def stat_of(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def children_of(parent: int) -> dict[int, int]:
    """pid -> start time of every live child of `parent`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := stat_of(int(entry.name))) is not None:
            ppid, state, start = st
            if ppid == parent and state != "Z":
                found[int(entry.name)] = start
    return found


def alive(pid: int, start: int) -> bool:
    """Still the same process and not a zombie (an orphan's zombie waits for init)."""
    st = stat_of(pid)
    return st is not None and st[2] == start and st[1] != "Z"


def run_one_decision(address: str) -> None:
    """Register the one rank of a deployment and send a window: it folds at once and the
    policy's first decision runs in the decision worker."""
    with grpc.insecure_channel(address) as channel:
        worker = pb_grpc.WorkerServiceStub(channel)
        session = worker.Register(
            pb.RegisterRequest(deployment="d", rank=0, shape=SHAPE), timeout=10
        ).session_id
        counts = codec.encode(np.array([[5, 1, 1, 1], [1, 1, 1, 9]], dtype=np.int64))
        messages = [
            pb.WorkerMessage(hello=pb.Hello(session_id=session)),
            pb.WorkerMessage(window=pb.Window(seq=0, num_steps=1, logical_count=counts)),
        ]
        list(worker.Stream(iter(messages), timeout=10))
        admin = pb_grpc.AdminServiceStub(channel)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = admin.Status(pb.StatusRequest(deployment="d"), timeout=5).deployments[0]
            if status.last_decision.outcome:
                return
            time.sleep(0.1)
    raise AssertionError("no decision came back from the decision worker")


def test_sigkill_leaves_no_child_behind(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "serve",
            "--port",
            str(port),
            "--db",
            str(tmp_path / "c.sqlite"),
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    children: dict[int, int] = {}
    try:
        assert proc.stdout is not None and "serving on" in proc.stdout.readline()
        run_one_decision(f"127.0.0.1:{port}")
        children = children_of(proc.pid)
        commands = [
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in children
        ]
        assert any(b"rebalancer.controller.decision_process" in c for c in commands), commands
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p, s) for p, s in children.items()):
            time.sleep(0.05)
        assert not [p for p, s in children.items() if alive(p, s)], (
            "children outlived the controller"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid, start in children.items():  # never leave one behind, even when failing
            if alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def descendants_of(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root`."""
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        kids = children_of(frontier.pop())
        found.update(kids)
        frontier.extend(kids)
    return found


def test_a_killed_ingest_bench_leaves_no_process_behind() -> None:
    """`bench/ingest.py` starts a controller (with its decision worker) and load
    generators; SIGKILL to the bench alone must take every one of them down."""
    root = Path(__file__).resolve().parents[2]
    bench = subprocess.Popen(
        [sys.executable, str(root / "bench" / "ingest.py"), "--ranks", "64", "--seconds", "120"],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the controller, its worker, two generators
            seen.update(descendants_of(bench.pid))
            commands = [Path(f"/proc/{p}/cmdline").read_bytes() for p in seen if alive(p, seen[p])]
            if (
                sum(b"spawn_main" in c for c in commands) >= 2
                and any(b"decision_process" in c for c in commands)
                and bench.poll() is None
            ):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the bench never had its controller and generators: {seen}")
        bench.send_signal(signal.SIGKILL)
        bench.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p, s) for p, s in seen.items()):
            time.sleep(0.05)
        left = [
            Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p, s in seen.items() if alive(p, s)
        ]
        assert not left, f"processes outlived the killed bench: {left}"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid, start in seen.items():
            if alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
