"""Ingest throughput of the controller over real gRPC streams.

A controller runs in its own process (`rebalancer serve`) and load-generator processes
speak to it as the workers of DeepSeek-V3 deployments at EP32 (32 ranks each) would:

- direct (`--ranks-per-pod 1`, the default): every rank registers on its own and keeps
  one stream, sending one window (58 x 256 uint32 counts, pre-built from the real data)
  every 1/R seconds;
- through pod sidecars (`--ranks-per-pod K`, e.g. 8: 4 pods per deployment): every pod
  registers once as a group of its K ranks (`RegisterRequest(ranks=[...], pod="ns/pod-i")`)
  and keeps one stream, sending every 1/R seconds the pod's merged window: the counts
  summed over its K ranks, as `rebalancer sidecar` sends them upstream (uint32; pre-built
  from K per-rank Poisson draws around the real counts).

- an EP group merged at one sidecar (`--ranks-per-pod 32`: the leader pod's sidecar sums
  its group's pods, rebalancer/sidecar/merge.py): one group stream per deployment, its
  window the sum over all 32 ranks;
- replica pools (`--pool-size N`): deployment i registers in pool `pool-{i // N}`
  (`RegisterRequest.pool`), one estimate and decision per pool.

Either way `ranks x rate` rank-windows per second reach the controller, as `ranks x rate`
or `pods x rate` messages. Throughput is what the controller folded into its estimates
during the measured interval (its `rebalancer_rank_windows_folded_total`, read at both
ends of it), not what was acknowledged: a lagging controller acks windows after the
interval, and counting those made it look as if it kept up. Latency is send to
acknowledgement (the controller acks a window after decoding, validating and merging it;
acks are cumulative and paced, so the time the controller held an ack is taken off).
Controller CPU is read from /proc, over the measured interval only; the decision worker
(its child process) is reported apart. The loop's busy share is the rate of
`rebalancer_event_loop_busy_seconds_total` (wall time its one event loop ran callbacks
rather than waiting for I/O: near 1, windows queue), beside the CPU of the loop's thread.

Every session answers a Prepare with PREPARED and a Commit with COMMITTED at once (as a
pod's sidecar whose ranks hold spare rows would), so plans commit and the controller's
whole plan work (decide, transfer lists, Prepare fan-out, commit) is in the figures;
`session_commits` counts the commits reported.

The baseline, measured in the same run with the same load generator, is a bare grpc.aio
server that acks each window without decoding it: what gRPC itself costs.

    python -m bench.ingest --ranks 16384 --ranks-per-pod 8 --rate 1 --seconds 20 --json
    python -m bench.ingest --ranks 65536 --ranks-per-pod 32 --pool-size 8 --rate 1 --json
    python -m bench.ingest --ranks 1024 --rate 3 --seconds 20 --json

The last line with --json is one JSON object: the controller's figures (`ranks`, `pods`
(0: direct), `windows_per_second` = rank windows ingested per second, `messages_per_second`,
`folded_share` (rank windows folded over those offered: 1 when the controller keeps up),
`p50_ms`, `p99_ms`, `controller_cpu_cores`, `decision_worker_cpu_cores`, `loop_busy_share`,
`loop_thread_cpu_cores`, `cpu_us_per_rank_window` (controller CPU over rank windows folded),
`acked_windows_per_second` (the old count, for comparison),
`generator_cpu_cores` (the load generators share the machine), the 1/5/15-min
load average at the start and end of the measured interval, ...), the same for the
baseline under `baseline`, the machine and the date. `--no-decisions` pauses the policy:
ingest alone, without the estimate-and-decide work and plans that otherwise run.
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

from rebalancer.controller.decision_process import bind_to_parent

RANKS_PER_DEPLOYMENT = 32  # DeepSeek-V3 at EP32: one deployment per 32 ranks
L, E, P = 58, 256, 288
POD_VARIANTS = 8  # distinct pre-built pod windows (pod i sends variant i % 8)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_seconds(pid: int, tid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(metrics_port: int, names: tuple[str, ...], labelled: bool = False) -> dict[str, float]:
    """The controller's series `names` (unlabelled counters; `labelled`: every series, by its
    full name with labels), from a scrape restricted to them: the per-deployment collector
    is not run, so reading costs the controller almost nothing."""
    from urllib.parse import urlencode
    from urllib.request import urlopen

    query = urlencode([("name[]", n) for n in names])
    with urlopen(f"http://127.0.0.1:{metrics_port}/metrics?{query}", timeout=30) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1) if labelled else line.split()[:2]
            out[name] = float(value)
    return out


FOLDED = "rebalancer_rank_windows_folded_total"
LOOP_BUSY = "rebalancer_event_loop_busy_seconds_total"
# The loop's iterations by length (a controller from before it has none: NaN below).
LOOP_ITERATION_BUCKETS = "rebalancer_event_loop_iteration_seconds_bucket"
LONG_ITERATION = 0.05  # seconds: an iteration longer than p99's target


def long_iterations(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """Between two readings: the loop iterations longer than LONG_ITERATION, and the bucket
    bound (ms) the longest one stayed within (NaN without the histogram)."""

    def buckets(reading: dict[str, float]) -> dict[float, float]:  # le -> cumulative count
        return {
            float(k.split('le="')[1].split('"')[0]): v
            for k, v in reading.items()
            if k.startswith(LOOP_ITERATION_BUCKETS)
        }

    b0, b1 = buckets(before), buckets(after)
    if not b0 or set(b0) != set(b1):
        return float("nan"), float("nan")
    ran = {le: b1[le] - b0[le] for le in b1}  # per bound, iterations within it
    total = ran[float("inf")]
    long = total - ran[LONG_ITERATION]
    longest = min(le for le, n in ran.items() if n >= total)
    return long, longest * 1e3


# A controller from before FOLDED (run against an older tree, PYTHONPATH=<tree>): its merged
# windows folded per deployment, each RANKS_PER_DEPLOYMENT rank windows here (every rank
# sends every window). Reading it runs that tree's per-deployment collector: the scrapes
# fall outside the CPU interval but not outside the loop's.
FOLDED_PER_DEPLOYMENT = "rebalancer_windows_folded_total"


def read_counts(metrics_port: int) -> tuple[float, dict[str, float]]:
    """(time of the reading, {FOLDED, LOOP_BUSY, LOOP_ITERATION's buckets} as far as the
    controller has them)."""
    t0 = time.monotonic()
    got = scrape(metrics_port, (FOLDED, LOOP_BUSY))
    got.update(scrape(metrics_port, (LOOP_ITERATION_BUCKETS,), labelled=True))
    if FOLDED not in got:
        merged = scrape(metrics_port, (FOLDED_PER_DEPLOYMENT,), labelled=True)
        got[FOLDED] = RANKS_PER_DEPLOYMENT * sum(merged.values())
    return (t0 + time.monotonic()) / 2, got


def full_scrapes(metrics_port: int | None, every: float, end: float) -> list[tuple[float, int]]:
    """Scrape the whole exposition every `every` seconds until `end` (time.monotonic), as a
    Prometheus server would: (seconds, bytes) of each scrape."""
    from urllib.request import urlopen

    done: list[tuple[float, int]] = []
    while metrics_port and time.monotonic() + every <= end:
        time.sleep(every)
        t0 = time.monotonic()
        with urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60) as reply:
            size = len(reply.read())
        done.append((time.monotonic() - t0, size))
    return done


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass  # gone meanwhile
    return out


def _cpu_of(pids: list[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            out[pid] = _cpu_seconds(pid)
        except OSError:
            pass
    return out


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------- baseline server


def _echo_server(port: int, ready: Any, parent: int = 0) -> None:
    """A WorkerService that registers anything and acks every window unread; it dies
    with `parent`, the bench."""
    if parent:
        bind_to_parent(parent)
    import grpc

    from rebalancer.v1 import rebalancer_pb2 as pb
    from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
    from rebalancer.wire.channel import server_options

    class Echo(pb_grpc.WorkerServiceServicer):
        async def Register(self, request: Any, context: Any) -> Any:
            who = request.pod or request.rank
            return pb.RegisterResponse(session_id=f"{request.deployment}/{who}")

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


def pod_windows(
    counts: np.ndarray, ranks_per_pod: int, variants: int = POD_VARIANTS, seed: int = 0
) -> list[np.ndarray]:
    """Pre-built merged windows of a pod: each the sum over its ranks of one window per
    rank, a Poisson draw around the real counts (so ranks differ as real ones do)."""
    rng = np.random.default_rng(seed)
    return [
        sum((rng.poisson(counts) for _ in range(ranks_per_pod)), np.zeros_like(counts))
        for _ in range(variants)
    ]


def _generator(
    address: str,
    units: list[int],
    ranks_per_pod: int,
    rate: float,
    seconds: float,
    warmup: float,
    windows: list[np.ndarray],
    drain: float,
    ready: Any,
    go: Any,
    out: Any,
    niceness: int = 0,
    pool_size: int = 0,
    parent: int = 0,
) -> None:
    """Speaks for `units`: ranks (direct) or pods of `ranks_per_pod` ranks (sidecars).
    `niceness`: the generators stand for remote pods, which in a cluster do not share the
    controller's cores; on a 2-core machine they do, and `--generator-nice` lowers their
    priority below the controller's (the figure then says so). `parent`: the bench, which
    this process dies with (a bench killed outright leaves no generator behind)."""
    if parent:
        bind_to_parent(parent)
    if niceness:
        os.nice(niceness)
    import grpc

    from rebalancer.v1 import rebalancer_pb2 as pb
    from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
    from rebalancer.wire import codec
    from rebalancer.wire.channel import client_options

    encoded = [codec.encode(w.astype(np.uint32)) for w in windows]  # what agents / sidecars send
    shape = pb.ModelShape(
        num_layers=L,
        num_logical_experts=E,
        num_physical_slots=P,
        num_gpus=RANKS_PER_DEPLOYMENT,
        num_nodes=4,
        expert_bytes=44 << 20,
    )
    latencies: list[float] = []
    acked = 0  # messages sent in the measured interval and acknowledged
    plans_committed = 0  # plan commits this generator's sessions reported
    reports: set[asyncio.Task[None]] = set()
    registered = 0
    errors: list[str] = []

    def request(unit: int) -> Any:
        first = unit * ranks_per_pod
        index, local = first // RANKS_PER_DEPLOYMENT, first % RANKS_PER_DEPLOYMENT
        deployment = f"dsv3-{index}"
        pool = f"pool-{index // pool_size}" if pool_size else ""
        if ranks_per_pod == 1:  # a v1 client: one rank
            return pb.RegisterRequest(deployment=deployment, rank=local, shape=shape, pool=pool)
        return pb.RegisterRequest(
            deployment=deployment,
            ranks=list(range(local, local + ranks_per_pod)),
            pod=f"ns/pod-{unit}",
            shape=shape,
            pool=pool,
        )

    async def register(stub: Any, unit: int, gate: asyncio.Semaphore) -> Any:
        # A burst of thousands of simultaneous Registers is partly CANCELLED by gRPC itself
        # (a bare grpc.aio server does it too); sidecars and agents retry such refusals with
        # backoff, and so does this, a few at a time.
        for attempt in range(8):
            try:
                async with gate:
                    return await stub.Register(request(unit), timeout=120)
            except grpc.aio.AioRpcError as exc:
                if (
                    exc.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
                    or attempt == 7
                ):
                    raise
                await asyncio.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    async def one_unit(
        stub: Any, unit: int, started: asyncio.Future[float], gate: asyncio.Semaphore
    ) -> None:
        nonlocal acked, registered
        reply = await register(stub, unit, gate)
        call = stub.Stream()
        await call.write(pb.WorkerMessage(hello=pb.Hello(session_id=reply.session_id)))
        registered += 1
        start = await started
        stop = start + warmup + seconds
        sent: dict[int, float] = {}
        logical = encoded[unit % len(encoded)]

        async def report(version: int, phase: int) -> None:
            nonlocal plans_committed
            try:
                await stub.ReportPlan(
                    pb.PlanReport(session_id=reply.session_id, version=version, phase=phase),
                    timeout=30,
                )
            except grpc.aio.AioRpcError:
                return  # a plan that timed out or aborted meanwhile: its report is refused
            if phase == pb.PLAN_PHASE_COMMITTED:
                plans_committed += 1

        async def reader() -> None:
            nonlocal acked
            async for msg in call:
                body = msg.WhichOneof("body")
                # Plan phases are answered at once, as a pod's sidecar whose ranks hold
                # spare rows would: the controller's plan work is measured, the weights'
                # moves are not (they are rank to rank, never through the controller).
                if body == "prepare":
                    reports.add(
                        asyncio.create_task(report(msg.prepare.version, pb.PLAN_PHASE_PREPARED))
                    )
                if body == "commit":
                    reports.add(
                        asyncio.create_task(report(msg.commit.version, pb.PLAN_PHASE_COMMITTED))
                    )
                if body != "window_ack":
                    continue
                now = time.monotonic()
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
        next_at = start + (unit % 97) / 97 * period  # spread the streams over a period
        seq = reply.next_window_seq
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if time.monotonic() >= stop:
                break
            sent[seq] = time.monotonic()
            await call.write(
                pb.WorkerMessage(window=pb.Window(seq=seq, num_steps=1, logical_count=logical))
            )
            seq += 1
            next_at += period
        await asyncio.sleep(drain)  # last acks (paced: up to the ack interval)
        await call.done_writing()
        task.cancel()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        started: asyncio.Future[float] = loop.create_future()
        async with grpc.aio.insecure_channel(address, options=client_options()) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            gate = asyncio.Semaphore(64)
            units_done = asyncio.gather(*(one_unit(stub, u, started, gate) for u in units))
            while registered < len(units):  # every stream open before the clock starts
                if units_done.done():
                    units_done.result()  # a registration failed: raise it
                await asyncio.sleep(0.05)
            ready.put(len(units))
            started.set_result(await loop.run_in_executor(None, go.get))
            await units_done

    try:
        asyncio.run(main())
    except Exception as exc:  # reported to the parent, which fails the run
        errors.append(f"{type(exc).__name__}: {exc}")
        ready.put(-1)
    out.put((acked, latencies, errors, plans_committed))


def run_load(
    address: str,
    server_pid: int,
    ranks: int,
    ranks_per_pod: int,
    rate: float,
    seconds: float,
    processes: int,
    windows: list[np.ndarray],
    warmup: float = 3.0,
    drain: float = 2.0,
    generator_nice: int = 0,
    pool_size: int = 0,
    metrics_port: int | None = None,
    scrape_seconds: float = 0.0,
) -> dict[str, Any]:
    """`metrics_port`: the controller's; windows are then counted as it folded them (else,
    the bare baseline, as acknowledged). `scrape_seconds`: scrape the whole exposition this
    often during the measured interval, as Prometheus would (0: never)."""
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    units = ranks // ranks_per_pod
    shards = [list(range(i, units, processes)) for i in range(processes)]
    gos = [ctx.Queue() for _ in shards]
    gens = [
        ctx.Process(
            target=_generator,
            args=(
                address,
                s,
                ranks_per_pod,
                rate,
                seconds,
                warmup,
                windows,
                drain,
                ready,
                go,
                out,
                generator_nice,
                pool_size,
                os.getpid(),
            ),
            daemon=True,
        )
        for s, go in zip(shards, gos, strict=True)
    ]
    try:
        for g in gens:
            g.start()
        for _ in gens:  # registration is not measured
            if ready.get(timeout=600) < 0:
                raise RuntimeError(f"a load generator failed: {out.get(timeout=10)[2]}")
        start = time.monotonic() + 0.5
        for go in gos:
            go.put(start)
        time.sleep(max(0.0, start + warmup - time.monotonic()))  # warm-up is not measured either
        load0 = load_average()
        kids = _children(server_pid)  # the decision worker
        gen_pids = [g.pid for g in gens if g.pid is not None]
        at0, scraped0 = read_counts(metrics_port) if metrics_port else (0.0, {})
        cpu0, kcpu0, gcpu0, t0 = (
            _cpu_seconds(server_pid),
            _cpu_of(kids),
            _cpu_of(gen_pids),
            time.monotonic(),
        )
        lcpu0 = _thread_cpu_seconds(server_pid, server_pid)  # the main thread: the event loop's
        end = start + warmup + seconds
        scrapes = full_scrapes(metrics_port, scrape_seconds, end) if scrape_seconds else []
        time.sleep(max(0.0, end - time.monotonic()))
        cpu1, kcpu1, gcpu1, t1 = (
            _cpu_seconds(server_pid),
            _cpu_of(kids),
            _cpu_of(gen_pids),
            time.monotonic(),
        )
        lcpu1 = _thread_cpu_seconds(server_pid, server_pid)
        at1, scraped1 = read_counts(metrics_port) if metrics_port else (0.0, {})
        load1 = load_average()
        results = [out.get(timeout=120) for _ in gens]
        for g in gens:
            g.join(30)
    finally:
        for g in gens:
            if g.is_alive():
                g.kill()
                g.join(5)
    errors = [e for _, _, es, _ in results for e in es]
    if errors:
        raise RuntimeError(f"load generator errors: {errors}")
    lat = np.array([x for _, ls, _, _ in results for x in ls]) * 1e3
    messages = sum(a for a, _, _, _ in results) / seconds
    nbytes = windows[0].size * 4
    wall = t1 - t0
    acked = messages * ranks_per_pod
    folded = (
        (scraped1[FOLDED] - scraped0[FOLDED]) / (at1 - at0) if FOLDED in scraped0 else float("nan")
    )
    # The busy seconds over the wall time between the two readings (a reading under load takes a
    # while).
    busy = (
        (scraped1[LOOP_BUSY] - scraped0[LOOP_BUSY]) / (at1 - at0)
        if LOOP_BUSY in scraped0
        else float("nan")
    )
    counted = acked if np.isnan(folded) else folded
    long, longest_ms = long_iterations(scraped0, scraped1)
    return {
        "ranks": ranks,
        "pods": units if ranks_per_pod > 1 else 0,
        "ranks_per_pod": ranks_per_pod,
        "streams": units,
        "offered_windows_per_second": ranks * rate,
        # Rank windows the controller folded during the measured interval (the baseline
        # folds nothing: acked there).
        "windows_per_second": counted,
        "counted_by": "acked" if np.isnan(folded) else "folded",
        "folded_share": counted / (ranks * rate),
        # sent in the interval and acknowledged, by the end of the drain
        "acked_windows_per_second": acked,
        "messages_per_second": counted / ranks_per_pod,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "controller_cpu_cores": (cpu1 - cpu0) / (t1 - t0),
        "cpu_us_per_rank_window": (cpu1 - cpu0) / (counted * wall) * 1e6
        if counted
        else float("nan"),
        # The event loop: share of wall time it ran callbacks (NaN: a server without the
        # metric), and the CPU its thread took (cores).
        "loop_busy_share": busy,
        # Iterations of the loop (callbacks between two waits) over LONG_ITERATION in the
        # interval, and the bucket bound the longest stayed within (ms).
        "loop_iterations_over_50ms": long,
        "loop_longest_iteration_ms_at_most": longest_ms,
        "loop_thread_cpu_cores": (lcpu1 - lcpu0) / wall,
        "decision_worker_cpu_cores": sum(kcpu1[p] - kcpu0[p] for p in kcpu1 if p in kcpu0)
        / (t1 - t0),
        # The load generators share this machine (2 cores here): what they took, and at
        # which niceness (0: the controller's own).
        "generator_cpu_cores": sum(gcpu1[p] - gcpu0[p] for p in gcpu1 if p in gcpu0) / (t1 - t0),
        "generator_nice": generator_nice,
        # Whole scrapes of the exposition during the interval (--scrape-seconds): how many,
        # the longest (seconds) and the size (bytes) of the last.
        "full_scrapes": len(scrapes),
        "full_scrape_seconds_max": max((t for t, _ in scrapes), default=float("nan")),
        "full_scrape_bytes": scrapes[-1][1] if scrapes else 0,
        "mb_per_second": counted / ranks_per_pod * nbytes / 1e6,
        # Plan commits reported by the sessions (group sessions report for their ranks);
        # counted over the whole run, warm-up included.
        "session_commits": sum(c for _, _, _, c in results),
        "pool_size": pool_size,
        "load_avg_start": load0,
        "load_avg_end": load1,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument(
        "--ranks-per-pod",
        type=int,
        default=1,
        help="1: every rank streams on its own (direct); K: one group stream per pod of K "
        "ranks, as pod sidecars speak (must divide 32)",
    )
    p.add_argument(
        "--rate", type=float, default=3.0, help="windows per second per rank (per pod with K > 1)"
    )
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument(
        "--warmup", type=float, default=3.0, help="seconds sent before the measured interval"
    )
    p.add_argument("--processes", type=int, default=2, help="load-generator processes")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument(
        "--generator-nice",
        type=int,
        default=0,
        metavar="N",
        help="run the load generators at this niceness (they stand for remote pods; "
        "here they share the controller's cores)",
    )
    p.add_argument(
        "--no-decisions",
        action="store_true",
        help="pause the controller's policy (ingest alone: no estimate-and-decide, no plans)",
    )
    p.add_argument(
        "--ack-interval",
        type=float,
        default=None,
        help="controller's ack_interval_seconds (0: one ack per window; default: the controller's)",
    )
    p.add_argument(
        "--decision-cpu-share",
        type=float,
        default=None,
        help="controller's decision_cpu_share (1: no limit; default: the controller's)",
    )
    p.add_argument(
        "--cpu-cores",
        type=float,
        default=None,
        help="controller's cpu_cores: the cores it and its decision worker share (0: no "
        "bound; default: the controller's)",
    )
    p.add_argument(
        "--pool-size",
        type=int,
        default=0,
        metavar="N",
        help="deployments per replica pool (0: no pools): one estimate and decision per pool",
    )
    p.add_argument(
        "--scrape-seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="scrape the controller's whole exposition every S seconds while measuring, as "
        "Prometheus would (0: only the bench's own narrow readings)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.ranks % RANKS_PER_DEPLOYMENT:
        print(f"--ranks must be a multiple of {RANKS_PER_DEPLOYMENT}", file=sys.stderr)
        return 2
    if not args.scrape_seconds >= 0:
        print("--scrape-seconds must be >= 0", file=sys.stderr)
        return 2
    if args.cpu_cores is not None and not 0 <= args.cpu_cores < float("inf"):
        print("--cpu-cores must be a finite number >= 0", file=sys.stderr)
        return 2
    if args.ranks_per_pod < 1 or RANKS_PER_DEPLOYMENT % args.ranks_per_pod:
        print(
            f"--ranks-per-pod must divide {RANKS_PER_DEPLOYMENT} "
            "(pods do not straddle deployments)",
            file=sys.stderr,
        )
        return 2

    from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3
    from rebalancer.launch.processes import bound_to_this_process, free_port

    counts = load_deepseek_v3(deepseek_v3_files()[0]) // 1000  # one window's worth, real skew
    windows = [counts] if args.ranks_per_pod == 1 else pod_windows(counts, args.ranks_per_pod)
    from rebalancer.controller.config import ControllerConfig

    ack_interval = (
        ControllerConfig.ack_interval_seconds if args.ack_interval is None else args.ack_interval
    )
    drain = ack_interval + 1.0
    load = {
        "ranks": args.ranks,
        "ranks_per_pod": args.ranks_per_pod,
        "rate": args.rate,
        "seconds": args.seconds,
        "processes": args.processes,
        "windows": windows,
        "warmup": args.warmup,
        "drain": drain,
        "generator_nice": args.generator_nice,
        "pool_size": args.pool_size,
    }

    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        port, metrics_port = free_port(), free_port()
        config = Path(tmp) / "c.toml"
        # Decisions run as in production (default period, in the decision worker); a plan
        # they start waits for ranks that never answer and times out, so this measures
        # ingest, estimate and decide together (--no-decisions: ingest alone).
        config.write_text(
            f'[server]\nhost = "127.0.0.1"\nack_interval_seconds = {ack_interval}\n'
            + (
                f"decision_cpu_share = {args.decision_cpu_share}\n"
                if args.decision_cpu_share is not None
                else ""
            )
            + (f"cpu_cores = {args.cpu_cores}\n" if args.cpu_cores is not None else "")
            + f"metrics_port = {metrics_port}\n"
            "[policy]\nmin_windows = 1\n" + ("paused = true\n" if args.no_decisions else "")
        )
        server = subprocess.Popen(  # dies with this bench, however it ends
            bound_to_this_process(
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
                    f"{tmp}/c.sqlite",
                    "--log-level",
                    "ERROR",
                ]
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None and "serving on" in server.stdout.readline()
            rows["controller"] = run_load(
                f"127.0.0.1:{port}",
                server.pid,
                **load,
                metrics_port=metrics_port,
                scrape_seconds=args.scrape_seconds,
            )
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
        if not args.no_baseline:
            ctx = mp.get_context("spawn")
            ready = ctx.Event()
            port = free_port()
            echo = ctx.Process(target=_echo_server, args=(port, ready, os.getpid()), daemon=True)
            echo.start()
            try:
                ready.wait(30)
                rows["bare_grpc_echo"] = run_load(f"127.0.0.1:{port}", echo.pid or 0, **load)
            finally:
                echo.terminate()
                echo.join(10)
                if echo.is_alive():
                    echo.kill()
                    echo.join(5)
    for name, r in rows.items():
        who = f"{r['pods']} pods of {r['ranks_per_pod']}" if r["pods"] else "direct"
        print(
            f"{name:16s} {r['ranks']} ranks ({who}): "
            f"{r['windows_per_second']:8.0f} rank windows/s of "
            f"{r['offered_windows_per_second']:.0f} offered "
            f"({r['folded_share']:.3f}, {r['counted_by']}; "
            f"{r['messages_per_second']:.0f} "
            f"messages/s), {r['cpu_us_per_rank_window']:.1f} us CPU a rank window, loop busy "
            f"{r['loop_busy_share']:.2f} (its thread {r['loop_thread_cpu_cores']:.2f} cores; "
            f"{r['loop_iterations_over_50ms']:.0f} iterations over 50 ms, the longest "
            f"<= {r['loop_longest_iteration_ms_at_most']:.0f} ms), "
            f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
            f"{r['controller_cpu_cores']:.2f} cores "
            f"(+{r['decision_worker_cpu_cores']:.2f} decision worker = "
            f"{r['controller_cpu_cores'] + r['decision_worker_cpu_cores']:.2f}; generators "
            f"{r['generator_cpu_cores']:.2f} at nice {r['generator_nice']}), "
            f"{r['mb_per_second']:.0f} MB/s, "
            f"load {r['load_avg_start'][0]:.2f} -> {r['load_avg_end'][0]:.2f}"
            + (
                f", {r['full_scrapes']} whole scrapes of {r['full_scrape_bytes'] / 1e6:.1f} MB, "
                f"the longest {r['full_scrape_seconds_max']:.2f} s"
                if r["full_scrapes"]
                else ""
            )
        )
    if args.record:
        record(args, rows)
    summary = dict(rows["controller"])
    summary["decisions"] = not args.no_decisions
    summary["ack_interval"] = ack_interval
    # (a tree before the setting has none: its decisions are not limited)
    summary["decision_cpu_share"] = (
        getattr(ControllerConfig, "decision_cpu_share", 1.0)
        if args.decision_cpu_share is None
        else args.decision_cpu_share
    )
    summary["cpu_cores"] = (
        getattr(ControllerConfig, "cpu_cores", 0.0) if args.cpu_cores is None else args.cpu_cores
    )
    summary["pool_size"] = args.pool_size
    if "bare_grpc_echo" in rows:
        summary["baseline"] = rows["bare_grpc_echo"]
    summary["machine"] = f"{os.cpu_count()} cores, {_cpu_model()}"
    summary["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.json:
        print(json.dumps(summary))
    return 0


def _cpu_model() -> str:
    return next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )


def record(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    path = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
    how = f"pods of {args.ranks_per_pod}" if args.ranks_per_pod > 1 else "direct"
    lines = [
        (
            f"\n### Ingest, {args.ranks} ranks ({how}) x {args.rate:g} windows/s "
            f"({time.strftime('%Y-%m-%d')})\n"
        ),
        f"`python -m bench.ingest --ranks {args.ranks} --ranks-per-pod {args.ranks_per_pod} "
        f"--rate {args.rate:g} "
        f"--seconds {args.seconds:g} --processes {args.processes}"
        f"{' --no-decisions' if args.no_decisions else ''} "
        f"--record` on {os.cpu_count()} cores "
        f"({_cpu_model()}), load generator on the same machine.\n",
        "| server | rank windows/s ingested | offered | messages/s | p50 ms | p99 ms "
        "| server CPU cores "
        "| decision worker cores | MB/s | load avg 1 min (start / end) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['windows_per_second']:.0f} | {r['offered_windows_per_second']:.0f} | "
            f"{r['messages_per_second']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['controller_cpu_cores']:.2f} | {r['decision_worker_cpu_cores']:.2f} | "
            f"{r['mb_per_second']:.0f} | "
            f"{r['load_avg_start'][0]:.2f} / {r['load_avg_end'][0]:.2f} |"
        )
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
