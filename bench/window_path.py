"""The controller's per-window path in one process, without sockets: CPU per message.

`WorkerService.Stream` is driven by an in-memory call (hello, then windows) for
`--deployments` DeepSeek-V3 EP32 deployments of 4 pods of 8 ranks (group sessions, as
pod sidecars speak), every pod sending `--windows` uint32 merged windows built as
`bench.ingest` builds them; the streams take turns on one event loop. Each message goes
the whole way a window goes on the controller past gRPC: parse checks, decode, merge,
fold into the estimate, metrics, ack pacing. The policy is paused and contingency
planning switched off (decision-worker work, not the window path), so what is timed is
the window path alone; gRPC's own cost is `bench.ingest`'s.

Against another tree (the interleaved A/B of a change): run this file by its path with
`PYTHONPATH=<that tree>`, e.g.

    PYTHONPATH=/tmp/base python bench/window_path.py --json
    python -m bench.window_path --json

Prints CPU microseconds per message (process time) and wall microseconds per message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

RANKS_PER_POD, PODS = 8, 4  # EP32: 4 pods of 8
L, E, P = 58, 256, 288


class _Call:
    """A server call's context as the Stream handler uses it, reading from a list."""

    def __init__(self, messages: list[Any]) -> None:
        self._messages: Iterator[Any] = iter(messages)

    async def read(self) -> Any:
        await asyncio.sleep(0)  # the other streams take their turn, as on a busy server
        return next(self._messages, grpc.aio.EOF)

    async def write(self, message: Any) -> None:
        pass

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


def _pod_windows(counts: np.ndarray, variants: int = 8, seed: int = 0) -> list[np.ndarray]:
    """A pod's merged windows: each the sum over its ranks of a Poisson draw around the real
    counts (bench.ingest.pod_windows; here so this file runs against any tree)."""
    rng = np.random.default_rng(seed)
    return [
        sum((rng.poisson(counts) for _ in range(RANKS_PER_POD)), np.zeros_like(counts))
        for _ in range(variants)
    ]


async def _run(deployments: int, windows: int, ack_interval: float) -> dict[str, Any]:
    from rebalancer.controller.decide import PolicyConfig
    from rebalancer.controller.metrics import ControllerMetrics
    from rebalancer.controller.service import WorkerService
    from rebalancer.controller.state import Controller
    from rebalancer.controller.store import Store
    from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3
    from rebalancer.v1 import rebalancer_pb2 as pb
    from rebalancer.wire import codec

    counts = load_deepseek_v3(deepseek_v3_files()[0]) // 1000
    encoded = [codec.encode(w.astype(np.uint32)) for w in _pod_windows(counts)]
    shape = pb.ModelShape(
        num_layers=L,
        num_logical_experts=E,
        num_physical_slots=P,
        num_gpus=RANKS_PER_POD * PODS,
        num_nodes=PODS,
        expert_bytes=44 << 20,
    )
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "c.sqlite")
        ctl = Controller(store, default_policy=PolicyConfig(paused=True))
        contingency = getattr(ctl, "contingency", None)  # absent in trees before issue 30
        if contingency is not None:
            contingency.refresh = lambda dep, now: None
        metrics = ControllerMetrics(ctl)
        service = WorkerService(
            ctl,
            on_ingest=metrics.on_ingest,
            ack_interval=ack_interval,
            on_refused=metrics.on_refused,
        )
        streams = []
        for d in range(deployments):
            for p in range(PODS):
                request = pb.RegisterRequest(
                    deployment=f"dsv3-{d}",
                    ranks=list(range(p * RANKS_PER_POD, (p + 1) * RANKS_PER_POD)),
                    pod=f"ns/pod-{d}-{p}",
                    shape=shape,
                )
                reply = await service.Register(request, _Call([]))
                messages = [pb.WorkerMessage(hello=pb.Hello(session_id=reply.session_id))]
                messages += [
                    pb.WorkerMessage(
                        window=pb.Window(
                            seq=reply.next_window_seq + s,
                            num_steps=1,
                            logical_count=encoded[(d * PODS + p + s) % len(encoded)],
                        )
                    )
                    for s in range(windows)
                ]
                streams.append(messages)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(service.Stream(None, _Call(m)) for m in streams))
        cpu1, wall1 = time.process_time(), time.perf_counter()
        messages_sent = len(streams) * windows
        ingested = sum(dep.stats.windows_ingested for dep in ctl.deployments.values())
        if ingested != messages_sent:
            raise RuntimeError(f"{ingested} of {messages_sent} windows ingested")
        store.close()
    return {
        "messages": messages_sent,
        "cpu_us_per_message": (cpu1 - cpu0) / messages_sent * 1e6,
        "wall_us_per_message": (wall1 - wall0) / messages_sent * 1e6,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployments", type=int, default=32)
    p.add_argument("--windows", type=int, default=40, help="windows per pod")
    p.add_argument(
        "--ack-interval",
        type=float,
        default=1.0,
        help="the service's ack interval (0: one ack per window; the windows of a run "
        "arrive within about a second, so 1 paces them)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = _run_sync(args.deployments, args.windows, args.ack_interval)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['messages']} messages: {result['cpu_us_per_message']:.1f} us CPU, "
            f"{result['wall_us_per_message']:.1f} us wall per message (load "
            f"{result['load_avg'][0]})"
        )
    return 0


def _run_sync(deployments: int, windows: int, ack_interval: float) -> dict[str, Any]:
    return asyncio.run(_run(deployments, windows, ack_interval))


if __name__ == "__main__":
    sys.exit(main())
