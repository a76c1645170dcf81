"""The demo's CPU workers (worker_hooks.examples.cpu_worker): G processes of one gloo EP
group serving a small MoE model on the routing profile, each bound to this process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from rebalancer.launch.config import DemoConfig, time_limit
from rebalancer.launch.processes import bound_to_this_process, free_port, reap


def launch_workers(
    config: DemoConfig,
    address: str | Sequence[str],
    profile: Path,
    folder: Path,
    extra_args: dict[int, list[str]] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start the G worker processes of one gloo EP group; each writes folder/rank<r>.json.

    `address`: the controller's, or one target per rank (its pod sidecar's socket). Each
    worker dies with this process (rebalancer.launch.processes)."""
    targets = [address] * config.workers if isinstance(address, str) else list(address)
    if len(targets) != config.workers:
        raise ValueError(f"{len(targets)} controller targets for {config.workers} workers")
    port = free_port()
    env = {**os.environ, "REBALANCER_LOG": config.worker_log, "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(config.workers):
            cmd = [
                sys.executable,
                "-m",
                "worker_hooks.examples.cpu_worker",
                "--rank",
                str(rank),
                "--world",
                str(config.workers),
                "--port",
                str(port),
                "--controller",
                targets[rank],
                "--profile",
                str(profile),
                "--steps",
                str(config.steps),
                "--tokens",
                str(config.tokens),
                "--experts",
                str(config.experts),
                "--slots",
                str(config.slots),
                "--layers",
                str(config.layers),
                "--top-k",
                str(config.top_k),
                "--window-steps",
                str(config.windows.steps),
                "--max-seconds",
                str(time_limit(config)),
                "--out",
                str(folder / f"rank{rank}.json"),
                "--transport",
                config.transport,
                "--device",
                config.device,
                "--spare-rows",
                str(config.spare_rows),
                "--deployment",
                config.deployment,
                *(extra_args or {}).get(rank, []),
            ]
            procs.append(subprocess.Popen(bound_to_this_process(cmd), env=env))
    except BaseException:
        reap(procs, terminate=False)
        raise
    return procs
