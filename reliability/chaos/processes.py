"""The run's processes: the controller, one sidecar per pod, the deployment's gloo group
and the busy processes of a hog or a starved node. Every process is started here and
remembered, with every process below the harness, so that none outlives the run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rebalancer.launch.processes import bound_to_this_process, free_port
from reliability.chaos.config import DEPLOYMENT, ChaosConfig
from reliability.chaos.steplog import StepLog
from reliability.chaos_worker import PREPARE_SECONDS, STEP_LOG
from reliability.faultproxy import FaultProxy

# A busy process: what a CPU hog (`--hog`) and the `cpu_starve` fault run.
BUSY = "while True: pass"


@dataclass
class Group:
    """One life of the deployment's gloo group: its processes and step logs."""

    index: int
    folder: Path
    procs: list[subprocess.Popen[bytes]]
    logs: list[StepLog]
    started: float
    ended: float = 0.0
    killed: bool = False


def wait_line(proc: subprocess.Popen[str], needle: str, seconds: float) -> str | None:
    """The first stdout line of `proc` if it holds `needle` within `seconds`, else None."""
    assert proc.stdout is not None
    box: list[str] = []
    reader = threading.Thread(
        target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""), daemon=True
    )
    reader.start()
    reader.join(seconds)
    if box and needle in box[0]:
        return box[0]
    return None


def process_tree(root: int) -> set[int]:
    """`root` and every process below it, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree = {root}
    grew = True
    while grew:
        new = {pid for pid, ppid in parents.items() if ppid in tree and pid not in tree}
        tree |= new
        grew = bool(new)
    return tree


def alive(pids: set[int]) -> list[int]:
    """Those of `pids` still running (a zombie has ended)."""
    running = []
    for pid in pids:
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                running.append(pid)
    return running


class Processes:
    """Starts the run's processes in `folder` (their logs beside them) and reaps them."""

    def __init__(
        self,
        config: ChaosConfig,
        folder: Path,
        db: Path,
        port: int,
        profile: Path,
        proxy: FaultProxy,
    ) -> None:
        self.cfg = config
        self.folder = folder
        self.db = db
        self.port = port
        self.profile = profile
        self.proxy = proxy
        self.controller: subprocess.Popen[str] | None = None
        self.last_exit: int | None = None  # of a controller that refused to start
        self.sidecars: list[subprocess.Popen[str] | None] = [None] * config.pods
        self.group: Group | None = None
        self.groups: list[Group] = []
        self.all_procs: list[subprocess.Popen[Any]] = []
        self.hogs: list[subprocess.Popen[bytes]] = []
        self.descendants: set[int] = set()
        # Children this process had before the run (a test runner's multiprocessing
        # resource tracker, which lives as long as the runner): not the run's to reap.
        self._before = process_tree(os.getpid())

    def popen(
        self, cmd: list[str], log: str, text: bool = False, **kw: Any
    ) -> subprocess.Popen[Any]:
        with (self.folder / log).open("ab") as err:
            proc = subprocess.Popen(bound_to_this_process(cmd), stderr=err, text=text, **kw)
        self.all_procs.append(proc)
        return proc

    def tail(self, log: str, chars: int = 600) -> str:
        with contextlib.suppress(OSError):
            return (
                (self.folder / log)
                .read_text(errors="replace")[-chars:]
                .strip()
                .replace("\n", " | ")
            )
        return ""

    # ------------------------------------------------------------ the controller and sidecars

    def start_controller(self) -> bool:
        """`rebalancer serve` on the same store and port; False if it refused to start."""
        cmd = [
            sys.executable,
            "-m",
            "rebalancer",
            "serve",
            "--config",
            str(self.folder / "c.toml"),
            "--port",
            str(self.port),
            "--db",
            str(self.db),
            "--log-level",
            "WARNING",
        ]
        proc = self.popen(cmd, "controller.log", text=True, stdout=subprocess.PIPE)
        if wait_line(proc, "serving on", 30.0) is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            self.controller = None
            self.last_exit = proc.returncode
            return False
        self.controller = proc
        return True

    def start_sidecar(self, pod: int) -> None:
        ranks = self.pod_ranks(pod)
        cmd = [
            sys.executable,
            "-m",
            "rebalancer",
            "sidecar",
            "--listen",
            f"unix://{self.folder}/pod{pod}/agent.sock",
            "--controller",
            self.proxy.links["controller"].address,
            "--ranks",
            f"{ranks[0]}-{ranks[-1]}",
            "--pod",
            f"chaos/pod{pod}",
            "--deployment",
            DEPLOYMENT,
            "--socket-access",
            "owner",
            "--grace",
            "1",
            "--log-level",
            "WARNING",
        ]
        proc = self.popen(cmd, f"sidecar{pod}.log", text=True, stdout=subprocess.PIPE)
        if wait_line(proc, "sidecar serving on", 30.0) is None:
            raise RuntimeError(f"sidecar {pod} did not start: {self.tail(f'sidecar{pod}.log')}")
        self.sidecars[pod] = proc

    def pod_ranks(self, pod: int) -> range:
        n = self.cfg.workers // self.cfg.pods
        return range(pod * n, (pod + 1) * n)

    # ------------------------------------------------------------ the gloo group

    def start_group(self) -> Group:
        index = len(self.groups)
        folder = self.folder / f"g{index}"
        folder.mkdir()
        port = free_port()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "REBALANCER_LOG": "ERROR",
            STEP_LOG: str(folder),
            PREPARE_SECONDS: str(self.cfg.prepare_seconds),
        }
        procs = []
        for rank in range(self.cfg.workers):
            pod = rank // (self.cfg.workers // self.cfg.pods)
            cmd = [
                sys.executable,
                "-m",
                "reliability.chaos_worker",
                "--rank",
                str(rank),
                "--world",
                str(self.cfg.workers),
                "--port",
                str(port),
                "--controller",
                self.proxy.links[f"pod{pod}"].address,
                "--deployment",
                DEPLOYMENT,
                "--profile",
                str(self.profile),
                "--steps",
                str(10**9),
                "--tokens",
                str(self.cfg.tokens),
                "--experts",
                str(self.cfg.experts),
                "--slots",
                str(self.cfg.slots),
                "--layers",
                str(self.cfg.layers),
                "--top-k",
                str(self.cfg.top_k),
                "--window-steps",
                str(self.cfg.window_steps),
                "--agree-every",
                str(self.cfg.agree_every),
                "--step-sleep",
                str(self.cfg.step_sleep),
                "--max-seconds",
                str(self.cfg.seconds + 600),
                "--stop-file",
                str(folder / "stop"),
                "--out",
                str(folder / f"rank{rank}.json"),
            ]
            procs.append(self.popen(cmd, f"g{index}-rank{rank}.log", env=env))
        group = Group(
            index,
            folder,
            procs,
            [StepLog(folder / f"steps{r}.jsonl") for r in range(self.cfg.workers)],
            time.time(),
        )
        self.groups.append(group)
        self.group = group
        return group

    def kill_group(self, group: Group) -> None:
        """Every rank of `group` killed and reaped (a gloo group cannot lose a member)."""
        for p in group.procs:
            if p.poll() is None:
                p.kill()
        for p in group.procs:
            p.wait()
        group.ended, group.killed = time.time(), True
        for log in group.logs:
            log.read()

    # ------------------------------------------------------------ busy processes

    def busy(self, n: int, log: str) -> list[subprocess.Popen[bytes]]:
        """`n` processes that only burn CPU (reaped with every other process of the run)."""
        return [self.popen([sys.executable, "-c", BUSY], log) for _ in range(n)]

    def start_hogs(self, n: int) -> None:
        self.hogs = self.busy(n, "hog.log")

    def kill_hogs(self) -> None:
        for hog in self.hogs:
            hog.kill()

    # ------------------------------------------------------------ nothing left behind

    def track_descendants(self) -> None:
        """Every process below this one, remembered: none may outlive the run."""
        self.descendants |= process_tree(os.getpid()) - self._before

    def leaked(self) -> list[int]:
        return alive(self.descendants)

    def stop_all(self) -> None:
        """SIGTERM to every process still running, then SIGKILL to any left after 10 s."""
        procs = [p for p in self.all_procs if p.poll() is None]
        for p in procs:  # SIGCONT first: a frozen process cannot act on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        for p in self.all_procs:
            if p.poll() is None:
                p.kill()
            p.wait()
