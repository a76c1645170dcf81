"""The fault kinds, registered by name: `FAULTS` is the one list the CLI's `--kinds`, the
campaign's schedule and its weights come from.

Each kind is one function `inject(harness, kind)` that starts the fault and returns once
it is over (the process restarted, the link healed, the store writable again). The order
of registration is the order of `ALL_KINDS`, and every random draw is made in the same
order as the campaign's seeds were recorded with: a seed injects the same faults."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from reliability.chaos.harness import Harness

Family = Literal["process", "link", "store", "node"]
Inject = Callable[["Harness", str], None]


@dataclass(frozen=True)
class Fault:
    name: str
    family: Family
    # Relative frequency after every kind has had its turn.
    weight: float
    inject: Inject


FAULTS: dict[str, Fault] = {}


def fault(family: Family, *names: str, weight: float = 1.0) -> Callable[[Inject], Inject]:
    """Register the decorated function as the fault kinds `names`."""

    def register(inject: Inject) -> Inject:
        for name in names:
            if name in FAULTS:
                raise ValueError(f"fault kind {name} registered twice")
            FAULTS[name] = Fault(name, family, weight, inject)
        return inject

    return register


def inject(h: Harness, kind: str) -> None:
    """Inject one fault of `kind` and return once it is over."""
    f = FAULTS[kind]
    if f.family != "link":  # a link fault counts itself: the storms start link faults too
        h.out.faults[kind] += 1
    f.inject(h, kind)


SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigstop": signal.SIGSTOP}


def signal_of(kind: str) -> signal.Signals:
    return SIGNALS[kind.partition("_")[0]]


# ---------------------------------------------------------------- processes
#
# A killed controller is restarted on the same store, a killed sidecar on the same
# socket; a killed worker takes its gloo group with it (a gloo group cannot lose a
# member), so the other ranks are killed and the deployment's G ranks start again.
# A killed worker restarts G torch processes, the slowest episode: it comes less often.


@fault("process", "sigkill_worker", "sigterm_worker", weight=0.35)
def kill_worker(h: Harness, kind: str) -> None:
    sig = signal_of(kind)
    group = h.procs.group
    assert group is not None
    rank = h.rng.randrange(h.cfg.workers)
    worker = group.procs[rank]
    h.say(f"{sig.name} rank {rank}: group {group.index} goes, the deployment's ranks restart")
    worker.send_signal(sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        worker.wait(5)
    h.restart_group()


@fault("process", "sigstop_worker")
def freeze_worker(h: Harness, kind: str) -> None:
    group = h.procs.group
    assert group is not None
    rank = h.rng.randrange(h.cfg.workers)
    # Its peers wait for it in the token exchange: the fault, not the rebalancer.
    freeze(h, group.procs[rank], f"rank {rank}", excuse=True)


@fault("process", "sigkill_sidecar", "sigterm_sidecar")
def kill_sidecar(h: Harness, kind: str) -> None:
    sig = signal_of(kind)
    pod = h.rng.randrange(h.cfg.pods)
    proc = h.procs.sidecars[pod]
    assert proc is not None
    h.say(f"{sig.name} sidecar {pod}")
    stop(h, proc, sig, f"sidecar {pod}", f"sidecar{pod}.log", 10.0)
    h.procs.start_sidecar(pod)
    h.out.sidecar_restarts += 1


@fault("process", "sigstop_sidecar")
def freeze_sidecar(h: Harness, kind: str) -> None:
    pod = h.rng.randrange(h.cfg.pods)
    freeze(h, h.procs.sidecars[pod], f"sidecar {pod}", excuse=False)


@fault("process", "sigkill_controller", "sigterm_controller")
def kill_controller_fault(h: Harness, kind: str) -> None:
    kill_controller(h, signal_of(kind))


@fault("process", "sigstop_controller")
def freeze_controller(h: Harness, kind: str) -> None:
    freeze(h, h.procs.controller, "controller", excuse=False)


def freeze(h: Harness, proc: subprocess.Popen[Any] | None, name: str, excuse: bool) -> None:
    """SIGSTOP for 0.2-2 s, then SIGCONT; `excuse`: the step gaps meanwhile are the fault's."""
    if proc is None or proc.poll() is not None:
        return
    seconds = h.rng.uniform(0.2, 2.0)
    h.say(f"SIGSTOP {name} for {seconds:.1f}s")
    start = time.time()
    proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        proc.send_signal(signal.SIGCONT)
    if excuse:
        h.out.excused.append((start, time.time() + 1.0))


def stop(
    h: Harness,
    proc: subprocess.Popen[Any],
    sig: signal.Signals,
    name: str,
    log: str,
    seconds: float,
) -> None:
    """Send `sig` and wait for the exit: still running after `seconds`, or a SIGTERM
    answered with a non-zero exit, is a finding (the process is killed either way)."""
    proc.send_signal(sig)
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        h.violation(f"{name} still running {seconds:g} s after {sig.name}")
        proc.kill()
        proc.wait()
    if sig == signal.SIGTERM and proc.returncode != 0:
        h.violation(f"{name} exited {proc.returncode} on SIGTERM: {h.procs.tail(log)}")


def kill_controller(h: Harness, sig: signal.Signals, torn_wal: bool = False) -> None:
    proc = h.procs.controller
    assert proc is not None
    start = time.monotonic()
    h.say(f"{sig.name} controller" + (", then a torn frame on its WAL" if torn_wal else ""))
    stop(h, proc, sig, "controller", "controller.log", 15.0)
    if torn_wal:
        tear_wal(h)
    h.restart_controller(start)


# ---------------------------------------------------------------- links
#
# Every gRPC link goes through the loopback fault proxy (reliability/faultproxy.py), which
# ends each fault after its length.


@fault("link", "latency", "bandwidth", "drop", "half_open", "blackhole", weight=2.0)
def link(h: Harness, kind: str) -> None:
    time.sleep(link_fault(h, kind))


def link_fault(h: Harness, kind: str, link: str | None = None) -> float:
    """Start a link fault (the proxy ends it); returns its length in seconds."""
    rng = h.rng
    link = link or rng.choice(sorted(h.proxy.links))
    seconds = 0.0 if kind == "drop" else rng.uniform(0.3, 2.0)
    # Both amounts are drawn for every kind (the order of draws the seeds were recorded with).
    amounts = {"latency": rng.uniform(0.05, 0.5), "bandwidth": rng.choice([2e3, 2e4, 2e5])}
    amount = amounts.get(kind, 0.0)
    h.say(
        f"{kind} on link {link}"
        + (f" for {seconds:.1f}s" if seconds else "")
        + (f" ({amount:g})" if amount else "")
    )
    h.proxy.inject(link, kind, seconds, amount)  # type: ignore[arg-type]
    h.out.faults[kind] += 1
    return seconds


# ---------------------------------------------------------------- the store
#
# Read-only and disk full use a tmpfs when run as root; otherwise a size limit on the
# controller's files (RLIMIT_FSIZE) and file modes.


@fault("store", "store_readonly")
def store_readonly(h: Harness, kind: str) -> None:
    """The store's file system read-only while the controller restarts on it: it must
    refuse with one line; then writable again, it starts."""
    proc = h.procs.controller
    assert proc is not None
    start = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    h.say("store read-only, controller restarted on it")
    if h.tmpfs:
        subprocess.run(
            ["mount", "-o", "remount,ro", str(h.store_dir)], check=True, capture_output=True
        )
    else:
        for p in h.store_dir.iterdir():
            p.chmod(0o444)
        h.store_dir.chmod(0o555)
    try:
        if h.procs.start_controller():
            # Started on a read-only store: that is only right if it stays correct (the
            # settle check), so note it.
            h.out.refused_starts.append("started read-only")
            h.procs.controller.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            h.procs.controller.wait()  # type: ignore[union-attr]
        else:
            line = (
                f"exit {h.procs.last_exit}: " + h.procs.tail("controller.log", 300).split(" | ")[-1]
            )
            h.out.refused_starts.append(line.replace(str(h.tmp), "$RUN"))
            h.say(f"refused: {line}")
    finally:
        if h.tmpfs:
            subprocess.run(
                ["mount", "-o", "remount,rw", str(h.store_dir)], check=True, capture_output=True
            )
        else:
            h.store_dir.chmod(0o755)
            for p in h.store_dir.iterdir():
                p.chmod(0o644)
    h.restart_controller(start)


@fault("store", "store_disk_full")
def store_disk_full(h: Harness, kind: str) -> None:
    """No space left for the store for a few seconds, under a live controller."""
    seconds = h.rng.uniform(1.0, 3.0)
    h.say(f"store disk full for {seconds:.1f}s")
    ballast = h.store_dir / "ballast"
    if h.tmpfs:
        with ballast.open("wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        time.sleep(seconds)
        ballast.unlink()
    else:
        import resource

        proc = h.procs.controller
        assert proc is not None
        used = sum(p.stat().st_size for p in h.store_dir.iterdir())
        old = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (used, old[1]))
        time.sleep(seconds)
        with contextlib.suppress(ProcessLookupError):
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, old)


@fault("store", "store_torn_wal")
def store_torn_wal(h: Harness, kind: str) -> None:
    """kill -9, then a partial frame appended to the write-ahead log, restart."""
    kill_controller(h, signal.SIGKILL, torn_wal=True)


def tear_wal(h: Harness) -> None:
    """A write cut short by the kill: a partial WAL frame (header + part of a page)."""
    wal = Path(f"{h.db}-wal")
    if not wal.exists():
        return
    size = wal.stat().st_size
    page = 4096
    frame = bytes(h.rng.getrandbits(8) for _ in range(24 + h.rng.randrange(1, page)))
    with wal.open("ab") as f:
        f.write(frame)
    h.say(f"WAL torn: {len(frame)} bytes of a partial frame after {size}")


# ---------------------------------------------------------------- the node


@fault("node", "cpu_starve")
def cpu_starve(h: Harness, kind: str) -> None:
    """The node's CPUs taken by other work for 2 s to `starve_seconds_max`: `starve_per_cpu`
    busy processes per CPU beside every process of the run (the harness's own too: the
    proxy's links slow down as well). Nothing is excused: the invariants must hold on a
    starved node."""
    seconds = h.rng.uniform(2.0, max(2.0, h.cfg.starve_seconds_max))
    n = h.cfg.starve_per_cpu * (os.cpu_count() or 1)
    h.say(f"CPU starved by {n} busy processes for {seconds:.1f}s")
    procs = h.procs.busy(n, "starve.log")
    try:
        time.sleep(seconds)
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def kinds_of(family: Family) -> tuple[str, ...]:
    return tuple(name for name, f in FAULTS.items() if f.family == family)


ALL_KINDS = tuple(FAULTS)
PROCESS_FAULTS = kinds_of("process")
LINK_FAULTS = kinds_of("link")
STORE_FAULTS = kinds_of("store")
NODE_FAULTS = kinds_of("node")
WEIGHTS = {name: f.weight for name, f in FAULTS.items()}
