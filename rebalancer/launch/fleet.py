"""`Fleet`: what `rebalancer demo` runs, as processes a caller can fault one by one.

The controller (`rebalancer serve`, metrics and per-layer series on, the demo's policy), the
demo's sidecars (one per pod, each with its /metrics) and the demo's CPU workers (the
engines: a gloo EP group serving DeepSeek-V3's real routing through their pod's sidecar).
Its targets carry the labels a PodMonitor gives a sidecar (`namespace`, `pod`), so the
dashboard's joins on them work as in a cluster (rebalancer.launch.prometheus scrapes them).

A context manager: everything started is reaped on the way out, whatever happened; every
child also dies with this process (rebalancer.launch.processes).
"""

from __future__ import annotations

import json
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from rebalancer.launch.config import DemoConfig
from rebalancer.launch.processes import bound_to_this_process, free_port, reap
from rebalancer.launch.prometheus import Target
from rebalancer.launch.routing import write_profile
from rebalancer.launch.sidecars import launch_sidecars
from rebalancer.launch.workers import launch_workers


class Fleet:
    """A controller, the demo's sidecars and the demo's workers, as separate processes.

    `demo`: the demo's shape and policy (workers, sidecars, layers, ...); `worker_args`:
    extra flags of every worker (e.g. --step-sleep)."""

    NAMESPACE = "demo"

    def __init__(
        self, folder: Path, demo: DemoConfig | None = None, worker_args: Sequence[str] = ()
    ) -> None:
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
            "rebalancer-sidecars": [
                (f"127.0.0.1:{port}", {"namespace": self.NAMESPACE, "pod": f"pod{i}"})
                for i, port in enumerate(self.sidecar_ports)
            ],
        }

    def start(self) -> Fleet:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.sockets = Path(tempfile.mkdtemp(prefix="fleet", dir="/tmp"))
        self.start_controller()
        self.rank_targets = launch_sidecars(
            self.demo, self.address, self.sockets, self.sidecars, self.sidecar_ports
        )
        self.start_engines()
        return self

    def _config(self) -> Path:
        path = self.folder / "controller.toml"
        if not path.exists():
            policy = "\n".join(
                f"{k} = {json.dumps(v)}" for k, v in self.demo.policy.to_flat().items()
            )
            path.write_text(
                f'[server]\nhost = "127.0.0.1"\nper_layer_metrics = true\n\n[policy]\n{policy}\n'
            )
        return path

    def start_controller(self, ready_seconds: float = 60.0) -> None:
        """`rebalancer serve` on the fleet's ports and store (again after a kill: same store)."""
        with (self.folder / "controller.log").open("a") as log:
            self.controller = subprocess.Popen(
                bound_to_this_process(
                    [
                        sys.executable,
                        "-m",
                        "rebalancer",
                        "serve",
                        "--config",
                        str(self._config()),
                        "--port",
                        str(self.port),
                        "--metrics-port",
                        str(self.metrics_port),
                        "--db",
                        str(self.folder / "controller.sqlite"),
                        "--log-level",
                        "WARNING",
                    ]
                ),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        assert self.controller.stdout is not None
        ready, _, _ = select.select([self.controller.stdout], [], [], ready_seconds)
        line = (
            self.controller.stdout.readline() if ready else ""
        )  # "serving on ...", "" if it exited
        if "serving on" not in line:
            raise RuntimeError(
                f"the controller did not start within {ready_seconds:.0f} s "
                f"({line.strip() or 'no output'}): "
                + (self.folder / "controller.log").read_text()[-2000:]
            )

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
        self.workers = launch_workers(
            self.demo,
            self.rank_targets,
            self.profile,
            self.folder,
            {r: self.worker_args for r in range(self.demo.workers)},
        )

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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
