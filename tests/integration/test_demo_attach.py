"""An operator's first hour, for real: `rebalancer serve` runs, `rebalancer demo --controller`
attaches CPU workers and a pod sidecar to it, and `rebalancer admin` sees the deployment
they make (status, history, a forced plan) and the metrics port shows it. Every process
is a real one and is reaped whatever happens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rebalancer.launch.processes import free_port
from tests.integration.conftest import start_controller
from tests.integration.test_process_lifetime import alive, children_of


def _admin(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "admin",
            "--address",
            address,
            "--timeout",
            "10",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_demo_attaches_to_a_running_controller(tmp_path: Path) -> None:
    metrics_port = free_port()
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "serve",
            "--port",
            "0",
            "--metrics-port",
            str(metrics_port),
            "--db",
            str(tmp_path / "c.sqlite"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    demo: subprocess.Popen[str] | None = None
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        assert line.startswith("serving on "), line
        address = line.split()[2].rstrip(",")
        assert "no deployments" in _admin(address, "status").stdout
        demo = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rebalancer",
                "demo",
                "--controller",
                address,
                "--workers",
                "2",
                "--sidecars",
                "1",
                "--windows",
                "6",
                "--deployment",
                "tryout",
                "--json",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        # While it runs, the operator sees the deployment the workers made.
        deadline = time.monotonic() + 90
        while True:
            status = _admin(address, "status", "tryout", "--json")
            if (
                status.returncode == 0
                and json.loads(status.stdout)["deployments"][0]["windows_ingested"]
            ):
                break
            assert demo.poll() is None, "the demo ended before the controller saw a window"
            assert time.monotonic() < deadline, status.stderr
            time.sleep(0.5)
        out, _ = demo.communicate(timeout=180)
        assert demo.returncode == 0, out[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["controller"] == address and summary["deployment"] == "tryout"
        # What the controller's status showed (issue 34: no balancedness in this summary).
        assert (
            summary["ranks_seen"] == 2 and summary["windows"] >= 1 and summary["status_error"] == ""
        )
        for key in ("balancedness_first", "balancedness_last"):
            assert 0.0 < summary[key] <= 1.0, (key, summary)
        assert summary["max_output_diff"] == 0.0 and summary["ranks_agree_on_versions"]
        assert "status v" in out  # the demo showed the AdminService's status as it ran
        # After the workers left, the controller keeps what they did.
        (dep,) = json.loads(_admin(address, "--json", "status").stdout)["deployments"]
        assert dep["deployment"] == "tryout" and dep["connected_ranks"] == 0
        assert int(dep["placement_version"]) == summary["placement_version"]
        history = json.loads(_admin(address, "history", "tryout", "--json").stdout)
        assert (
            len([p for p in history["plans"] if p["state"] == "committed"])
            == summary["plans_committed"]
        )
        # No rank connected: a forced decision is taken and recorded, but starts no plan:
        # exit 4, the reason on one line.
        force = _admin(address, "force", "tryout")
        assert (force.returncode, force.stdout) == (4, ""), force.stdout + force.stderr
        assert force.stderr == (
            "rebalancer admin: error: no plan started for 'tryout': skip_ranks: "
            "only 0 of 2 ranks connected (missing: ranks 0-1)\n"
        )
        status = json.loads(_admin(address, "status", "tryout", "--json").stdout)["deployments"][0]
        assert status["last_decision"]["outcome"] == "skip_ranks" and not status["plan_in_flight"]
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
        assert 'rebalancer_placement_version{deployment="tryout"}' in metrics
        assert 'rebalancer_rebalancing_state{deployment="tryout",state="idle"} 1.0' in metrics
    finally:
        for proc in (demo, serve):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_demo_attached_to_no_controller_exits_1_saying_so() -> None:
    """Issue 34: with a mistyped port no worker ever registers, yet the demo exited 0 (the
    workers serve on without a controller). Now exit 1, the reason on one line."""
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "demo",
            "--controller",
            address,
            "--workers",
            "2",
            "--sidecars",
            "1",
            "--windows",
            "4",
            "--window-steps",
            "2",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = demo.communicate(timeout=180)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 1, out[-3000:] + err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["ranks_seen"], summary["windows"]) == (0, 0) and "UNAVAILABLE" in summary[
        "status_error"
    ]
    assert err.splitlines()[-1].startswith(
        f"rebalancer demo: error: no worker registered with the controller at {address} as "
        "deployment 'demo': no rank connected, no window folded (last status: UNAVAILABLE"
    ), err


def test_a_worker_killed_under_demo_controller_ends_it_in_one_line(tmp_path: Path) -> None:
    """Issue 34: a worker SIGKILLed under `demo --controller` ended the demo with a traceback
    (RuntimeError from the fleet), after the survivors' own gloo tracebacks. Now: exit 1,
    one error line naming the killed worker, no traceback, and no worker or sidecar left."""
    ctl = start_controller(tmp_path / "c.sqlite")
    address = ctl.server.address  # type: ignore[union-attr]
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "demo",
            "--controller",
            address,
            "--workers",
            "2",
            "--sidecars",
            "1",
            "--windows",
            "400",
            "--window-steps",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    children: dict[int, int] = {}
    try:

        def folded() -> int:
            dep = ctl.server.controller.deployments.get("demo")  # type: ignore[union-attr]
            return int(dep.estimator.windows) if dep is not None else 0

        deadline = time.monotonic() + 120
        while ctl.call(folded) < 1:  # both ranks serve: the group is up
            assert demo.poll() is None, demo.stderr.read() if demo.stderr else ""
            assert time.monotonic() < deadline, "no window folded"
            time.sleep(0.2)
        children = children_of(demo.pid)
        commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children}
        (victim,) = [
            pid
            for pid, cmd in commands.items()
            if b"worker_hooks.examples.cpu_worker" in cmd and cmd[cmd.index(b"--rank") + 1] == b"1"
        ]
        assert any(b"sidecar" in cmd for cmd in commands.values()), commands
        os.kill(victim, signal.SIGKILL)
        _, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid, start in children.items():  # never leave one behind, even when failing
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        ctl.stop()
    assert demo.returncode == 1, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("rebalancer demo: error:")]
    assert errors == [err.splitlines()[-1]], err
    # The killed worker named first (its peer, if it saw the loss first, exits 1 after it).
    assert errors[0].startswith("rebalancer demo: error: worker 1 was killed by SIGKILL"), err
    assert not [pid for pid, start in children.items() if alive(pid, start)], (
        "a worker or sidecar outlived the demo"
    )
