"""The fault harness: real processes, real faults at every plan phase, invariants checked
from the ranks' own step logs (RELIABILITY.md).

It runs a `rebalancer serve` process on an SQLite store, one `rebalancer sidecar` per pod
and the G ranks of one gloo group (bench.chaos_worker = worker_hooks.examples.cpu_worker with a step
log) on DeepSeek-V3 routing drifting over six workloads. Every gRPC link goes through a
loopback fault proxy (bench/faultproxy.py): each rank's Unix socket to its sidecar, and
the sidecars' TCP link to the controller. Plans come from the policy and from forced
rebalances; faults are injected at random moments and, in turn, at each plan phase
(proposed, preparing, prepared, commit sent, commit agreed, switched), one per episode:

- SIGKILL / SIGTERM of a worker, a sidecar or the controller, SIGSTOP + SIGCONT of any;
  a killed controller is restarted on the same store, a killed sidecar on the same
  socket; a killed worker takes its gloo group with it (a gloo group cannot lose a
  member), so the episode kills the other ranks and starts the deployment's G ranks
  again, on the same sidecars and controller, from the placement they start with;
- link faults on any link: latency, bandwidth limit, dropped connections, half-open
  connections (accepted, never answered), blackhole for a few seconds;
- store faults: read-only store (the controller is restarted on it: it must refuse with
  one line, then start once the store is writable again), disk full (the store's small
  tmpfs filled for a few seconds under a live controller), torn WAL (kill -9, then a
  partial frame appended to the write-ahead log, restart). Read-only and disk full use a
  tmpfs when run as root; otherwise a size limit on the controller's files
  (RLIMIT_FSIZE) and file modes;
- a starved node (cpu_starve): 4 busy processes per CPU beside every process of the run
  for 2-20 s. `--hog N` runs N busy processes beside the whole campaign (a node other work
  keeps busy).

After each episode the harness waits (up to `settle_seconds`) for the store, the
controller and every rank to agree on the placement version (invariant 7). Checked from
the step logs: every step ran one version on every rank, all switched at the same step
(2); every output equals the unbalanced reference, bit for bit (1); no rank ever ran a
version the store does not hold as committed, and every rank ran every committed version
its group lived through (5); no step spent more than `step_wait_bound_ms` in the
rebalancer's code, route + step_end, where it would wait on a sidecar or the controller,
besides the time it waited for a CPU (bench/chaos_worker.py, `hook_runq_ms`) (3). Controller recovery: from the kill to every rank resynced (Status: all ranks
connected on the restarted controller).

    python -m bench.chaos --seconds 300 --seed 1 --hog 2 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import numpy as np

from bench.chaos_worker import PREPARE_SECONDS, STEP_LOG
from bench.faultproxy import FaultProxy
from rebalancer.controller.store import Store
from rebalancer.demo import DemoConfig, bound_to_this_process, free_port, write_profile
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc

Phase = Literal["any", "proposed", "preparing", "prepared", "commit_sent", "commit_agreed", "switched"]
PHASES: tuple[Phase, ...] = ("proposed", "preparing", "prepared", "commit_sent", "commit_agreed", "switched")

PROCESS_FAULTS = (
    "sigkill_worker", "sigterm_worker", "sigstop_worker",
    "sigkill_sidecar", "sigterm_sidecar", "sigstop_sidecar",
    "sigkill_controller", "sigterm_controller", "sigstop_controller",
)
LINK_FAULTS = ("latency", "bandwidth", "drop", "half_open", "blackhole")
STORE_FAULTS = ("store_readonly", "store_disk_full", "store_torn_wal")
NODE_FAULTS = ("cpu_starve",)
ALL_KINDS = PROCESS_FAULTS + LINK_FAULTS + STORE_FAULTS + NODE_FAULTS
# Relative frequency after every kind has had its turn: a killed worker restarts its whole
# group (G torch processes), the slowest episode; link faults cost least.
WEIGHTS = {k: 1.0 for k in ALL_KINDS} | {"sigkill_worker": 0.35, "sigterm_worker": 0.35} | {
    k: 2.0 for k in LINK_FAULTS}

DEPLOYMENT = "chaos"

CONTROLLER_TOML = """
[server]
host = "127.0.0.1"
persist_seconds = 0.0
drain_seconds = 0.2
grace_seconds = 1.0
[policy]
min_interval_seconds = 1.0
gain_threshold = 0.02
horizon_seconds = 60.0
max_moved_fraction = 0.5
decay = 0.5
min_windows = 2
decision_period_seconds = 0.25
prepare_timeout_seconds = {prepare_timeout}
step_seconds = 0.01
"""


@dataclass
class ChaosConfig:
    seconds: float = 300.0
    seed: int = 1
    workers: int = 4
    pods: int = 2
    layers: int = 4
    experts: int = 16
    slots: int = 20
    tokens: int = 16
    top_k: int = 4
    window_steps: int = 8
    agree_every: int = 4
    step_sleep: float = 0.01
    prepare_seconds: float = 0.4       # a prepare's extra time on the last rank (chaos_worker)
    prepare_timeout_seconds: float = 5.0
    kinds: tuple[str, ...] = ALL_KINDS
    # Busy processes beside the whole campaign (a node other work keeps busy).
    hog: int = 0
    # cpu_starve: this many busy processes per CPU, for 2 s to `starve_seconds_max`.
    starve_per_cpu: int = 4
    starve_seconds_max: float = 20.0
    # Invariant 3: a step spends at most this in the rebalancer's code (route + step_end),
    # not counting the time its thread waited for a CPU (a starved node's doing). A step
    # that waited on a link would wait at least the fault's length (0.3-2 s).
    step_wait_bound_ms: float = 250.0
    settle_seconds: float = 30.0       # after an episode, to agreement (invariant 7)
    recovery_bound_seconds: float = 10.0
    keep: bool = False
    progress: bool = True


# ---------------------------------------------------------------- step logs

class StepLog:
    """One rank's step log, read as it grows (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[list[float]] = []
        self._offset = 0

    def read(self) -> list[list[float]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.rows
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            self.rows.append(json.loads(line))
        self._offset += end
        return self.rows

    @property
    def last(self) -> list[float] | None:
        return self.rows[-1] if self.rows else None


# Columns of a step-log row (bench/chaos_worker.py).
STEP, VERSION, READY, PREPARED, ABORTED, STAGED, HOOK_MS, DIFF, WALL, HOOK_RUNQ_MS = range(10)
STEP_LOG_COLUMNS = 10

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


@dataclass
class Outcome:
    faults: Counter[str] = field(default_factory=Counter)
    phases: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)
    refused_starts: list[str] = field(default_factory=list)
    controller_restarts: int = 0
    group_restarts: int = 0
    sidecar_restarts: int = 0
    settle_seconds: list[float] = field(default_factory=list)
    # Wall-clock spans where a rank was frozen or its group down: a step gap there is the
    # fault itself, not a wait on the rebalancer.
    excused: list[tuple[float, float]] = field(default_factory=list)


class Harness:
    def __init__(self, config: ChaosConfig) -> None:
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.tmp = Path(tempfile.mkdtemp(prefix="chaos", dir="/tmp"))  # short: socket paths
        self.store_dir = self.tmp / "store"
        self.store_dir.mkdir()
        self.tmpfs = False
        self.db = self.store_dir / "c.sqlite"
        self.out = Outcome()
        self.proxy = FaultProxy()
        self.controller: subprocess.Popen[str] | None = None
        self.last_exit: int | None = None  # of a controller that refused to start
        self.sidecars: list[subprocess.Popen[str] | None] = [None] * config.pods
        self.group: Group | None = None
        self.groups: list[Group] = []
        self.all_procs: list[subprocess.Popen[Any]] = []
        self.hogs: list[subprocess.Popen[bytes]] = []
        self.descendants: set[int] = set()
        self.port = free_port()
        self.admin_channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.admin = pb_grpc.AdminServiceStub(self.admin_channel)
        self.demo = DemoConfig(workers=config.workers, layers=config.layers, experts=config.experts,
                               slots=config.slots, top_k=config.top_k, tokens=config.tokens,
                               window_steps=config.window_steps, seed=config.seed)
        self.profile = write_profile(self.demo, self.tmp)
        (self.tmp / "c.toml").write_text(CONTROLLER_TOML.format(prepare_timeout=config.prepare_timeout_seconds))
        self.t0 = time.monotonic()

    # ------------------------------------------------------------ output

    def say(self, msg: str) -> None:
        if self.cfg.progress:
            print(f"[chaos {time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def violation(self, msg: str) -> None:
        self.out.violations.append(msg)
        self.say(f"VIOLATION {msg}")

    # ------------------------------------------------------------ processes

    def _popen(self, cmd: list[str], log: str, text: bool = False, **kw: Any) -> subprocess.Popen[Any]:
        with (self.tmp / log).open("ab") as err:
            proc = subprocess.Popen(bound_to_this_process(cmd), stderr=err, text=text, **kw)
        self.all_procs.append(proc)
        return proc

    def _wait_line(self, proc: subprocess.Popen[str], needle: str, seconds: float) -> str | None:
        """The first stdout line of `proc` if it holds `needle` within `seconds`, else None."""
        assert proc.stdout is not None
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""),
                                  daemon=True)
        reader.start()
        reader.join(seconds)
        if box and needle in box[0]:
            return box[0]
        return None

    def start_controller(self) -> bool:
        """`rebalancer serve` on the same store and port; False if it refused to start."""
        cmd = [sys.executable, "-m", "rebalancer", "serve", "--config", str(self.tmp / "c.toml"),
               "--port", str(self.port), "--db", str(self.db), "--log-level", "WARNING"]
        proc = self._popen(cmd, "controller.log", text=True, stdout=subprocess.PIPE)
        if self._wait_line(proc, "serving on", 30.0) is None:
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
        cmd = [sys.executable, "-m", "rebalancer", "sidecar", "--listen", f"unix://{self.tmp}/pod{pod}/agent.sock",
               "--controller", self.proxy.links["controller"].address, "--ranks", f"{ranks[0]}-{ranks[-1]}",
               "--pod", f"chaos/pod{pod}", "--deployment", DEPLOYMENT, "--socket-access", "owner",
               "--grace", "1", "--log-level", "WARNING"]
        proc = self._popen(cmd, f"sidecar{pod}.log", text=True, stdout=subprocess.PIPE)
        if self._wait_line(proc, "sidecar serving on", 30.0) is None:
            raise RuntimeError(f"sidecar {pod} did not start: {self.tail(f'sidecar{pod}.log')}")
        self.sidecars[pod] = proc

    def pod_ranks(self, pod: int) -> range:
        n = self.cfg.workers // self.cfg.pods
        return range(pod * n, (pod + 1) * n)

    def start_group(self) -> Group:
        index = len(self.groups)
        folder = self.tmp / f"g{index}"
        folder.mkdir()
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "REBALANCER_LOG": "ERROR", STEP_LOG: str(folder),
               PREPARE_SECONDS: str(self.cfg.prepare_seconds)}
        procs = []
        for rank in range(self.cfg.workers):
            pod = rank // (self.cfg.workers // self.cfg.pods)
            cmd = [sys.executable, "-m", "bench.chaos_worker", "--rank", str(rank), "--world", str(self.cfg.workers),
                   "--port", str(port), "--controller", self.proxy.links[f"pod{pod}"].address,
                   "--deployment", DEPLOYMENT, "--profile", str(self.profile), "--steps", str(10**9),
                   "--tokens", str(self.cfg.tokens), "--experts", str(self.cfg.experts),
                   "--slots", str(self.cfg.slots), "--layers", str(self.cfg.layers), "--top-k", str(self.cfg.top_k),
                   "--window-steps", str(self.cfg.window_steps), "--agree-every", str(self.cfg.agree_every),
                   "--step-sleep", str(self.cfg.step_sleep), "--max-seconds", str(self.cfg.seconds + 600),
                   "--stop-file", str(folder / "stop"), "--out", str(folder / f"rank{rank}.json")]
            procs.append(self._popen(cmd, f"g{index}-rank{rank}.log", env=env))
        group = Group(index, folder, procs, [StepLog(folder / f"steps{r}.jsonl") for r in range(self.cfg.workers)],
                      time.time())
        self.groups.append(group)
        self.group = group
        return group

    def tail(self, log: str, chars: int = 600) -> str:
        with contextlib.suppress(OSError):
            return (self.tmp / log).read_text(errors="replace")[-chars:].strip().replace("\n", " | ")
        return ""

    def track_descendants(self) -> None:
        """Every process below this one, remembered: none may outlive the run."""
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        mine = {os.getpid()}
        grew = True
        while grew:
            new = {pid for pid, ppid in parents.items() if ppid in mine and pid not in mine}
            mine |= new
            grew = bool(new)
        self.descendants |= mine - {os.getpid()}

    # ------------------------------------------------------------ the controller's view

    def status(self, timeout: float = 2.0) -> pb.DeploymentStatus | None:
        try:
            reply = self.admin.Status(pb.StatusRequest(deployment=DEPLOYMENT), timeout=timeout)
        except grpc.RpcError:
            return None
        return reply.deployments[0] if reply.deployments else None

    def store_version(self) -> int | None:
        """The committed version in the store, read as another process would."""
        try:
            store = Store(self.db)
        except Exception:  # noqa: BLE001 - a store being restarted or faulted: ask again
            return None
        try:
            rows = [d for d in store.load_deployments() if d.name == DEPLOYMENT]
            return rows[0].committed_version if rows else None
        except Exception:  # noqa: BLE001
            return None
        finally:
            store.close()

    def rank_versions(self) -> list[int | None]:
        assert self.group is not None
        out = []
        for log in self.group.logs:
            log.read()
            out.append(int(log.last[VERSION]) if log.last else None)
        return out

    def wait_ready(self, seconds: float) -> float | None:
        """Seconds until every rank is connected to the controller, or None."""
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            s = self.status(1.0)
            if s is not None and s.connected_ranks == self.cfg.workers:
                return time.monotonic() - start
            time.sleep(0.05)
        return None

    def settle(self) -> None:
        """Invariant 7: store, controller and every rank on one version (no plan in flight)."""
        start = time.monotonic()
        seen = ""
        while time.monotonic() - start < self.cfg.settle_seconds:
            self.check_liveness()
            s = self.status(1.0)
            ranks = self.rank_versions()
            stored = self.store_version()
            if s is not None:
                seen = (f"store v{stored}, controller v{s.placement_version} ({s.connected_ranks} ranks, "
                        f"plan {s.plan_in_flight or '-'} {s.plan_phase}), ranks {ranks}")
                if (not s.plan_in_flight and s.connected_ranks == self.cfg.workers
                        and stored == s.placement_version and all(v == stored for v in ranks)):
                    self.out.settle_seconds.append(time.monotonic() - start)
                    return
            time.sleep(0.05)
        self.violation(f"7: no agreement {self.cfg.settle_seconds:.0f} s after the episode: {seen}")

    def check_liveness(self) -> None:
        """A process that ended on its own is a finding; it is restarted so the run goes on."""
        if self.controller is not None and self.controller.poll() is not None:
            self.violation(f"controller exited with {self.controller.returncode}: {self.tail('controller.log')}")
            self.restart_controller()
        for pod, proc in enumerate(self.sidecars):
            if proc is not None and proc.poll() is not None:
                self.violation(f"sidecar {pod} exited with {proc.returncode}: {self.tail(f'sidecar{pod}.log')}")
                self.start_sidecar(pod)
        g = self.group
        if g is not None and any(p.poll() is not None for p in g.procs):
            codes = [p.poll() for p in g.procs]
            self.violation(f"group {g.index}: a rank exited on its own {codes}: "
                           f"{self.tail(f'g{g.index}-rank{codes.index(next(c for c in codes if c is not None))}.log')}")
            self.restart_group()

    # ------------------------------------------------------------ phases

    def force(self) -> int:
        """Force a plan now (waiting for one in flight to end first); its version or 0."""
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            s = self.status(1.0)
            if s is not None and not s.plan_in_flight and s.connected_ranks == self.cfg.workers:
                try:
                    self.admin.ForceRebalance(pb.ForceRebalanceRequest(deployment=DEPLOYMENT), timeout=3)
                except grpc.RpcError:
                    time.sleep(0.1)
                    continue
                s = self.status(1.0)
                return int(s.plan_in_flight) if s is not None else 0
            time.sleep(0.05)
        return 0

    def reach(self, phase: Phase) -> str:
        """Bring a plan to `phase` and return as soon as it is there: the phase reached
        ("missed" when the plan ended or the phase passed unseen)."""
        if phase == "any":
            time.sleep(self.rng.uniform(0.0, 1.0))
            return "any"
        assert self.group is not None
        for log in self.group.logs:
            log.read()
        prepared0 = [int(log.last[PREPARED]) if log.last else 0 for log in self.group.logs]
        version = self.force()
        if not version:
            return "missed"
        if phase == "proposed":
            return phase
        deadline = time.monotonic() + self.cfg.prepare_timeout_seconds + 3
        while time.monotonic() < deadline:
            rows = [log.read()[-1] if log.read() else None for log in self.group.logs]
            if any(r is None for r in rows):
                time.sleep(0.01)
                continue
            prepared = sum(int(r[PREPARED]) > p for r, p in zip(rows, prepared0, strict=True))  # type: ignore[index]
            ready = sum(int(r[READY]) >= version for r in rows)  # type: ignore[index]
            switched = sum(int(r[VERSION]) >= version for r in rows)  # type: ignore[index]
            s = self.status(0.5) if phase in ("preparing", "prepared", "commit_sent") else None
            in_flight = s is not None and s.plan_in_flight == version
            if phase == "preparing" and in_flight and s is not None and s.plan_phase == "preparing" and prepared == 0:
                time.sleep(self.rng.uniform(0.0, 0.1))
                return phase
            if phase == "prepared" and in_flight and s is not None and s.plan_phase == "preparing" and 0 < prepared:
                return phase
            if phase == "commit_sent" and in_flight and s is not None and s.plan_phase == "committing" and switched == 0:
                return phase
            if phase == "commit_agreed" and ready > 0 and switched == 0:
                return phase
            if phase == "switched" and switched > 0:
                return phase
            if switched == len(rows) or (s is not None and s.plan_in_flight != version and prepared == 0
                                         and phase in ("preparing", "prepared")):
                return "missed"
            time.sleep(0.005)
        return "missed"

    # ------------------------------------------------------------ faults

    def link_fault(self, kind: str, link: str | None = None) -> float:
        """Start a link fault (the proxy ends it); returns its length in seconds."""
        rng = self.rng
        link = link or rng.choice(sorted(self.proxy.links))
        seconds = 0.0 if kind == "drop" else rng.uniform(0.3, 2.0)
        amount = {"latency": rng.uniform(0.05, 0.5), "bandwidth": rng.choice([2e3, 2e4, 2e5])}.get(kind, 0.0)
        self.say(f"{kind} on link {link}" + (f" for {seconds:.1f}s" if seconds else "")
                 + (f" ({amount:g})" if amount else ""))
        self.proxy.inject(link, kind, seconds, amount)  # type: ignore[arg-type]
        self.out.faults[kind] += 1
        return seconds

    def inject(self, kind: str) -> None:
        if kind in LINK_FAULTS:
            time.sleep(self.link_fault(kind))
            return
        self.out.faults[kind] += 1
        what, _, target = kind.partition("_")
        if kind.startswith("sig"):
            sig = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigstop": signal.SIGSTOP}[what]
            self.signal_process(target, sig)
            return
        if kind == "cpu_starve":
            self.cpu_starve()
        elif kind == "store_readonly":
            self.store_readonly()
        elif kind == "store_disk_full":
            self.store_disk_full()
        elif kind == "store_torn_wal":
            self.kill_controller(signal.SIGKILL, torn_wal=True)
        else:
            raise ValueError(kind)

    def signal_process(self, target: str, sig: signal.Signals) -> None:
        rng = self.rng
        if target == "controller":
            if sig == signal.SIGSTOP:
                self.freeze(self.controller, "controller", excuse=False)
            else:
                self.kill_controller(sig)
        elif target == "sidecar":
            pod = rng.randrange(self.cfg.pods)
            proc = self.sidecars[pod]
            if sig == signal.SIGSTOP:
                self.freeze(proc, f"sidecar {pod}", excuse=False)
                return
            assert proc is not None
            self.say(f"{sig.name} sidecar {pod}")
            self.stop(proc, sig, f"sidecar {pod}", f"sidecar{pod}.log", 10.0)
            self.start_sidecar(pod)
            self.out.sidecar_restarts += 1
        else:
            assert self.group is not None
            rank = rng.randrange(self.cfg.workers)
            worker = self.group.procs[rank]
            if sig == signal.SIGSTOP:
                self.freeze(worker, f"rank {rank}", excuse=True)
                return
            self.say(f"{sig.name} rank {rank}: group {self.group.index} goes, the deployment's ranks restart")
            worker.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(5)
            self.restart_group()

    def freeze(self, proc: subprocess.Popen[Any] | None, name: str, excuse: bool) -> None:
        if proc is None or proc.poll() is not None:
            return
        seconds = self.rng.uniform(0.2, 2.0)
        self.say(f"SIGSTOP {name} for {seconds:.1f}s")
        start = time.time()
        proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            proc.send_signal(signal.SIGCONT)
        if excuse:  # its peers wait for it in the token exchange: the fault, not the rebalancer
            self.out.excused.append((start, time.time() + 1.0))

    def restart_group(self) -> None:
        g = self.group
        assert g is not None
        start = time.time()
        for p in g.procs:
            if p.poll() is None:
                p.kill()
        for p in g.procs:
            p.wait()
        g.ended, g.killed = time.time(), True
        for log in g.logs:
            log.read()
        self.start_group()
        if self.wait_ready(60.0) is None:
            self.violation(f"group {self.group.index if self.group else '?'}: ranks not all connected 60 s after the restart")
        self.wait_serving(60.0)
        self.out.excused.append((start, time.time() + 1.0))
        self.out.group_restarts += 1

    def wait_serving(self, seconds: float) -> None:
        """Until every rank of the group has logged steps."""
        assert self.group is not None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if all(len(log.read()) > 2 for log in self.group.logs):
                return
            time.sleep(0.1)

    def stop(self, proc: subprocess.Popen[Any], sig: signal.Signals, name: str, log: str, seconds: float) -> None:
        """Send `sig` and wait for the exit: still running after `seconds`, or a SIGTERM
        answered with a non-zero exit, is a finding (the process is killed either way)."""
        proc.send_signal(sig)
        try:
            proc.wait(seconds)
        except subprocess.TimeoutExpired:
            self.violation(f"{name} still running {seconds:g} s after {sig.name}")
            proc.kill()
            proc.wait()
        if sig == signal.SIGTERM and proc.returncode != 0:
            self.violation(f"{name} exited {proc.returncode} on SIGTERM: {self.tail(log)}")

    def kill_controller(self, sig: signal.Signals, torn_wal: bool = False) -> None:
        proc = self.controller
        assert proc is not None
        start = time.monotonic()
        self.say(f"{sig.name} controller" + (", then a torn frame on its WAL" if torn_wal else ""))
        self.stop(proc, sig, "controller", "controller.log", 15.0)
        if torn_wal:
            self.tear_wal()
        self.restart_controller(start)

    def restart_controller(self, since: float | None = None) -> None:
        start = since if since is not None else time.monotonic()
        for _ in range(3):
            if self.start_controller():
                break
            self.violation(f"controller refused to restart on its store: {self.tail('controller.log')}")
        self.out.controller_restarts += 1
        waited = self.wait_ready(60.0)
        if waited is None:
            self.violation("controller restarted but not every rank resynced within 60 s")
            return
        seconds = time.monotonic() - start
        self.out.recoveries.append(seconds)
        self.say(f"controller back, every rank resynced {seconds:.2f}s after the kill")

    def tear_wal(self) -> None:
        """A write cut short by the kill: a partial WAL frame (header + part of a page)."""
        wal = Path(f"{self.db}-wal")
        if not wal.exists():
            return
        size = wal.stat().st_size
        page = 4096
        frame = bytes(self.rng.getrandbits(8) for _ in range(24 + self.rng.randrange(1, page)))
        with wal.open("ab") as f:
            f.write(frame)
        self.say(f"WAL torn: {len(frame)} bytes of a partial frame after {size}")

    def store_readonly(self) -> None:
        """The store's file system read-only while the controller restarts on it: it must
        refuse with one line; then writable again, it starts."""
        proc = self.controller
        assert proc is not None
        start = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.say("store read-only, controller restarted on it")
        if self.tmpfs:
            subprocess.run(["mount", "-o", "remount,ro", str(self.store_dir)], check=True, capture_output=True)
        else:
            for p in self.store_dir.iterdir():
                p.chmod(0o444)
            self.store_dir.chmod(0o555)
        try:
            if self.start_controller():
                # Started on a read-only store: that is only right if it stays correct (the
                # settle check), so note it.
                self.out.refused_starts.append("started read-only")
                self.controller.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                self.controller.wait()  # type: ignore[union-attr]
            else:
                line = f"exit {self.last_exit}: " + self.tail("controller.log", 300).split(" | ")[-1]
                self.out.refused_starts.append(line.replace(str(self.tmp), "$RUN"))
                self.say(f"refused: {line}")
        finally:
            if self.tmpfs:
                subprocess.run(["mount", "-o", "remount,rw", str(self.store_dir)], check=True, capture_output=True)
            else:
                self.store_dir.chmod(0o755)
                for p in self.store_dir.iterdir():
                    p.chmod(0o644)
        self.restart_controller(start)

    def cpu_starve(self) -> None:
        """The node's CPUs taken by other work for 2-20 s (`starve_seconds_max`): `starve_per_cpu` busy processes
        per CPU beside every process of the run (the harness's own too: the proxy's links
        slow down as well). Nothing is excused: the invariants must hold on a starved node."""
        seconds = self.rng.uniform(2.0, max(2.0, self.cfg.starve_seconds_max))
        n = self.cfg.starve_per_cpu * (os.cpu_count() or 1)
        self.say(f"CPU starved by {n} busy processes for {seconds:.1f}s")
        procs = self.busy(n, "starve.log")
        try:
            time.sleep(seconds)
        finally:
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.wait()

    def store_disk_full(self) -> None:
        """No space left for the store for a few seconds, under a live controller."""
        seconds = self.rng.uniform(1.0, 3.0)
        self.say(f"store disk full for {seconds:.1f}s")
        ballast = self.store_dir / "ballast"
        if self.tmpfs:
            with ballast.open("wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            time.sleep(seconds)
            ballast.unlink()
        else:
            import resource

            proc = self.controller
            assert proc is not None
            used = sum(p.stat().st_size for p in self.store_dir.iterdir())
            old = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (used, old[1]))
            time.sleep(seconds)
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, old)

    # ------------------------------------------------------------ the run

    def busy(self, n: int, log: str) -> list[subprocess.Popen[bytes]]:
        """`n` processes that only burn CPU (reaped with every other process of the run)."""
        return [self._popen([sys.executable, "-c", BUSY], log) for _ in range(n)]

    def setup(self) -> None:
        if self.cfg.hog:
            self.hogs = self.busy(self.cfg.hog, "hog.log")
        if os.geteuid() == 0 and shutil.which("mount"):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(self.store_dir)],
                               capture_output=True)
            self.tmpfs = r.returncode == 0
        self.proxy.add("controller", "127.0.0.1:0", f"127.0.0.1:{self.port}")
        for pod in range(self.cfg.pods):
            (self.tmp / f"pod{pod}").mkdir()
            self.proxy.add(f"pod{pod}", f"unix://{self.tmp}/pod{pod}/proxy.sock", f"unix://{self.tmp}/pod{pod}/agent.sock")
        if not self.start_controller():
            raise RuntimeError(f"controller did not start: {self.tail('controller.log')}")
        for pod in range(self.cfg.pods):
            self.start_sidecar(pod)
        self.start_group()
        if self.wait_ready(90.0) is None:
            raise RuntimeError("ranks did not connect within 90 s")
        self.wait_serving(60.0)

    def schedule(self) -> list[str]:
        """Every kind once first (shuffled), then kinds by weight."""
        kinds = list(self.cfg.kinds)
        self.rng.shuffle(kinds)
        return kinds

    def run(self) -> dict[str, Any]:
        start = time.monotonic()
        try:
            self._run(start)
        except BaseException:  # an error or SIGTERM: no tmpfs or folder is left behind either
            self.release_files()
            raise
        return self.report(time.monotonic() - start)

    def release_files(self) -> None:
        """Unmount the store's tmpfs and remove the run's folder (kept with --keep)."""
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.store_dir)], capture_output=True)
        if not self.cfg.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _run(self, start: float) -> None:
        try:
            self.setup()
            self.say(f"up: controller :{self.port}, {self.cfg.pods} sidecars, {self.cfg.workers} ranks; "
                     f"store on {'tmpfs' if self.tmpfs else 'disk'}; {self.tmp}")
            first = self.schedule()
            episode = 0
            end = start + self.cfg.seconds
            while time.monotonic() < end or first:  # every kind gets its turn
                self.track_descendants()
                kind = first.pop(0) if first else self.rng.choices(
                    list(self.cfg.kinds), [WEIGHTS[k] for k in self.cfg.kinds])[0]
                phase: Phase = "any" if episode % 7 == 6 else PHASES[episode % len(PHASES)]
                hit = self.reach(phase)
                self.out.phases[hit] += 1
                # Faults overlap: besides the episode's own, up to three link faults on
                # random links, started at the same moment (the proxy ends them).
                extras = [k for k in self.cfg.kinds if k in LINK_FAULTS]
                storm = [self.rng.choice(extras) for _ in range(self.rng.choice([0, 1, 2, 3, 3]))] if extras else []
                self.say(f"episode {episode}: {kind} at {hit}" + (f" with {', '.join(storm)}" if storm else ""))
                until = time.monotonic() + max((self.link_fault(k) for k in storm), default=0.0)
                self.inject(kind)
                time.sleep(max(0.0, until - time.monotonic()))
                self.settle()
                episode += 1
            self.finish_group()
        finally:
            self.track_descendants()
            self.teardown()

    def finish_group(self) -> None:
        """End the live group at one step on every rank and check its final results."""
        g = self.group
        if g is None:
            return
        last = max((int(log.read()[-1][STEP]) for log in g.logs if log.read()), default=0)
        tmp = g.folder / "stop.tmp"
        tmp.write_text(str(last + 40))
        tmp.rename(g.folder / "stop")
        codes: list[int | None] = []
        for p in g.procs:
            try:
                codes.append(p.wait(90))
            except subprocess.TimeoutExpired:
                codes.append(None)
        g.ended = time.time()
        for log in g.logs:
            log.read()
        if codes != [0] * len(codes):
            self.violation(f"group {g.index}: ranks ended with {codes} when asked to stop")
            return
        results = [json.loads((g.folder / f"rank{r}.json").read_text()) for r in range(self.cfg.workers)]
        if not all(r["weights_match_map"] for r in results):
            self.violation(f"group {g.index}: weights do not match the map at the end")
        if any(r["agreement_broken"] for r in results):
            self.violation(f"group {g.index}: commit agreement broken")

    def teardown(self) -> None:
        for hog in self.hogs:  # first: the rest then ends on a CPU of its own
            hog.kill()
        with contextlib.suppress(Exception):
            self.proxy.heal()
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
        self.admin_channel.close()
        self.proxy.close()
        time.sleep(0.5)  # children of the dead (decision workers) get their death signal

    def leaked(self) -> list[int]:
        alive = []
        for pid in self.descendants:
            with contextlib.suppress(OSError):
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    alive.append(pid)
        return alive

    def check_logs(self) -> dict[str, Any]:
        """Invariants 1, 2, 3, 5 from every group's step logs."""
        plans = self.final_plans()
        committed = {v for v, state in plans.items() if state == "committed"} | {0}
        aborted = {v for v, state in plans.items() if state == "aborted"}
        steps = 0
        max_wait = 0.0
        max_hook = 0.0
        max_gap = 0.0
        for g in self.groups:
            rows = [np.array(log.read(), dtype=np.float64).reshape(-1, STEP_LOG_COLUMNS) for log in g.logs]
            steps += sum(len(r) for r in rows)
            if not all(len(r) for r in rows):
                continue
            n = min(len(r) for r in rows)  # steps every rank logged (a killed rank's tail differs)
            for r in rows:
                if not np.array_equal(r[:n, STEP], np.arange(n)):
                    self.violation(f"group {g.index}: a step log is not one row per step")
            versions = np.stack([r[:n, VERSION] for r in rows])
            mixed = np.flatnonzero((versions != versions[0]).any(axis=0))
            if len(mixed):
                s = int(mixed[0])
                self.violation(f"2: group {g.index}: {len(mixed)} steps ran mixed versions, first step {s}: "
                               f"{versions[:, s].astype(int).tolist()}")
            for rank, r in enumerate(rows):
                bad = np.flatnonzero(r[:, DIFF] != 0.0)
                if len(bad):
                    self.violation(f"1: group {g.index} rank {rank}: {len(bad)} steps differ from the reference "
                                   f"(max {r[:, DIFF].max():g})")
                ran = {int(v) for v in np.unique(r[:, VERSION])}
                if ran - committed:
                    self.violation(f"5: group {g.index} rank {rank} ran versions {sorted(ran - committed)} that "
                                   f"are not committed in the store (aborted: {sorted(ran & aborted)})")
                waited = r[:, HOOK_MS] - r[:, HOOK_RUNQ_MS]  # in the hook, not waiting for a CPU
                max_wait = max(max_wait, float(waited.max()))
                max_hook = max(max_hook, float(r[:, HOOK_MS].max()))
                slow = np.flatnonzero(waited > self.cfg.step_wait_bound_ms)
                if len(slow):
                    worst = int(slow[np.argmax(waited[slow])])
                    self.violation(f"3: group {g.index} rank {rank}: {len(slow)} steps spent more than "
                                   f"{self.cfg.step_wait_bound_ms:g} ms in the hook besides waiting for a CPU "
                                   f"(max {waited[worst]:.0f} ms at step {worst}, {r[worst, HOOK_MS]:.0f} ms "
                                   f"with the CPU wait)")
                gaps = np.diff(r[:, WALL])
                ends = r[1:, WALL]
                ok = np.ones(len(gaps), dtype=bool)
                for a, b in self.out.excused:
                    ok &= ~((ends >= a) & (ends - gaps <= b))
                if ok.any():
                    max_gap = max(max_gap, float(gaps[ok].max()))
            # All or nothing: the versions a group ran, the same on every rank (up to the
            # steps all of them logged), each committed.
            ran_all = [set(np.unique(r[:n, VERSION]).astype(int)) for r in rows]
            if any(s != ran_all[0] for s in ran_all):
                self.violation(f"5: group {g.index}: ranks ran different version sets {ran_all}")
        return {"steps": steps, "max_step_wait_ms": round(max_wait, 2), "max_hook_ms": round(max_hook, 2),
                "max_step_gap_ms": round(1e3 * max_gap, 1),
                "plans_committed": len(committed - {0}), "plans_aborted": len(aborted)}

    def final_plans(self) -> dict[int, str]:
        try:
            store = Store(self.db)
        except Exception as exc:  # noqa: BLE001
            self.violation(f"the store does not open after the run: {exc}")
            return {}
        try:
            return {p.version: p.state for p in store.plans(DEPLOYMENT, 100000)}
        finally:
            store.close()

    def transfer_timeouts(self) -> int:
        """Plans whose weight transfers timed out on a rank (a peer never joined them):
        gloo then closes the migration group's pairs, and later plans fail on that group
        until it restarts (an open finding, RELIABILITY.md)."""
        count = 0
        for log in self.tmp.glob("g*-rank*.log"):
            text = log.read_text(errors="replace")
            count += text.count("Timed out waiting") + text.count("timeout caused pair closure")
        return count

    def report(self, seconds: float) -> dict[str, Any]:
        figures = self.check_logs()
        leaked = self.leaked()
        if self.tmpfs and self.cfg.keep:  # keep the store for a look; the tmpfs goes either way
            with contextlib.suppress(OSError):
                shutil.copytree(self.store_dir, self.tmp / "store-copy", ignore=shutil.ignore_patterns("ballast"))
        rec = sorted(self.out.recoveries)
        p99 = float(np.percentile(rec, 99)) if rec else 0.0
        if rec and p99 > self.cfg.recovery_bound_seconds:
            self.violation(f"controller recovery p99 {p99:.1f} s is above {self.cfg.recovery_bound_seconds:g} s")
        result = {
            "seconds": round(seconds, 1),
            "seed": self.cfg.seed,
            "faults_injected": sum(self.out.faults.values()),
            "faults_by_kind": dict(sorted(self.out.faults.items())),
            "faults_by_phase": dict(sorted(self.out.phases.items())),
            "plans_committed": figures["plans_committed"],
            "plans_aborted": figures["plans_aborted"],
            "invariant_violations": len(self.out.violations),
            "violations": self.out.violations[:20],
            "max_step_wait_ms": figures["max_step_wait_ms"],
            "max_hook_ms_with_cpu_wait": figures["max_hook_ms"],
            "step_wait_bound_ms": self.cfg.step_wait_bound_ms,
            "max_step_gap_ms_outside_worker_faults": figures["max_step_gap_ms"],
            "controller_recovery_seconds_p99": round(p99, 2),
            "controller_recovery_seconds_max": round(rec[-1], 2) if rec else 0.0,
            "controller_restarts": self.out.controller_restarts,
            "sidecar_restarts": self.out.sidecar_restarts,
            "group_restarts": self.out.group_restarts,
            "read_only_starts": Counter(self.out.refused_starts).most_common(3),
            "settle_seconds_max": round(max(self.out.settle_seconds, default=0.0), 2),
            "steps_logged": figures["steps"],
            "leaked_processes": len(leaked),
            "transfer_timeouts": self.transfer_timeouts(),
            "store": "tmpfs" if self.tmpfs else "disk",
            "workers": self.cfg.workers,
            "sidecars": self.cfg.pods,
            "hog": self.cfg.hog,
            "load_avg": round(os.getloadavg()[0], 2),
        }
        self.release_files()
        if self.cfg.keep:
            result["kept"] = str(self.tmp)
        return result


def run_chaos(config: ChaosConfig) -> dict[str, Any]:
    return Harness(config).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--seconds", type=float, default=300.0,
                   help="how long to inject faults (at least until every kind was injected once)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--pods", type=int, default=2)
    p.add_argument("--kinds", default="", help=f"comma-separated subset of: {','.join(ALL_KINDS)}")
    p.add_argument("--hog", type=int, default=0, metavar="N",
                   help="N busy processes beside the whole campaign (a busy node)")
    p.add_argument("--keep", action="store_true", help="keep the run's folder (logs, store)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k) or ALL_KINDS
    unknown = set(kinds) - set(ALL_KINDS)
    if unknown:
        print(f"error: unknown fault kinds {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.hog < 0:
        print(f"error: --hog must be >= 0, got {args.hog}", file=sys.stderr)
        return 2
    config = ChaosConfig(seconds=args.seconds, seed=args.seed, workers=args.workers, pods=args.pods,
                         kinds=kinds, hog=args.hog, keep=args.keep, progress=not args.quiet)
    # SIGTERM (a timeout, an operator) ends the run like Ctrl-C: every process, the store's
    # tmpfs and the run's folder are released on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result = run_chaos(config)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    bad = result["invariant_violations"] or result["leaked_processes"]
    return 1 if bad else 0


__all__ = ["ALL_KINDS", "ChaosConfig", "asdict", "run_chaos"]

if __name__ == "__main__":
    sys.exit(main())
