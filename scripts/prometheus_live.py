"""A real Prometheus scraping a live fleet: what the dashboard and the alerts are tried on.

`Prometheus` runs the server of Debian's prometheus package (`.ci/run --tools` unpacks it
into .ci/tools/usr/bin beside promtool; one on PATH also does) on loopback, with its TSDB
in a folder of its own, scraping static targets every `scrape_interval` and evaluating
rule files every `evaluation_interval`, and speaks its HTTP API (query, query_range,
alerts, rules).

`Fleet` is what `rebalancer demo` runs, as processes a caller can fault one by one: the
controller (`rebalancer serve`, metrics and per-layer series on, the demo's policy), the
demo's sidecars (one per pod, each with its /metrics) and the demo's CPU workers (the
engines: a gloo EP group serving DeepSeek-V3's real routing through their pod's sidecar).
Its targets carry the labels a PodMonitor gives a sidecar (`namespace`, `pod`), so the
dashboard's joins on them work as in a cluster.

Both are context managers: everything started is reaped on the way out, whatever
happened; every child also dies with this process (rebalancer.demo.bound_to_this_process).
`PoolMember` is a deployment of instant ranks in a replica pool beside it, so the pool
series exist too. Used by scripts/render_dashboard.py and tests/unit/deploy/.
"""

from __future__ import annotations

import json
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from rebalancer.demo import (
    DemoConfig,
    bound_to_this_process,
    free_port,
    launch_sidecars,
    launch_workers,
    reap,
    write_profile,
)
from rebalancer.v1 import rebalancer_pb2 as pb
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent

ROOT = Path(__file__).resolve().parents[1]
CI_PROMETHEUS = ROOT / ".ci" / "tools" / "usr" / "bin" / "prometheus"

# One scrape target: ("host:port", its target labels).
Target = tuple[str, dict[str, str]]


def prometheus_binary() -> str | None:
    """The Prometheus server: .ci/tools' (from `.ci/run --tools`), else one on PATH."""
    if CI_PROMETHEUS.exists():
        return str(CI_PROMETHEUS)
    return shutil.which("prometheus")


class PrometheusError(RuntimeError):
    pass


class Prometheus:
    """One Prometheus server on a free loopback port; `start()` returns once it is ready."""

    def __init__(
        self, folder: Path, targets: dict[str, list[Target]], rule_files: Sequence[Path] = (),
        scrape_interval: float = 1.0, evaluation_interval: float = 1.0, binary: str | None = None,
    ) -> None:
        binary = binary or prometheus_binary()
        if binary is None:
            raise FileNotFoundError("no prometheus server: run `.ci/run --tools` (Debian's prometheus "
                                    "package into .ci/tools) or put one on PATH")
        self.binary = binary
        self.folder = folder
        self.targets = targets
        self.rule_files = list(rule_files)
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = folder / "prometheus.log"

    def config(self) -> dict[str, Any]:
        """prometheus.yml (JSON is YAML): one job per target group, static targets."""
        seconds = f"{self.scrape_interval:g}s"
        return {
            "global": {"scrape_interval": seconds, "scrape_timeout": seconds,
                       "evaluation_interval": f"{self.evaluation_interval:g}s"},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [address], "labels": labels}
                                                     for address, labels in targets]}
                for job, targets in self.targets.items()
            ],
        }

    def start(self, ready_seconds: float = 60.0) -> Prometheus:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "prometheus.yml"
        config.write_text(json.dumps(self.config(), indent=1))
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(bound_to_this_process([
                self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.folder / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
            ]), stdout=log, stderr=log)
        deadline = time.monotonic() + ready_seconds
        while True:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus not ready after {ready_seconds:.0f} s: {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            reap([self.proc], terminate=True, seconds=10.0)

    def __enter__(self) -> Prometheus:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ the HTTP API

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>: its `data`, or PrometheusError with Prometheus's own error."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=30) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as exc:  # a bad query: 400 with Prometheus's error
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant vector: [{"metric": labels, "value": [t, "v"]}]."""
        data = self.api("query", query=expr, time=at)
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr}: a {data['resultType']}, not a vector")
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A matrix: [{"metric": labels, "values": [[t, "v"], ...]}]."""
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        return list(data["result"])

    def alert_rules(self) -> dict[str, dict[str, Any]]:
        """Every alerting rule by name, with its `state` (inactive, pending, firing) and
        its active `alerts`."""
        groups = self.api("rules", type="alert")["groups"]
        return {rule["name"]: rule for group in groups for rule in group["rules"]}


class Fleet:
    """A controller, the demo's sidecars and the demo's workers, as separate processes.

    `demo`: the demo's shape and policy (workers, sidecars, layers, ...); `worker_args`:
    extra flags of every worker (e.g. --step-sleep)."""

    NAMESPACE = "demo"

    def __init__(self, folder: Path, demo: DemoConfig | None = None, worker_args: Sequence[str] = ()) -> None:
        demo = demo or DemoConfig()
        self.demo = replace(demo, sidecars=demo.sidecars or 2)
        self.folder = folder
        self.worker_args = list(worker_args)
        self.port = free_port()
        self.metrics_port = free_port()
        self.sidecar_ports = [free_port() for _ in range(self.demo.sidecars)]
        self.sockets: Path | None = None  # made at start: short, for 107-byte socket paths
        self.controller: subprocess.Popen[str] | None = None
        self.sidecars: list[subprocess.Popen[bytes]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.rank_targets: list[str] = []
        self.profile: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def targets(self) -> dict[str, list[Target]]:
        """The scrape targets: the controller, and each sidecar labelled as a PodMonitor
        labels it (namespace, pod)."""
        return {
            "rebalancer": [(f"127.0.0.1:{self.metrics_port}", {})],
            "rebalancer-sidecars": [(f"127.0.0.1:{port}", {"namespace": self.NAMESPACE, "pod": f"pod{i}"})
                                    for i, port in enumerate(self.sidecar_ports)],
        }

    def start(self) -> Fleet:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.sockets = Path(tempfile.mkdtemp(prefix="fleet", dir="/tmp"))
        self.start_controller()
        self.rank_targets = launch_sidecars(self.demo, self.address, self.sockets, self.sidecars, self.sidecar_ports)
        self.start_engines()
        return self

    def _config(self) -> Path:
        path = self.folder / "controller.toml"
        if not path.exists():
            policy = "\n".join(f"{k} = {json.dumps(v)}" for k, v in self.demo.policy.to_flat().items())
            path.write_text(f'[server]\nhost = "127.0.0.1"\nper_layer_metrics = true\n\n[policy]\n{policy}\n')
        return path

    def start_controller(self, ready_seconds: float = 60.0) -> None:
        """`rebalancer serve` on the fleet's ports and store (again after a kill: same store)."""
        with (self.folder / "controller.log").open("a") as log:
            self.controller = subprocess.Popen(bound_to_this_process([
                sys.executable, "-m", "rebalancer", "serve", "--config", str(self._config()),
                "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                "--db", str(self.folder / "controller.sqlite"), "--log-level", "WARNING",
            ]), stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.controller.stdout is not None
        ready, _, _ = select.select([self.controller.stdout], [], [], ready_seconds)
        line = self.controller.stdout.readline() if ready else ""  # "serving on ...", "" if it exited
        if "serving on" not in line:
            raise RuntimeError(f"the controller did not start within {ready_seconds:.0f} s "
                               f"({line.strip() or 'no output'}): "
                               + (self.folder / "controller.log").read_text()[-2000:])

    def kill_controller(self) -> None:
        """SIGKILL: the controller dies as in a crash (restart with start_controller)."""
        if self.controller is not None and self.controller.poll() is None:
            self.controller.send_signal(signal.SIGKILL)
            self.controller.wait(30)

    def start_engines(self) -> None:
        """The workers of the EP group, each through its pod's sidecar (again after a kill:
        a fresh gloo group, as restarted engines)."""
        if self.profile is None:
            self.profile = write_profile(self.demo, self.folder)
        self.workers = launch_workers(self.demo, self.rank_targets, self.profile, self.folder,
                                      {r: self.worker_args for r in range(self.demo.workers)})

    def kill_engines(self) -> None:
        """SIGKILL every worker: the engines die, their sidecars live on."""
        reap(self.workers, terminate=False)

    def close(self) -> None:
        try:
            reap(self.workers, terminate=False)
            reap(self.sidecars, terminate=True, seconds=5.0)
            if self.controller is not None:
                reap([self.controller], terminate=True, seconds=10.0)
        finally:
            if self.controller is not None and self.controller.stdout is not None:
                self.controller.stdout.close()
            if self.sockets is not None:
                shutil.rmtree(self.sockets, ignore_errors=True)

    def __enter__(self) -> Fleet:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# ---------------------------------------------------------------- a pooled deployment
#
# Ranks that prepare and commit at once, through real worker agents: with a pool member
# beside the fleet every pool series of the dashboard exists.

DEPLOYMENT = "live"  # the instant ranks' deployment unless told another
L, E, P, G = 3, 8, 12, 2
SHAPE = pb.ModelShape(num_layers=L, num_logical_experts=E, num_physical_slots=P, num_gpus=G,
                      num_nodes=1, expert_bytes=1 << 20)


class InstantRank(PlanHandlers):
    """Prepares and commits at once; a real agent carries the messages."""

    def __init__(self, rank: int, address: str, deployment: str = DEPLOYMENT, pool: str = "",
                 shape: pb.ModelShape = SHAPE) -> None:
        self.version = 0
        self.agent = WorkerAgent(AgentConfig(address, deployment, rank, shape, pool=pool), self, lambda: self.version)

    def on_prepare(self, prepare: pb.Prepare) -> None:
        self.agent.report(prepare.version, pb.PLAN_PHASE_PREPARED)

    def on_commit(self, version: int) -> None:
        self.version = version
        self.agent.report(version, pb.PLAN_PHASE_COMMITTED)

    def on_abort(self, version: int, reason: str) -> None:
        self.agent.report(version, pb.PLAN_PHASE_ABORTED)


class PoolMember:
    """A deployment of G instant ranks in a replica pool, straight to the controller at
    `address`, sending skewed windows every `every` seconds until closed: the pool
    decides, takes a placement and rolls it to the member, so every pool series exists."""

    def __init__(self, address: str, deployment: str, pool: str, every: float = 0.5) -> None:
        self.ranks = [InstantRank(r, address, deployment, pool) for r in range(G)]
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, name="pool-member", daemon=True)

    def __enter__(self) -> PoolMember:
        for r in self.ranks:
            r.agent.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for r in self.ranks:
            r.agent.stop()

    def _send(self) -> None:
        rng = np.random.default_rng(2)
        profile = (1 + np.arange(E)) / np.sum(1 + np.arange(E))  # skewed: a placement pays
        seq = 0
        while not self._stop.wait(self.every):
            # Tokens drawn from one profile, as routing is: the pool's divergence test sees
            # sampling noise only, and the member follows its pool.
            logical = rng.multinomial(4000, profile, size=L)
            for r in self.ranks:
                r.agent.submit_window(seq * 4, 4, r.version, logical, None)
            seq += 1
