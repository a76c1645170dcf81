"""A real Prometheus scraping live targets: what the dashboard and the alerts are tried on.

`Prometheus` runs the server of Debian's prometheus package (`.ci/run --tools` unpacks it
into .ci/tools/usr/bin beside promtool; one on PATH also does) on loopback, with its TSDB
in a folder of its own, scraping static targets every `scrape_interval` and evaluating
rule files every `evaluation_interval`, and speaks its HTTP API (query, query_range,
alerts, rules). A context manager: the server is reaped on the way out, whatever
happened, and dies with this process (rebalancer.launch.processes).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rebalancer.launch.processes import bound_to_this_process, free_port, reap

ROOT = Path(__file__).resolve().parents[2]
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
        self,
        folder: Path,
        targets: dict[str, list[Target]],
        rule_files: Sequence[Path] = (),
        scrape_interval: float = 1.0,
        evaluation_interval: float = 1.0,
        binary: str | None = None,
    ) -> None:
        binary = binary or prometheus_binary()
        if binary is None:
            raise FileNotFoundError(
                "no prometheus server: run `.ci/run --tools` (Debian's prometheus "
                "package into .ci/tools) or put one on PATH"
            )
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
            "global": {
                "scrape_interval": seconds,
                "scrape_timeout": seconds,
                "evaluation_interval": f"{self.evaluation_interval:g}s",
            },
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {
                    "job_name": job,
                    "static_configs": [
                        {"targets": [address], "labels": labels} for address, labels in targets
                    ],
                }
                for job, targets in self.targets.items()
            ],
        }

    def start(self, ready_seconds: float = 60.0) -> Prometheus:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "prometheus.yml"
        config.write_text(json.dumps(self.config(), indent=1))
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                bound_to_this_process(
                    [
                        self.binary,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={self.folder / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--log.level=warn",
                    ]
                ),
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + ready_seconds
        while True:
            if self.proc.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self.proc.returncode}: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"prometheus not ready after {ready_seconds:.0f} s: {self.log_tail()}"
                )
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
        data = self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}"
        )
        return list(data["result"])

    def alert_rules(self) -> dict[str, dict[str, Any]]:
        """Every alerting rule by name, with its `state` (inactive, pending, firing) and
        its active `alerts`."""
        groups = self.api("rules", type="alert")["groups"]
        return {rule["name"]: rule for group in groups for rule in group["rules"]}
