"""The demo's pod sidecars: one `rebalancer sidecar` per pod, on a Unix socket, ready
before `launch_sidecars` returns."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rebalancer.launch.config import WORKER_TOKEN_ENV, DemoConfig, pod_ranks
from rebalancer.launch.processes import LaunchFailed, bound_to_this_process, exit_text


def launch_sidecars(
    config: DemoConfig,
    address: str,
    folder: Path,
    started: list[subprocess.Popen[bytes]],
    metrics_ports: Sequence[int] = (),
) -> list[str]:
    """Start one `rebalancer sidecar` per pod (socket folder/pod<i>/agent.sock, the pod's
    ranks, upstream `address`, pod name demo/pod<i>), appended to `started` as they start,
    and wait until each answers its readiness check (gRPC health on its socket, what
    `rebalancer sidecar --check` asks). `metrics_ports`: one per pod, each sidecar's
    /metrics on loopback (none without). Returns each rank's target: its pod's socket."""
    from rebalancer.sidecar.config import format_ranks, socket_path
    from rebalancer.sidecar.listen import probe

    pods = pod_ranks(config.workers, config.sidecars)
    sockets = [f"unix://{folder / f'pod{i}' / 'agent.sock'}" for i in range(len(pods))]
    for target in sockets:
        socket_path(target)  # InputError if the temporary folder's path is too long for a socket
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for i, ranks in enumerate(pods):
        cmd = [
            sys.executable,
            "-m",
            "rebalancer",
            "sidecar",
            "--listen",
            sockets[i],
            "--controller",
            address,
            "--ranks",
            format_ranks(tuple(ranks)),
            "--pod",
            f"demo/pod{i}",
            "--deployment",
            config.deployment,
            "--socket-access",
            "owner",
            "--grace",
            "1",
            "--log-level",
            config.worker_log,
        ]
        if metrics_ports:
            cmd += ["--metrics-port", str(metrics_ports[i]), "--metrics-host", "127.0.0.1"]
        token = os.environ.get(WORKER_TOKEN_ENV)
        if token:  # the sidecar holds the pod's credentials: hand it the workers' token
            token_file = folder / f"pod{i}-token"
            token_file.write_text(token)
            token_file.chmod(0o600)
            cmd += ["--token-file", str(token_file)]
        started.append(
            subprocess.Popen(bound_to_this_process(cmd), env=env, stdout=subprocess.DEVNULL)
        )
    for i, (proc, target) in enumerate(zip(started, sockets, strict=True)):
        deadline = time.monotonic() + 60.0
        while True:
            if proc.poll() is not None:
                raise LaunchFailed(
                    f"sidecar of pod {i} {exit_text(proc.returncode)} before it "
                    "was ready (see its output above)"
                )
            ok, seen = probe(target, timeout=1.0)
            if ok:
                break
            if time.monotonic() > deadline:
                raise LaunchFailed(f"sidecar of pod {i} not ready on {target} after 60 s ({seen})")
            time.sleep(0.1)
    return [sockets[rank // (config.workers // config.sidecars)] for rank in range(config.workers)]
