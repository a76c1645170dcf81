"""The main job: a controller with an embedded demo on real routing data.

Starts the controller (gRPC, SQLite store) in this process and G real CPU
worker processes (worker_hooks.examples.cpu_worker, one gloo EP group) that serve a
small fp32 MoE model. Their routing replays DeepSeek-V3's real per-layer
expert loads, scaled down to the small model (a fixed random subset of the
256 experts keeps the real skew) and drifting across the six published
workloads. By default the workers form pods, each with a `rebalancer sidecar`
on a Unix socket between its ranks and the controller, as in Kubernetes;
with `sidecars=0` they talk to the controller directly. Each folded window is
printed live; the run ends with a summary and, with --json, one JSON object on
the last line.

With `controller` set (`rebalancer demo --controller ADDR`), no controller is started:
the workers (and their sidecars) attach to one already running (`rebalancer serve`), as
deployment `deployment`, so `rebalancer admin` and the metrics can be tried on a live
deployment; the demo then shows the deployment's status as the AdminService reports it.

No process outlives the demo: the workers and sidecars are reaped on every way out
(done, error, Ctrl-C), and each asked the kernel to SIGKILL it should the demo itself
be killed (rebalancer.launch.processes: call `run_demo` from a thread that outlives
them, e.g. the main one). The fleet's shape, routing and processes come from the launch
toolkit (rebalancer.launch); this module holds the demo itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rebalancer.controller.config import ControllerConfig
from rebalancer.controller.coordinate import Plan
from rebalancer.controller.deployment import WindowEvent
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.controller.server import ControllerServer
from rebalancer.launch.config import DemoConfig, pod_ranks, time_limit
from rebalancer.launch.processes import LaunchFailed, exit_text, reap
from rebalancer.launch.routing import PHASES, write_profile
from rebalancer.launch.sidecars import launch_sidecars
from rebalancer.launch.workers import launch_workers

# The first line the demo prints: what each field of a window line means.
LEGEND = (
    "each window: seq | vN placement it ran on | routed balancedness = mean/max GPU load "
    "measured on the workers' dispatched tokens (1.0 = even) | on estimate = the live "
    "placement scored on the controller's load estimate | fresh fit = a placement fitted "
    "from scratch to the window's counts (the ceiling) | ranks, tokens; a window cut short "
    "by a commit ran on the old placement and is marked (ends at commit vN)"
)

# Windows averaged for balancedness_first / balancedness_last.
EDGE_WINDOWS = 3


def stopped_early(config: DemoConfig, results: Sequence[dict[str, Any]]) -> str:
    """Why the workers ran fewer steps than asked ("" when they ran them all): the one
    reason a worker ends early without failing is its time limit."""
    steps = min(int(r["steps"]) for r in results)
    if steps >= config.steps:
        return ""
    return (
        f"the workers stopped at step {steps} of {config.steps}: their time limit ran out "
        f"(--max-seconds {time_limit(config):g})"
    )


class DemoFailed(LaunchFailed):
    """The demo's own processes failed (a worker or sidecar that ended early, workers past
    their deadline): `rebalancer demo` says so in one line and exits 1."""


@dataclass
class CommitCuts:
    """Which placement each window ran on, as far as the demo can tell live: the window a
    commit cuts short (every rank flushes its window at the agreed step, so no window
    mixes two placements) ran on the version before the commit, even when it is folded
    after the controller saw the commit."""

    base: dict[int, int] = field(default_factory=dict)  # plan version -> version it replaces
    in_flight: int | None = None  # proposed, not finished
    unclaimed: int | None = None  # committed, its cut window not seen yet
    claimed: set[int] = field(default_factory=set)

    def on_plan(self, what: str, plan: Plan) -> None:
        if what == "proposed":
            self.base[plan.version] = plan.base_version
            self.in_flight, self.unclaimed = plan.version, None
        elif what == "committed":
            self.in_flight = None
            if plan.version not in self.claimed:
                self.unclaimed = plan.version
        elif what == "aborted":
            self.in_flight = None

    def cut(self) -> int | None:
        """A window just came in cut short (not the last): the commit that cut it."""
        version = self.unclaimed if self.unclaimed is not None else self.in_flight
        if version is not None:
            self.claimed.add(version)
            self.unclaimed = None
        return version


@contextlib.contextmanager
def demo_fleet(
    config: DemoConfig, controller: str, profile_path: Path, tmp: Path
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The demo's sidecars (one per pod, if any) and workers, pointed at `controller`;
    yields the workers. Everything is reaped on the way out, however it is left; on a
    normal exit a worker that failed, or a sidecar that ended before it was asked to,
    raises DemoFailed (the others drain their last windows on SIGTERM)."""
    sidecars: list[subprocess.Popen[bytes]] = []
    procs: list[subprocess.Popen[bytes]] = []
    ended: dict[int, int] = {}
    try:
        targets: str | list[str] = controller
        if config.sidecars:
            targets = launch_sidecars(config, controller, tmp, sidecars)
        procs.extend(launch_workers(config, targets, profile_path, tmp))
        yield procs
    finally:
        # The workers that ended by themselves, before the ones still running are killed
        # here (which then read as killed too).
        ended = {i: p.returncode for i, p in enumerate(procs) if p.poll() is not None}
        try:
            reap(procs, terminate=False)
        finally:
            sidecars_failed = [
                (i, p.returncode) for i, p in enumerate(sidecars) if p.poll() is not None
            ]
            reap(sidecars, terminate=True)
    failed = {i: code for i, code in ended.items() if code != 0}
    if failed:
        stopped = [i for i in range(len(procs)) if i not in ended]
        # A worker killed by a signal first: its peers fail because it is gone.
        order = sorted(failed, key=lambda i: (failed[i] >= 0, i))
        raise DemoFailed(
            ", ".join(f"worker {i} {exit_text(failed[i])}" for i in order)
            + (f"; the demo stopped workers {stopped} with it" if stopped else "")
            + " (see the workers' output above)"
        )
    if any(p.returncode != 0 for p in procs):
        raise DemoFailed(
            f"workers {[i for i, p in enumerate(procs) if p.returncode != 0]} did not end "
            "by themselves (see their output above)"
        )
    if sidecars_failed:
        raise DemoFailed(
            "sidecars ended during the run (see their output above): "
            + ", ".join(f"pod {i} {exit_text(code)}" for i, code in sidecars_failed)
        )


def wait_workers(procs: Sequence[subprocess.Popen[Any]], until: float) -> bool:
    """Wait for the workers until `until` (time.monotonic()): True once every one has ended,
    or as soon as one has failed (its peers cannot serve without it: demo_fleet stops them
    and says which failed); False at `until`."""
    while True:
        codes = [p.poll() for p in procs]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            return True
        if time.monotonic() >= until:
            return False
        time.sleep(min(0.1, max(0.0, until - time.monotonic())))


def _follow(
    procs: list[subprocess.Popen[bytes]],
    poller: StatusPoller,
    deadline: float,
    start: float,
    emit: Callable[[str], None],
) -> None:
    """Until the workers end (or one fails): the deployment's status line each second."""
    while not wait_workers(procs, time.monotonic()):
        if time.monotonic() > deadline:
            raise DemoFailed(f"workers still running after {deadline - start:.0f} s")
        emit(poller.line())
        wait_workers(procs, time.monotonic() + 1.0)


def run_demo(config: DemoConfig, emit: Callable[[str], None] = print) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rebalancer-demo-"))
    try:
        if config.attach is not None:
            return _attach(config, config.attach.address, tmp, emit)
        return _run(config, tmp, emit)
    finally:
        if config.keep:
            emit(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _wait_for_decisions(server: ControllerServer, seconds: float = 120.0) -> None:
    """Until the controller's decision process can decide (its imports take seconds, more
    on a busy machine): a short demo's workers would otherwise run every window before
    the first decision, and no plan would commit."""
    try:
        server.decision_process.wait_ready(seconds)
    except TimeoutError:
        raise DemoFailed(
            f"the controller's decision process did not start within {seconds:.0f} s"
        ) from None


def _run(config: DemoConfig, tmp: Path, emit: Callable[[str], None]) -> dict[str, Any]:
    profile_path = write_profile(config, tmp)
    events: list[WindowEvent] = []
    plan_log: list[tuple[str, int, str]] = []
    slots_total = config.layers * config.slots
    step_tokens = config.tokens * config.layers * config.top_k  # routed pairs, one rank, one step
    commits = CommitCuts()
    steps_seen = 0.0

    def on_window(e: WindowEvent) -> None:
        nonlocal steps_seen
        events.append(e)
        steps = e.tokens / (e.ranks * step_tokens) if e.ranks else 0.0
        steps_seen += steps
        version, note = e.version, ""
        if steps < config.windows.steps - 1e-6 and steps_seen < config.steps - 1e-6:
            cut = commits.cut()
            if cut is not None:
                version, note = commits.base.get(cut, version), f" (ends at commit v{cut})"
        emit(
            f"window {e.seq:3d} | v{version:<2d} | routed balancedness {e.balancedness_actual:.3f}"
            f" | on estimate {e.balancedness_estimated:.3f} | fresh fit {e.balancedness_best:.3f}"
            f" | {e.ranks} ranks, {e.tokens} tokens{note}"
        )

    def on_plan(name: str, plan: Plan, what: str) -> None:
        plan_log.append((what, plan.version, plan.reason))
        commits.on_plan(what, plan)
        if what == "proposed":
            emit(
                f"  plan v{plan.version} proposed ({plan.trigger}): {plan.slots_moved} slots "
                f"({plan.slots_moved / slots_total:.1%}), {plan.bytes_moved / 1e6:.2f} MB"
            )
        elif what == "aborted":
            emit(f"  plan v{plan.version} aborted: {plan.reason}")
        else:
            emit(f"  plan v{plan.version} {what}")

    def setup(server: ControllerServer) -> None:
        server.controller.observers.window.append(on_window)
        server.controller.observers.plan.append(on_plan)

    emit(LEGEND)
    ctl = EmbeddedController(
        ControllerConfig(
            port=config.port,
            db_path=config.db_path or str(tmp / "controller.sqlite"),
            policy=config.policy,
            metrics_port=config.metrics_port,
            per_layer_metrics=config.metrics_port is not None,
        ),
        setup,
    )
    server = ctl.start()
    temporary = "" if config.db_path or config.keep else " (temporary; --keep keeps it)"
    if server.metrics_port:
        emit(f"metrics on http://127.0.0.1:{server.metrics_port}/metrics (per-layer series on)")
    emit(
        f"controller on {server.address}, store {server.store.path}{temporary}; "
        f"{config.layers} layers x {config.experts} experts, "
        f"{config.slots} slots, top-{config.top_k}, DeepSeek-V3 routing drifting over "
        f"{len(PHASES)} workloads"
    )
    if config.sidecars:
        pods = pod_ranks(config.workers, config.sidecars)
        emit(
            f"{config.workers} workers in {len(pods)} pods via sidecars ("
            f"{', '.join(f'ranks {r[0]}-{r[-1]}' if len(r) > 1 else f'rank {r[0]}' for r in pods)}"
            f", each pod's sidecar on a Unix socket, one upstream stream per pod)"
        )
    else:
        emit(f"{config.workers} workers direct to the controller (one stream per rank)")
    start = time.monotonic()
    try:
        _wait_for_decisions(server)
        with demo_fleet(config, server.address, profile_path, tmp) as procs:
            if not wait_workers(procs, start + time_limit(config) + 60):
                raise DemoFailed(f"workers still running after {time_limit(config) + 60:.0f} s")
        time.sleep(0.3)  # last windows
    finally:
        dep = server.controller.deployments.get(config.deployment)
        ctl.stop()
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(config.workers)]
    actual = [e.balancedness_actual for e in events if np.isfinite(e.balancedness_actual)]
    k = EDGE_WINDOWS
    summary = {
        "windows": len(events),
        "steps": min(r["steps"] for r in results),
        "workers": config.workers,
        "sidecars": config.sidecars,
        "plans_proposed": sum(1 for w, _, _ in plan_log if w == "proposed"),
        "plans_committed": dep.stats.plans_committed if dep else 0,
        "plans_aborted": dep.stats.plans_aborted if dep else 0,
        "placement_version": dep.version if dep else 0,
        "balancedness_first": float(np.mean(actual[:k])) if actual else float("nan"),
        "balancedness_last": float(np.mean(actual[-k:])) if actual else float("nan"),
        "balancedness_mean": float(np.mean(actual)) if actual else float("nan"),
        "slots_moved": dep.stats.slots_moved if dep else 0,
        "bytes_moved": int(sum(r["bytes_received"] for r in results)),
        "max_output_diff": max(r["max_output_diff"] for r in results),
        "weights_match_map": all(r["weights_match_map"] for r in results),
        "ranks_agree_on_versions": len({json.dumps(r["versions"]) for r in results}) == 1,
        "max_swap_ms": 1e3 * max(r["swap_seconds_max"] for r in results),
        "experts_copied_at_commit": int(sum(r["copied_at_commit"] for r in results)),
        "seconds": round(time.monotonic() - start, 1),
        "stopped_early": stopped_early(config, results),
    }
    if config.db_path or config.keep:  # a temporary store is gone with its folder
        summary["store"] = str(server.store.path)
    return summary


class StatusPoller:
    """The deployment's status as `rebalancer admin status` gets it (AdminService.Status),
    one line per poll; the admin token from REBALANCER_ADMIN_TOKEN if the controller
    asks for one. A failed call is a line saying why, never an exception.

    What the polls saw is kept for the summary: the most ranks connected at once and the
    windows folded since the first poll (none of either: no worker ever registered), the
    newest window's routed balancedness at each poll that found a new one, and the last
    failed call's line."""

    def __init__(self, address: str, deployment: str, timeout: float = 2.0) -> None:
        from rebalancer.v1 import rebalancer_pb2 as pb
        from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
        from rebalancer.wire.channel import sync_channel
        from rebalancer.wire.link import Link

        self.pb = pb
        self.deployment = deployment
        self.timeout = timeout
        self.config = Link(address, token=os.environ.get("REBALANCER_ADMIN_TOKEN"))
        self.channel = sync_channel(self.config)
        self.stub = pb_grpc.AdminServiceStub(self.channel)
        self.ranks_seen = 0  # the most ranks the controller counted connected at once
        self.first_windows: int | None = None  # windows folded at the first poll that answered
        self.windows = 0  # windows folded at the newest poll that answered
        self.balancedness: list[
            float
        ] = []  # newest window's routed balancedness, per new window seen
        self.error = ""  # the newest failed call's status and why ("" once one answers)

    def status(self) -> Any:
        """The deployment's DeploymentStatus, or None while the controller does not know it."""
        import grpc

        try:
            reply = self.stub.Status(
                self.pb.StatusRequest(deployment=self.deployment),
                timeout=self.timeout,
                metadata=self.config.metadata(),
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return reply.deployments[0]

    @property
    def windows_folded(self) -> int:
        """Windows the controller folded for the deployment since the first poll."""
        return self.windows - (self.first_windows or 0)

    def _observe(self, d: Any) -> None:
        windows = 0 if d is None else int(d.windows_folded)
        if self.first_windows is None:
            self.first_windows = windows
        if d is None:
            return
        self.ranks_seen = max(self.ranks_seen, int(d.connected_ranks))
        if windows > self.windows and d.balancedness_actual > 0:  # 0: none measured yet
            self.balancedness.append(float(d.balancedness_actual))
        self.windows = max(self.windows, windows)

    def line(self) -> str:
        import grpc

        from rebalancer.wire.channel import unavailable_cause
        from rebalancer.wire.status import balancedness_text

        try:
            d = self.status()
        except grpc.RpcError as exc:
            details = exc.details() or ""
            cause = (
                unavailable_cause(self.config, details)
                if exc.code() == grpc.StatusCode.UNAVAILABLE
                else ""
            )
            self.error = f"{exc.code().name}: {cause or details}"
            return f"status: {self.error}"
        self.error = ""
        self._observe(d)
        if d is None:
            return f"status: {self.deployment!r} not registered yet"
        flight = f" | plan v{d.plan_in_flight} {d.plan_phase}" if d.plan_in_flight else ""
        last = d.last_decision
        decision = f" | last decision {last.outcome}" if last.outcome else ""
        return (
            f"status v{d.placement_version:<2d} | routed balancedness "
            f"{balancedness_text(d.balancedness_actual, 'none yet')} | on estimate "
            f"{balancedness_text(d.balancedness_estimated, 'none yet')} | {d.windows_folded} "
            f"windows | {d.connected_ranks}/{d.shape.num_gpus} ranks | plans committed "
            f"{d.plans_committed}, aborted {d.plans_aborted}{flight}{decision}"
        )

    def close(self) -> None:
        self.channel.close()


def _attach(
    config: DemoConfig, address: str, tmp: Path, emit: Callable[[str], None]
) -> dict[str, Any]:
    """The demo's workers (and sidecars) on a controller already running: nothing of the
    controller runs here, so what is shown is what an operator sees (the AdminService)."""
    profile_path = write_profile(config, tmp)
    poller = StatusPoller(address, config.deployment)
    emit(
        f"attaching {config.workers} workers to the controller at {address} as deployment "
        f"{config.deployment!r}: {config.layers} layers x {config.experts} experts, {config.slots} "
        f"slots, top-{config.top_k}, DeepSeek-V3 routing drifting over {len(PHASES)} workloads"
        + (f", in {config.sidecars} pods via sidecars" if config.sidecars else ", direct")
    )
    emit(
        "each second: the deployment's status as `rebalancer admin status` shows it "
        "(try `rebalancer admin status|history|force` meanwhile)"
    )
    start = time.monotonic()
    deadline = start + time_limit(config) + 60
    try:
        with demo_fleet(config, address, profile_path, tmp) as procs:
            _follow(procs, poller, deadline, start, emit)
        emit(poller.line())  # the windows folded since the last poll
    finally:
        poller.close()
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(config.workers)]
    seen, k = poller.balancedness, EDGE_WINDOWS
    return {
        "controller": address,
        "deployment": config.deployment,
        # What the controller's status showed (polled each second): no rank ever connected
        # and no window folded means no worker registered (a wrong address or port).
        "windows": poller.windows_folded,
        "ranks_seen": poller.ranks_seen,
        "status_error": poller.error,
        "balancedness_first": float(np.mean(seen[:k])) if seen else float("nan"),
        "balancedness_last": float(np.mean(seen[-k:])) if seen else float("nan"),
        "steps": min(r["steps"] for r in results),
        "workers": config.workers,
        "sidecars": config.sidecars,
        "plans_committed": len(results[0]["commits"]),
        "placement_version": int(results[0]["version"]),
        "bytes_moved": int(sum(r["bytes_received"] for r in results)),
        "max_output_diff": max(r["max_output_diff"] for r in results),
        "weights_match_map": all(r["weights_match_map"] for r in results),
        "ranks_agree_on_versions": len({json.dumps(r["versions"]) for r in results}) == 1,
        "max_swap_ms": 1e3 * max(r["swap_seconds_max"] for r in results),
        "seconds": round(time.monotonic() - start, 1),
        "stopped_early": stopped_early(config, results),
    }
