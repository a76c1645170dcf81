"""The campaign: the run's folder, store, proxy and admin client, the episode loop and
the report. Processes are started and reaped in processes.py, the faults are in
faults.py, the timeline in schedule.py and the invariants in checks.py."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from rebalancer.launch.config import DemoConfig
from rebalancer.launch.processes import free_port
from rebalancer.launch.routing import write_profile
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from reliability.chaos import checks, faults, schedule
from reliability.chaos.checks import Outcome
from reliability.chaos.config import CONTROLLER_TOML, DEPLOYMENT, ChaosConfig
from reliability.chaos.processes import Processes
from reliability.chaos.steplog import STEP, VERSION
from reliability.faultproxy import FaultProxy
from worker_hooks.config import WindowConfig


class Harness:
    def __init__(self, config: ChaosConfig) -> None:
        self.cfg = config
        # The run's one RNG: every fault and every moment is drawn from it (schedule.py).
        self.rng = random.Random(config.seed)
        self.tmp = Path(tempfile.mkdtemp(prefix="chaos", dir="/tmp"))  # short: socket paths
        try:
            self.store_dir = self.tmp / "store"
            self.store_dir.mkdir()
            self.tmpfs = False
            self.db = self.store_dir / "c.sqlite"
            self.out = Outcome()
            self.port = free_port()
            self.demo = DemoConfig(
                workers=config.workers,
                layers=config.layers,
                experts=config.experts,
                slots=config.slots,
                top_k=config.top_k,
                tokens=config.tokens,
                windows=WindowConfig(steps=config.window_steps),
                seed=config.seed,
            )
            self.profile = write_profile(self.demo, self.tmp)
            (self.tmp / "c.toml").write_text(
                CONTROLLER_TOML.format(prepare_timeout=config.prepare_timeout_seconds)
            )
            self.proxy = FaultProxy()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.admin_channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.admin = pb_grpc.AdminServiceStub(self.admin_channel)
        self.procs = Processes(config, self.tmp, self.db, self.port, self.profile, self.proxy)
        self.t0 = time.monotonic()

    # ------------------------------------------------------------ output

    def say(self, msg: str) -> None:
        if self.cfg.progress:
            print(f"[chaos {time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def violation(self, msg: str) -> None:
        self.out.violations.append(msg)
        self.say(f"VIOLATION {msg}")

    # ------------------------------------------------------------ the deployment's view

    def status(self, timeout: float = 2.0) -> pb.DeploymentStatus | None:
        try:
            reply = self.admin.Status(pb.StatusRequest(deployment=DEPLOYMENT), timeout=timeout)
        except grpc.RpcError:
            return None
        return reply.deployments[0] if reply.deployments else None

    def rank_versions(self) -> list[int | None]:
        assert self.procs.group is not None
        out = []
        for log in self.procs.group.logs:
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

    def wait_serving(self, seconds: float) -> None:
        """Until every rank of the group has logged steps."""
        assert self.procs.group is not None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if all(len(log.read()) > 2 for log in self.procs.group.logs):
                return
            time.sleep(0.1)

    # ------------------------------------------------------------ restarts

    def restart_controller(self, since: float | None = None) -> None:
        """The controller again on its store; recovery is from `since` (the kill) to every
        rank resynced."""
        start = since if since is not None else time.monotonic()
        for _ in range(3):
            if self.procs.start_controller():
                break
            self.violation(
                f"controller refused to restart on its store: {self.procs.tail('controller.log')}"
            )
        self.out.controller_restarts += 1
        waited = self.wait_ready(60.0)
        if waited is None:
            self.violation("controller restarted but not every rank resynced within 60 s")
            return
        seconds = time.monotonic() - start
        self.out.recoveries.append(seconds)
        self.say(f"controller back, every rank resynced {seconds:.2f}s after the kill")

    def restart_group(self) -> None:
        """The group's ranks killed and the deployment's G ranks started again, on the same
        sidecars and controller, from the placement they start with."""
        assert self.procs.group is not None
        start = time.time()
        self.procs.kill_group(self.procs.group)
        group = self.procs.start_group()
        if self.wait_ready(60.0) is None:
            self.violation(f"group {group.index}: ranks not all connected 60 s after the restart")
        self.wait_serving(60.0)
        self.out.excused.append((start, time.time() + 1.0))
        self.out.group_restarts += 1

    # ------------------------------------------------------------ the run

    def setup(self) -> None:
        if self.cfg.hog:
            self.procs.start_hogs(self.cfg.hog)
        if os.geteuid() == 0 and shutil.which("mount"):
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(self.store_dir)],
                capture_output=True,
            )
            self.tmpfs = r.returncode == 0
        self.proxy.add("controller", "127.0.0.1:0", f"127.0.0.1:{self.port}")
        for pod in range(self.cfg.pods):
            (self.tmp / f"pod{pod}").mkdir()
            self.proxy.add(
                f"pod{pod}",
                f"unix://{self.tmp}/pod{pod}/proxy.sock",
                f"unix://{self.tmp}/pod{pod}/agent.sock",
            )
        if not self.procs.start_controller():
            raise RuntimeError(f"controller did not start: {self.procs.tail('controller.log')}")
        for pod in range(self.cfg.pods):
            self.procs.start_sidecar(pod)
        self.procs.start_group()
        if self.wait_ready(90.0) is None:
            raise RuntimeError("ranks did not connect within 90 s")
        self.wait_serving(60.0)

    def run(self) -> dict[str, Any]:
        start = time.monotonic()
        try:  # an error or SIGTERM too: no process (_run), tmpfs or folder is left behind
            self._run(start)
            return self.report(time.monotonic() - start)
        finally:
            self.release_files()

    def _run(self, start: float) -> None:
        try:
            self.setup()
            self.say(
                f"up: controller :{self.port}, {self.cfg.pods} sidecars, {self.cfg.workers} ranks; "
                f"store on {'tmpfs' if self.tmpfs else 'disk'}; {self.tmp}"
            )
            first = schedule.first_turns(self.rng, self.cfg.kinds)
            episode = 0
            end = start + self.cfg.seconds
            while time.monotonic() < end or first:  # every kind gets its turn
                self.procs.track_descendants()
                kind = first.pop(0) if first else schedule.next_kind(self.rng, self.cfg.kinds)
                self.episode(episode, kind)
                episode += 1
            self.finish_group()
        finally:
            self.procs.track_descendants()
            self.teardown()

    def episode(self, index: int, kind: str) -> None:
        """One fault of `kind` at the episode's plan phase, link faults beside it, then
        agreement again."""
        hit = schedule.reach(self, schedule.phase_of(index))
        self.out.phases[hit] += 1
        storm = schedule.storm(self.rng, self.cfg.kinds)
        self.say(
            f"episode {index}: {kind} at {hit}" + (f" with {', '.join(storm)}" if storm else "")
        )
        until = time.monotonic() + max((faults.link_fault(self, k) for k in storm), default=0.0)
        faults.inject(self, kind)
        time.sleep(max(0.0, until - time.monotonic()))
        checks.settle(self)

    def finish_group(self) -> None:
        """End the live group at one step on every rank and check its final results."""
        g = self.procs.group
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
        results = [
            json.loads((g.folder / f"rank{r}.json").read_text()) for r in range(self.cfg.workers)
        ]
        if not all(r["weights_match_map"] for r in results):
            self.violation(f"group {g.index}: weights do not match the map at the end")
        if any(r["agreement_broken"] for r in results):
            self.violation(f"group {g.index}: commit agreement broken")

    def teardown(self) -> None:
        self.procs.kill_hogs()  # first: the rest then ends on a CPU of its own
        with contextlib.suppress(Exception):
            self.proxy.heal()
        self.procs.stop_all()
        self.admin_channel.close()
        self.proxy.close()
        time.sleep(0.5)  # children of the dead (decision workers) get their death signal

    def release_files(self) -> None:
        """Unmount the store's tmpfs and remove the run's folder (kept with --keep, with a
        copy of a tmpfs store)."""
        if self.tmpfs and self.cfg.keep:  # the tmpfs goes either way
            with contextlib.suppress(OSError):
                shutil.copytree(
                    self.store_dir,
                    self.tmp / "store-copy",
                    ignore=shutil.ignore_patterns("ballast"),
                )
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.store_dir)], capture_output=True)
        if not self.cfg.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def report(self, seconds: float) -> dict[str, Any]:
        """The run's figures and violations (the JSON object of `--json`)."""
        plans = checks.final_plans(self.db, self.violation)
        figures = checks.check_step_logs(
            self.procs.groups, plans, self.out.excused, self.cfg.step_wait_bound_ms, self.violation
        )
        leaked = self.procs.leaked()
        rec = sorted(self.out.recoveries)
        p99 = checks.recovery_p99(rec)
        if rec and p99 > self.cfg.recovery_bound_seconds:
            self.violation(
                f"controller recovery p99 {p99:.1f} s is above "
                f"{self.cfg.recovery_bound_seconds:g} s"
            )
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
            "transfer_timeouts": checks.transfer_timeouts(self.tmp),
            "store": "tmpfs" if self.tmpfs else "disk",
            "workers": self.cfg.workers,
            "sidecars": self.cfg.pods,
            "hog": self.cfg.hog,
            "load_avg": round(os.getloadavg()[0], 2),
        }
        if self.cfg.keep:
            result["kept"] = str(self.tmp)
        return result


def run_chaos(config: ChaosConfig) -> dict[str, Any]:
    return Harness(config).run()
