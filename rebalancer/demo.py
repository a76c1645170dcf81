"""The main job: a controller with an embedded demo on real routing data.

Starts the controller (gRPC, SQLite store) in this process and G real CPU
worker processes (reference.cpu_worker, one gloo EP group) that serve a
small fp32 MoE model. Their routing replays DeepSeek-V3's real per-layer
expert loads, scaled down to the small model (a fixed random subset of the
256 experts keeps the real skew) and drifting across the six published
workloads. Each folded window is printed live; the run ends with a summary
and, with --json, one JSON object on the last line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rebalancer.controller.config import ControllerConfig
from rebalancer.controller.coordinate import Plan
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.deployment import WindowEvent
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.controller.server import ControllerServer
from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3

# Phase order: alternate prefill and decode so the hot experts move.
PHASES = (
    "prefill_in1024", "decode_in1000out1000", "prefill_in4096",
    "decode_in2000out100", "prefill_in500out1500", "prefill_in1000out1000",
)


@dataclass
class DemoConfig:
    workers: int = 4
    layers: int = 6
    experts: int = 32
    slots: int = 40
    top_k: int = 4
    tokens: int = 32              # per rank per step
    steps: int = 480
    window_steps: int = 16
    windows_per_phase: int = 5
    seed: int = 7
    db_path: str | None = None    # default: a temporary file
    port: int = 0
    worker_log: str = "WARNING"
    timeout_seconds: float = 110.0
    # Weight transfers between the worker processes: "p2p" (gloo send/recv) or "ipc"
    # (each rank reads what it gains from its peers' weights in shared memory).
    transport: str = "p2p"
    # Where the workers keep the hook and the expert weights: "cpu" or "cuda".
    device: str = "cpu"
    # Spare weight rows per layer and rank: with enough, a commit copies no weights.
    spare_rows: int = 0
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(
        min_interval_seconds=1.0, gain_threshold=0.03, horizon_seconds=60.0,
        max_moved_fraction=0.3, decay=0.5, min_windows=2, decision_period_seconds=0.25,
        prepare_timeout_seconds=20.0, step_seconds=0.01,
    ))


def routing_profiles(config: DemoConfig) -> np.ndarray:
    """Per-phase expert probabilities [phases, L, E] from the DeepSeek-V3 files.

    Small layer l replays real layer round(l * 57 / (L - 1)); its E experts are
    picked at evenly spaced load ranks of that layer (hottest included, so the
    real skew survives the scale-down) and shuffled over the slots."""
    files = {f.stem: f for f in deepseek_v3_files()}
    rng = np.random.default_rng(config.seed)
    real = np.stack([load_deepseek_v3(files[name]).astype(np.float64) for name in PHASES])
    _, num_real_layers, num_real_experts = real.shape
    layers = np.linspace(0, num_real_layers - 1, config.layers).round().astype(int)
    ranks = np.linspace(0, num_real_experts - 1, config.experts).round().astype(int)
    out = np.empty((len(PHASES), config.layers, config.experts))
    for i, layer in enumerate(layers):
        by_load = np.argsort(-real[:, layer].sum(axis=0))
        experts = rng.permutation(by_load[ranks])
        out[:, i] = real[:, layer][:, experts]
    return out / out.sum(axis=2, keepdims=True)


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous or a server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_profile(config: DemoConfig, folder: Path) -> Path:
    """The routing profile the workers replay, as an .npz in `folder`."""
    path = folder / "routing.npz"
    np.savez(path, profiles=routing_profiles(config),
             steps_per_phase=config.window_steps * config.windows_per_phase)
    return path


def launch_workers(
    config: DemoConfig, address: str, profile: Path, folder: Path,
    extra_args: dict[int, list[str]] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start the G worker processes of one gloo EP group; each writes folder/rank<r>.json."""
    port = free_port()
    env = {**os.environ, "REBALANCER_LOG": config.worker_log, "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(config.workers):
        cmd = [
            sys.executable, "-m", "reference.cpu_worker", "--rank", str(rank),
            "--world", str(config.workers), "--port", str(port), "--controller", address,
            "--profile", str(profile), "--steps", str(config.steps), "--tokens", str(config.tokens),
            "--experts", str(config.experts), "--slots", str(config.slots), "--layers", str(config.layers),
            "--top-k", str(config.top_k), "--window-steps", str(config.window_steps),
            "--max-seconds", str(config.timeout_seconds), "--out", str(folder / f"rank{rank}.json"),
            "--transport", config.transport, "--device", config.device,
            "--spare-rows", str(config.spare_rows),
            *(extra_args or {}).get(rank, []),
        ]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def run_demo(config: DemoConfig, emit: Callable[[str], None] = print) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rebalancer-demo-"))
    profile_path = write_profile(config, tmp)
    events: list[WindowEvent] = []
    plan_log: list[tuple[str, int, str]] = []
    slots_total = config.layers * config.slots

    def on_window(e: WindowEvent) -> None:
        events.append(e)
        emit(f"window {e.seq:3d} | v{e.version:<2d} | routed balancedness {e.balancedness_actual:.3f}"
             f" | on estimate {e.balancedness_estimated:.3f} | fresh fit {e.balancedness_best:.3f}"
             f" | {e.ranks} ranks, {e.tokens} tokens")

    def on_plan(name: str, plan: Plan, what: str) -> None:
        plan_log.append((what, plan.version, plan.reason))
        if what == "proposed":
            emit(f"  plan v{plan.version} proposed ({plan.trigger}): {plan.slots_moved} slots "
                 f"({plan.slots_moved / slots_total:.1%}), {plan.bytes_moved / 1e6:.2f} MB")
        elif what == "aborted":
            emit(f"  plan v{plan.version} aborted: {plan.reason}")
        else:
            emit(f"  plan v{plan.version} {what}")

    def setup(server: ControllerServer) -> None:
        server.controller.observers.window.append(on_window)
        server.controller.observers.plan.append(on_plan)

    ctl = EmbeddedController(
        ControllerConfig(port=config.port, db_path=config.db_path or str(tmp / "controller.sqlite"),
                         policy=config.policy),
        setup,
    )
    server = ctl.start()
    emit(f"controller on {server.address}, store {server.store.path}; "
         f"{config.workers} workers, {config.layers} layers x {config.experts} experts, "
         f"{config.slots} slots, top-{config.top_k}, DeepSeek-V3 routing drifting over {len(PHASES)} workloads")
    start = time.monotonic()
    procs = launch_workers(config, server.address, profile_path, tmp)
    try:
        for p in procs:
            p.wait(timeout=config.timeout_seconds + 60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        time.sleep(0.3)  # last windows
        dep = server.controller.deployments.get("demo")
        ctl.stop()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"workers {failed} failed (see their output above)")
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(config.workers)]
    actual = [e.balancedness_actual for e in events if np.isfinite(e.balancedness_actual)]
    k = 3
    summary = {
        "windows": len(events),
        "steps": min(r["steps"] for r in results),
        "workers": config.workers,
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
        "store": str(server.store.path),
    }
    return summary
