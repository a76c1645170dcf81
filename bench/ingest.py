"""Ingest throughput of the controller over real gRPC streams.

A controller runs in its own process (`rebalancer serve`); N simulated ranks, spread over a
few load-generator processes, each register and keep one stream open, sending
DeepSeek-V3-shaped windows (58 x 256 uint32 counts, pre-built from the real data) at R
windows per second. Latency is send to acknowledgement (the controller acks a window
after decoding, validating and merging it). Controller CPU is read from /proc.

The baseline, measured in the same run with the same load generator, is a bare grpc.aio
server that acks each window without decoding it: what gRPC itself costs.

    python -m bench.ingest --ranks 1024 --rate 3 --seconds 20 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RANKS_PER_DEPLOYMENT = 32  # DeepSeek-V3 at EP32: one deployment per 32 ranks
L, E, P = 58, 256, 288


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- baseline server

def _echo_server(port: int, ready: Any) -> None:
    """A WorkerService that registers anything and acks every window unread."""
    import grpc

    from rebalancer.v1 import rebalancer_pb2 as pb
    from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
    from rebalancer.wire.channel import server_options

    class Echo(pb_grpc.WorkerServiceServicer):
        async def Register(self, request: Any, context: Any) -> Any:
            return pb.RegisterResponse(session_id=f"{request.deployment}/{request.rank}")

        async def Stream(self, request_iterator: Any, context: Any) -> Any:
            async for msg in request_iterator:
                if msg.HasField("window"):
                    yield pb.ControllerMessage(window_ack=pb.WindowAck(seq=msg.window.seq))

    async def main() -> None:
        server = grpc.aio.server(options=server_options())
        pb_grpc.add_WorkerServiceServicer_to_server(Echo(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


# ---------------------------------------------------------------- load generator

def _generator(address: str, ranks: list[int], rate: float, seconds: float, warmup: float,
               counts: np.ndarray, out: Any) -> None:
    import grpc

    from rebalancer.v1 import rebalancer_pb2 as pb
    from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
    from rebalancer.wire import codec
    from rebalancer.wire.channel import client_options

    logical = codec.encode(counts.astype(np.uint32))  # what worker agents send
    shape = pb.ModelShape(num_layers=L, num_logical_experts=E, num_physical_slots=P,
                          num_gpus=RANKS_PER_DEPLOYMENT, num_nodes=4, expert_bytes=44 << 20)
    latencies: list[float] = []
    acked = 0

    async def one_rank(stub: Any, rank: int, start: float, stop: float) -> None:
        nonlocal acked
        deployment, local = f"dsv3-{rank // RANKS_PER_DEPLOYMENT}", rank % RANKS_PER_DEPLOYMENT
        reply = await stub.Register(pb.RegisterRequest(deployment=deployment, rank=local, shape=shape), timeout=30)
        call = stub.Stream()
        await call.write(pb.WorkerMessage(hello=pb.Hello(session_id=reply.session_id)))
        sent: dict[int, float] = {}

        async def reader() -> None:
            nonlocal acked
            async for msg in call:
                now = time.perf_counter()
                ack = msg.window_ack
                t = sent.get(ack.seq)
                if t is not None and start + warmup <= t:
                    # Acks are cumulative and paced: the acked window's send-to-ingested
                    # time is the round trip less the time the controller held the ack.
                    latencies.append(max(0.0, now - t - ack.held_seconds))
                for seq in [s for s in sent if s <= ack.seq]:  # every window it covers
                    if start + warmup <= sent.pop(seq):
                        acked += 1

        task = asyncio.create_task(reader())
        period = 1.0 / rate
        next_at = start + (rank % 97) / 97 * period  # spread the ranks over a period
        seq = reply.next_window_seq
        while True:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            if time.perf_counter() >= stop:
                break
            sent[seq] = time.perf_counter()
            await call.write(pb.WorkerMessage(window=pb.Window(seq=seq, num_steps=1, logical_count=logical)))
            seq += 1
            next_at += period
        await asyncio.sleep(1.0)  # last acks
        await call.done_writing()
        task.cancel()

    async def main() -> None:
        async with grpc.aio.insecure_channel(address, options=client_options()) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            start = time.perf_counter() + 2.0  # registration first, then all start together
            stop = start + warmup + seconds
            await asyncio.gather(*(one_rank(stub, r, start, stop) for r in ranks))

    asyncio.run(main())
    out.put((acked, latencies))


def run_load(address: str, server_pid: int, ranks: int, rate: float, seconds: float,
             processes: int, counts: np.ndarray, warmup: float = 3.0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    shards = [list(range(i, ranks, processes)) for i in range(processes)]
    gens = [ctx.Process(target=_generator, args=(address, s, rate, seconds, warmup, counts, out)) for s in shards]
    for g in gens:
        g.start()
    time.sleep(2.0 + warmup)  # registration and warm-up are not measured
    cpu0, t0 = _cpu_seconds(server_pid), time.perf_counter()
    time.sleep(seconds)
    cpu1, t1 = _cpu_seconds(server_pid), time.perf_counter()
    results = [out.get(timeout=120) for _ in gens]
    for g in gens:
        g.join(30)
    lat = np.array([x for _, ls in results for x in ls]) * 1e3
    return {
        "ranks": ranks,
        "offered_windows_per_second": ranks * rate,
        "windows_per_second": sum(a for a, _ in results) / seconds,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "controller_cpu_cores": (cpu1 - cpu0) / (t1 - t0),
        "mb_per_second": sum(a for a, _ in results) / seconds * counts.size * 4 / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--rate", type=float, default=3.0, help="windows per second per rank")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--processes", type=int, default=2, help="load-generator processes")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--ack-interval", type=float, default=1.0,
                   help="controller's ack_interval_seconds (0: one ack per window)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.ranks % RANKS_PER_DEPLOYMENT:
        print(f"--ranks must be a multiple of {RANKS_PER_DEPLOYMENT}", file=sys.stderr)
        return 2

    from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3
    from rebalancer.demo import free_port

    counts = load_deepseek_v3(deepseek_v3_files()[0]) // 1000  # one window's worth, real skew

    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        config = Path(tmp) / "c.toml"
        # Decisions run as in production (default period, off the event loop); a plan they
        # start waits for ranks that never answer and times out, so this measures ingest,
        # estimate and decide together.
        config.write_text(
            f"[server]\nhost = \"127.0.0.1\"\nack_interval_seconds = {args.ack_interval}\n"
            "[policy]\nmin_windows = 1\n"
        )
        server = subprocess.Popen(
            [sys.executable, "-m", "rebalancer", "serve", "--config", str(config), "--port", str(port),
             "--db", f"{tmp}/c.sqlite", "--log-level", "ERROR"], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and "serving on" in server.stdout.readline()
        try:
            rows["controller"] = run_load(f"127.0.0.1:{port}", server.pid, args.ranks, args.rate,
                                          args.seconds, args.processes, counts)
        finally:
            server.terminate()
            server.wait(30)
        if not args.no_baseline:
            ctx = mp.get_context("spawn")
            ready = ctx.Event()
            port = free_port()
            echo = ctx.Process(target=_echo_server, args=(port, ready), daemon=True)
            echo.start()
            ready.wait(30)
            try:
                rows["bare_grpc_echo"] = run_load(f"127.0.0.1:{port}", echo.pid or 0, args.ranks, args.rate,
                                                  args.seconds, args.processes, counts)
            finally:
                echo.terminate()
                echo.join(10)
    for name, r in rows.items():
        print(f"{name:16s} {r['windows_per_second']:8.0f} windows/s of {r['offered_windows_per_second']:.0f} offered, "
              f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, {r['controller_cpu_cores']:.2f} cores, "
              f"{r['mb_per_second']:.0f} MB/s")
    if args.record:
        record(args, rows)
    summary = dict(rows["controller"])
    if "bare_grpc_echo" in rows:
        summary["baseline"] = rows["bare_grpc_echo"]
    if args.json:
        print(json.dumps(summary))
    return 0


def record(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    path = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = [
        f"\n### Ingest, {args.ranks} ranks x {args.rate:g} windows/s ({time.strftime('%Y-%m-%d')})\n",
        f"`python -m bench.ingest --ranks {args.ranks} --rate {args.rate:g} --seconds {args.seconds:g} "
        f"--processes {args.processes} --record` on {os.cpu_count()} cores ({cpu}), load generator on the same "
        "machine.\n",
        "| server | windows/s ingested | offered | p50 ms | p99 ms | server CPU cores | MB/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['windows_per_second']:.0f} | {r['offered_windows_per_second']:.0f} | "
                     f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['controller_cpu_cores']:.2f} | {r['mb_per_second']:.0f} |")
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    marker = "## Controller ingest"
    if marker not in text:
        text += f"\n{marker}\n"
    head, _, tail = text.partition(marker)
    # Keep other sections; this one grows by appending runs under its heading.
    nxt = tail.find("\n## ")
    section, rest = (tail, "") if nxt < 0 else (tail[:nxt], tail[nxt:])
    path.write_text(head + marker + section.rstrip("\n") + "\n" + "\n".join(lines) + "\n" + rest)


if __name__ == "__main__":
    sys.exit(main())
