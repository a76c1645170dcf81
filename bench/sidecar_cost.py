"""The pod sidecar's own cost: `python -m bench.sidecar_cost`.

Starts a controller (`rebalancer serve`) and one real `rebalancer sidecar` process serving
the worker API on a Unix socket for the 8 ranks of one DeepSeek-V3 pod (EP8: 58 layers,
256 experts, 288 slots). The 8 ranks live in this process: 7 real `WorkerAgent`s
(worker_hooks.agent, as a rank's hook drives them) fed pre-built windows (58 x 256 logical
and 58 x 288 physical counts, Poisson draws around the real DeepSeek-V3 counts) and one
real `RebalanceHook` on CPU whose steps route a DeepSeek-V3-like batch through all 58
layers (`route`) and end with `step_end`, `--window-steps` steps per window. Every rank
sends `--rate` windows per second.

Beside it, in the same run, the same 8 ranks of a second deployment talk to the
controller directly (7 agents and one hook, TCP on loopback, no TLS). The two hooks step
alternately on the main thread, so drift and machine load hit both alike; the per-step
cost of a rank behind the sidecar and of a direct one are compared from the same steps.

Measured over `--seconds` after `--warmup`:
- the sidecar's CPU, from /proc/<pid>/stat (utime + stime, all its threads), as a
  fraction of one core, and its RSS (VmRSS at the end, VmHWM: the peak);
- the rank windows in and merged windows out of the sidecar (its own /metrics);
- per hook: `route` over the 58 layers and `step_end`, per step (median, p99), and
  `step_end` at the steps that close a window (where the agent gets the window).
Decisions are paused (no plan runs): this is the steady relay of windows.

Every process started here is reaped on exit, failure, Ctrl-C or SIGTERM. The last line
is one JSON object.

    python -m bench.sidecar_cost --seconds 20 --json
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from rebalancer.launch.processes import bound_to_this_process
from rebalancer.wire.shape import ClusterShape

L, E, P, G = 58, 256, 288, 8
TOP_K = 8


# ---------------------------------------------------------------- /proc


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mb(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------- processes


class Processes:
    """Every child process of the run; `close` reaps them all, whatever happened."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, cmd: list[str], log: Path) -> subprocess.Popen[str]:
        with log.open("w") as err:
            proc = subprocess.Popen(
                bound_to_this_process(cmd), stdout=subprocess.PIPE, stderr=err, text=True
            )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):  # the sidecar before the controller
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def first_line(proc: subprocess.Popen[str], words: str, seconds: float, log: Path) -> str:
    """The first stdout line of `proc`, which must contain `words`, within `seconds`."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    line = proc.stdout.readline() if ready else ""
    if words not in line:
        raise RuntimeError(
            f"{log.stem}: no {words!r} within {seconds:.0f} s (got {line!r}, exit code "
            f"{proc.poll()}); its log: {log.read_text()[-2000:]}"
        )
    return line


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        k: float(v)
        for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and ln[0] != "#")
    }


# ---------------------------------------------------------------- the ranks


class NoPlans:
    """Plan handlers of the simulated ranks: decisions are paused, none should come."""

    def __init__(self) -> None:
        self.seen = 0

    def on_prepare(self, prepare: Any) -> None:
        self.seen += 1

    def on_commit(self, version: int) -> None:
        self.seen += 1

    def on_abort(self, version: int, reason: str) -> None:
        self.seen += 1


def rank_windows(
    counts: np.ndarray, phy2log: np.ndarray, n: int, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n` (logical [L, E], physical [L, P]) windows of one rank: Poisson draws around the
    real counts, each expert's tokens split evenly over its slots."""
    rng = np.random.default_rng(seed)
    replicas = np.stack([np.bincount(row, minlength=E) for row in phy2log])  # [L, E]
    out = []
    for _ in range(n):
        logical = rng.poisson(counts).astype(np.int64)
        physical = np.take_along_axis(logical // replicas, phy2log, axis=1).astype(np.int64)
        out.append((logical, physical))
    return out


def routing_batches(counts: np.ndarray, tokens: int, n: int, seed: int) -> list[list[Any]]:
    """`n` steps of routing, each [L] x [tokens, TOP_K] int64 expert ids drawn with the
    real per-layer popularity (distinct experts per token)."""
    import torch

    rng = np.random.default_rng(seed)
    p = counts / counts.sum(axis=1, keepdims=True)
    # Gumbel top-k: k distinct experts per token, in proportion to popularity.
    return [
        [
            torch.from_numpy(
                np.argsort(np.log(p[layer]) + rng.gumbel(size=(tokens, E)), axis=1)[
                    :, -TOP_K:
                ].copy()
            )
            for layer in range(L)
        ]
        for _ in range(n)
    ]


def summarize(values: list[float]) -> dict[str, float]:
    a = np.array(values) * 1e6
    if not a.size:
        return {"n": 0}
    return {
        "n": int(a.size),
        "median_us": float(np.median(a)),
        "p99_us": float(np.percentile(a, 99)),
        "mean_us": float(a.mean()),
    }


# ---------------------------------------------------------------- the run


def run(args: argparse.Namespace, procs: Processes, tmp: Path, sockets: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3
    from rebalancer.launch.processes import free_port
    from rebalancer.placement import trivial_placement
    from worker_hooks.agent import AgentConfig, WorkerAgent
    from worker_hooks.hook import HookConfig, Link, RebalanceHook, WindowConfig

    torch.set_num_threads(1)  # a rank's host work is one thread; the machine has 2 cores
    counts = load_deepseek_v3(deepseek_v3_files()[0]) // 1000
    phy2log = trivial_placement(L, E, P, G)
    shape = ClusterShape(
        num_layers=L, num_logical=E, num_slots=P, num_gpus=G, num_nodes=1, expert_bytes=44 << 20
    )

    # The controller: decisions paused, so only windows flow.
    port = free_port()
    config = tmp / "c.toml"
    config.write_text('[server]\nhost = "127.0.0.1"\n[policy]\npaused = true\n')
    controller = procs.start(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
            "--db",
            str(tmp / "c.sqlite"),
            "--log-level",
            "ERROR",
        ],
        tmp / "controller.log",
    )
    first_line(controller, "serving on", 60, tmp / "controller.log")
    direct = f"127.0.0.1:{port}"

    # The sidecar of the pod's 8 ranks, on its socket.
    target = f"unix://{sockets}/agent.sock"
    sidecar = procs.start(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "sidecar",
            "--listen",
            target,
            "--controller",
            direct,
            "--ranks",
            f"0-{G - 1}",
            "--deployment",
            "pod",
            "--pod",
            "bench/pod-0",
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
            "--grace",
            "1",
            "--log-level",
            "WARNING",
        ],
        tmp / "sidecar.log",
    )
    line = first_line(sidecar, "sidecar serving on", 60, tmp / "sidecar.log")
    metrics_port = int(line.rsplit(":", 1)[1])

    # One process, world of one: the hooks' commit agreement runs its real (gloo) path.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    modes = {"sidecar": ("pod", target), "direct": ("direct", direct)}
    agents: dict[str, list[WorkerAgent]] = {}
    hooks: dict[str, RebalanceHook] = {}
    handlers = NoPlans()
    windows = {
        mode: [rank_windows(counts, phy2log, 4, seed=10 * i + r) for r in range(G - 1)]
        for i, mode in enumerate(modes)
    }
    try:
        for mode, (deployment, address) in modes.items():
            agents[mode] = [
                WorkerAgent(
                    AgentConfig(
                        Link(address, deployment=deployment, worker_id=f"bench-{mode}-{r}"),
                        r,
                        shape,
                    ),
                    handlers,
                    lambda: 0,
                    initial_phy2log=phy2log,
                )
                for r in range(G - 1)
            ]
            hooks[mode] = RebalanceHook(
                HookConfig(
                    link=Link(address, deployment=deployment, worker_id=f"bench-{mode}-hook"),
                    rank=G - 1,
                    shape=shape,
                    windows=WindowConfig(steps=args.window_steps),
                ),
                phy2log,
                {"w": torch.zeros(L, P // G, 1)},
                dist.group.WORLD,
                None,
            )
            for agent in agents[mode]:
                agent.start()
            hooks[mode].start()
        everyone = [a for m in modes for a in (*agents[m], hooks[m].agent)]
        deadline = time.monotonic() + 60
        for agent in everyone:
            if not agent.connected.wait(max(0.1, deadline - time.monotonic())):
                raise RuntimeError(
                    f"rank {agent.config.rank} of {agent.config.link.deployment} never connected; "
                    f"sidecar log: {(tmp / 'sidecar.log').read_text()[-2000:]}"
                )
        while metrics(metrics_port).get("rebalancer_sidecar_upstream_up", 0) != 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the sidecar's group stream never opened")
            time.sleep(0.1)

        batches = routing_batches(counts, args.tokens, 8, seed=1)
        step_period = 1.0 / (args.rate * args.window_steps)
        window_period = 1.0 / args.rate
        start = time.monotonic() + 0.2
        measure_from, stop = start + args.warmup, start + args.warmup + args.seconds
        stop_feeding = threading.Event()

        def feed() -> None:
            """The 7 simulated ranks of each deployment: one window every 1/rate s each."""
            sims = [(a, windows[m][r]) for m in modes for r, a in enumerate(agents[m])]
            next_at = [start + i / len(sims) * window_period for i in range(len(sims))]
            sent = [0] * len(sims)
            while not stop_feeding.is_set():
                i = int(np.argmin(next_at))
                time.sleep(max(0.0, next_at[i] - time.monotonic()))
                if time.monotonic() >= stop:
                    return
                agent, ws = sims[i]
                logical, physical = ws[sent[i] % len(ws)]
                agent.submit_window(
                    sent[i] * args.window_steps, args.window_steps, 0, logical, physical
                )
                sent[i] += 1
                next_at[i] += window_period

        feeder = threading.Thread(target=feed, name="bench-feeder", daemon=True)
        feeder.start()
        times: dict[str, dict[str, list[float]]] = {
            m: {"route": [], "step_end": [], "step_end_window": []} for m in modes
        }
        order = list(modes)
        m0: dict[str, float] = {}
        cpu0 = t0 = 0.0
        load0: list[float] = []
        tick = 0
        next_step = start
        while True:
            time.sleep(max(0.0, next_step - time.monotonic()))
            now = time.monotonic()
            if now >= stop:
                break
            if not m0 and now >= measure_from:
                load0, m0 = load_average(), metrics(metrics_port)
                cpu0, t0 = cpu_seconds(sidecar.pid), time.monotonic()
            batch = batches[tick % len(batches)]
            for mode in order:  # both hooks, alternating which goes first
                hook = hooks[mode]
                a = time.perf_counter()
                for layer in range(L):
                    hook.route(layer, batch[layer])
                b = time.perf_counter()
                hook.step_end()
                c = time.perf_counter()
                if m0:
                    times[mode]["route"].append(b - a)
                    times[mode]["step_end"].append(c - b)
                    if hook.step % args.window_steps == 0:
                        times[mode]["step_end_window"].append(c - b)
            order.reverse()
            tick += 1
            next_step += step_period
        cpu1, t1 = cpu_seconds(sidecar.pid), time.monotonic()
        load1, m1, mem = load_average(), metrics(metrics_port), memory_mb(sidecar.pid)
        stop_feeding.set()
        feeder.join(5)
        delivered = all(agent.drain(10) for agent in everyone)
        time.sleep(1.5)  # the sidecar's last merged windows reach the controller and are acked
        m2 = metrics(metrics_port)
    finally:
        for hook in hooks.values():
            hook.stop()
        for group in agents.values():
            for agent in group:
                agent.stop()
        dist.destroy_process_group()

    elapsed = t1 - t0
    rank_in = m1["rebalancer_sidecar_windows_in_total"] - m0["rebalancer_sidecar_windows_in_total"]
    merged_out = (
        m1["rebalancer_sidecar_windows_out_total"] - m0["rebalancer_sidecar_windows_out_total"]
    )
    steps = {
        mode: {
            "route": summarize(t["route"]),
            "step_end": summarize(t["step_end"]),
            "step_end_window": summarize(t["step_end_window"]),
        }
        for mode, t in times.items()
    }

    def ratio(what: str, stat: str) -> float:
        return steps["sidecar"][what][stat] / steps["direct"][what][stat]

    return {
        "ranks": G,
        "rate": args.rate,
        "seconds": round(elapsed, 2),
        "sidecar_cpu_cores": (cpu1 - cpu0) / elapsed,  # fraction of one core
        "sidecar_cpu_target": 0.05,
        "sidecar_rss_mb": round(mem["VmRSS"], 1),
        "sidecar_peak_rss_mb": round(mem["VmHWM"], 1),
        "rank_windows_in_per_second": rank_in / elapsed,
        "merged_windows_out_per_second": merged_out / elapsed,
        "offered_rank_windows_per_second": G * args.rate,
        "unacked_at_end": m2.get("rebalancer_sidecar_unacked_windows", float("nan")),
        "buffer_merges": m2.get("rebalancer_sidecar_windows_merged_total", float("nan")),
        "all_windows_delivered": delivered,
        "plan_messages_seen": handlers.seen,
        "hook_steps": steps,
        "step_end_median_ratio_sidecar_vs_direct": ratio("step_end", "median_us"),
        "step_end_window_median_ratio_sidecar_vs_direct": ratio("step_end_window", "median_us"),
        "route_median_ratio_sidecar_vs_direct": ratio("route", "median_us"),
        "tokens_per_step": args.tokens,
        "window_steps": args.window_steps,
        "load_avg_start": load0,
        "load_avg_end": load1,
        "machine": f"{os.cpu_count()} cores, {_cpu_model()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _cpu_model() -> str:
    return next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--rate", type=float, default=3.0, help="windows per second per rank")
    p.add_argument("--window-steps", type=int, default=16, help="hook steps per window")
    p.add_argument(
        "--tokens", type=int, default=64, help="tokens per hook step (routed through 58 layers)"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # through the finally blocks: every process is reaped

    signal.signal(signal.SIGTERM, terminate)
    procs = Processes()
    tmp = Path(tempfile.mkdtemp(prefix="sidecar-cost-"))
    sockets = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))  # short: 107-byte socket paths
    try:
        r = run(args, procs, tmp, sockets / "s")
    except KeyboardInterrupt:
        print("sidecar_cost: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    finally:
        procs.close()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)
    s, d = r["hook_steps"]["sidecar"], r["hook_steps"]["direct"]
    print(
        f"sidecar: {100 * r['sidecar_cpu_cores']:.2f} % of one core (target <= 5 %), RSS "
        f"{r['sidecar_rss_mb']:.0f} MiB (peak {r['sidecar_peak_rss_mb']:.0f}), "
        f"{r['rank_windows_in_per_second']:.1f} rank windows/s in, "
        f"{r['merged_windows_out_per_second']:.2f} merged windows/s out, over {r['seconds']:.1f} s"
    )
    for name, x in (("behind sidecar", s), ("direct", d)):
        print(
            f"hook {name:14s}: route (58 layers) median {x['route']['median_us']:.0f} us, p99 "
            f"{x['route']['p99_us']:.0f} us; step_end median {x['step_end']['median_us']:.1f} us, "
            f"p99 {x['step_end']['p99_us']:.1f} us; at window steps median "
            f"{x['step_end_window']['median_us']:.1f} us"
        )
    print(f"load average {r['load_avg_start']} -> {r['load_avg_end']}")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
