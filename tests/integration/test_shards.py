"""Shards by pool (issue 32), with real processes: three `rebalancer serve` shards (one
store each, `--shard i --shards 3`), ranks that reach them through the rule (real worker
agents whose link names every shard, `REBALANCER_SHARDS=3`), one member behind a real
`rebalancer sidecar` that picks its shard the same way, and the fan-out admin CLI.

Shown: each pool's members all land on the pool's shard (the members' own names would
spread over all three), a Register sent to another shard is refused in one line naming
the owner and changes nothing; `force --pool` through the fan-out reaches the pool's
shard only, `force DEP` the shard holding the deployment; a shard killed and restarted
affects its pools only (the others keep folding windows, their ranks and sidecar never
reconnect, their status is unchanged) and its own come back; while it is down the
fan-out CLI prints one stderr line for it, the other shards' answers, and exits 8.
Every process is reaped, whatever happens.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import grpc
import numpy as np
import pytest

from rebalancer.cli import main as cli
from rebalancer.cli.admin_cmd import EXIT_CODES, EXIT_SHARD_DOWN
from rebalancer.launch.instant import SHAPE, E, G, InstantRank, L
from rebalancer.launch.processes import bound_to_this_process, reap
from rebalancer.sidecar.listen import probe
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import client_options
from rebalancer.wire.link import Link
from rebalancer.wire.shape import shape_msg
from rebalancer.wire.shards import owner_shard, shard_address, shard_of
from worker_hooks.agent import AgentConfig, WorkerAgent

pytestmark = pytest.mark.slow

N = 3


def wait_for(check: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def shard_template() -> str:
    """`127.0.0.1:PPPP{shard}`: three free ports that differ in their last digit, so the
    address names every shard as a StatefulSet's DNS names do."""
    rng = random.Random()
    for _ in range(200):
        prefix = rng.randint(2000, 6000)
        if all(_free(int(f"{prefix}{i}")) for i in range(N)):
            return f"127.0.0.1:{prefix}{{shard}}"
    raise AssertionError("no three free ports")


def names_on(shard: int, prefix: str, count: int, avoid: int | None = None) -> list[str]:
    """`count` names of `prefix`-i that the rule gives shard `shard` (`avoid`: names whose
    own shard is not that one, for members that must follow their pool, not their name)."""
    out = []
    for i in range(1000):
        name = f"{prefix}{i}"
        if shard_of(name, N) == shard if avoid is None else shard_of(name, N) != avoid:
            out.append(name)
            if len(out) == count:
                return out
    raise AssertionError("no such names")


def ready_line(proc: subprocess.Popen[str], shard: int, log: Path) -> str:
    """The line a started shard prints once it serves, which names its place (within 60 s;
    else the shard's log tail in the failure)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    assert f"shard {shard} of {N}" in line, (line, log.read_text()[-2000:])
    return line


class ShardRank(InstantRank):
    """An instant rank whose link names every shard: its agent reaches the owner."""

    def __init__(self, rank: int, link: Link) -> None:
        self.version = 0
        self.agent = WorkerAgent(AgentConfig(link, rank, SHAPE), self, lambda: self.version)


class Member:
    """A deployment of G instant ranks (straight to the shards, or to a sidecar's socket)."""

    def __init__(self, name: str, pool: str, link: Link) -> None:
        self.name, self.pool = name, pool
        self.ranks = [ShardRank(r, link) for r in range(G)]
        self.seq = 0

    def send(self, rng: np.random.Generator) -> None:
        profile = (1 + np.arange(E)) / np.sum(1 + np.arange(E))  # skewed: a placement pays
        logical = rng.multinomial(4000, profile, size=L)
        for r in self.ranks:
            r.agent.submit_window(self.seq * 4, 4, r.version, logical, None)
        self.seq += 1


class Cluster:
    """Three controller shards, the members and a sidecar; `close` reaps them all."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.template = shard_template()
        self.config = tmp / "controller.toml"
        # Plans here are forced only: the policy never finds a gain worth it.
        self.config.write_text(
            '[server]\nhost = "127.0.0.1"\n\n[policy]\nmin_windows = 1\ngain_threshold = 1.0\n'
        )
        self.shards: list[subprocess.Popen[str] | None] = [None] * N
        self.metrics_ports: list[int] = [0] * N
        self.sidecar: subprocess.Popen[str] | None = None
        self.sockets = Path(tempfile.mkdtemp(prefix="sh", dir="/tmp"))  # short socket paths
        self.members: list[Member] = []
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send, name="windows", daemon=True)

    def address(self, shard: int) -> str:
        return shard_address(self.template, shard)

    def start_shard(self, shard: int) -> None:
        """`rebalancer serve --shard i --shards 3` on its own port and store."""
        port = self.address(shard).rsplit(":", 1)[1]
        with (self.tmp / f"shard{shard}.log").open("a") as log:
            proc = subprocess.Popen(
                bound_to_this_process(
                    [
                        sys.executable,
                        "-m",
                        "rebalancer",
                        "serve",
                        "--config",
                        str(self.config),
                        "--port",
                        port,
                        "--db",
                        str(self.tmp / f"shard{shard}.sqlite"),
                        "--shard",
                        str(shard),
                        "--shards",
                        str(N),
                        "--metrics-port",
                        "0",
                        "--log-level",
                        "WARNING",
                    ]
                ),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self.shards[shard] = proc
        line = ready_line(proc, shard, self.tmp / f"shard{shard}.log")
        self.metrics_ports[shard] = int(line.split("metrics on :")[1].split(",")[0])

    def kill_shard(self, shard: int) -> None:
        proc = self.shards[shard]
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def member(self, name: str, pool: str) -> Member:
        """A deployment whose ranks dial the shards straight (REBALANCER_SHARDS=3)."""
        m = Member(name, pool, Link(self.template, deployment=name, pool=pool, shards=N))
        self.members.append(m)
        return m

    def member_behind_sidecar(self, name: str, pool: str) -> Member:
        """A deployment whose ranks talk to a `rebalancer sidecar`, which picks the shard."""
        target = f"unix://{self.sockets}/{name}.sock"
        with (self.tmp / "sidecar.log").open("a") as log:
            self.sidecar = subprocess.Popen(
                bound_to_this_process(
                    [
                        sys.executable,
                        "-m",
                        "rebalancer",
                        "sidecar",
                        "--listen",
                        target,
                        "--ranks",
                        f"0-{G - 1}",
                        "--pod",
                        f"ns/{name}",
                        "--grace",
                        "1",
                        "--log-level",
                        "INFO",
                    ]
                ),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                # The variables the sidecar component sets in Kubernetes.
                env={
                    **os.environ,
                    "REBALANCER_ADDRESS": self.template,
                    "REBALANCER_SHARDS": str(N),
                    "REBALANCER_POOL": pool,
                },
            )
        assert self.sidecar.stdout is not None
        assert "sidecar serving on" in self.sidecar.stdout.readline()
        self.socket = target
        m = Member(name, pool, Link(target, deployment=name, pool=pool))
        self.members.append(m)
        return m

    def start_members(self) -> None:
        for m in self.members:
            for r in m.ranks:
                r.agent.start()
        self._sender.start()

    def _send(self) -> None:
        rng = np.random.default_rng(7)
        while not self._stop.wait(0.3):
            for m in self.members:
                m.send(rng)

    def close(self) -> None:
        self._stop.set()
        if self._sender.is_alive():
            self._sender.join(10)
        for m in self.members:
            for r in m.ranks:
                r.agent.stop()
        procs = [p for p in [self.sidecar, *self.shards] if p is not None]
        try:
            reap(procs, terminate=True, seconds=10.0)
        finally:
            for p in procs:
                if p.stdout is not None:
                    p.stdout.close()
            shutil.rmtree(self.sockets, ignore_errors=True)


def status(address: str) -> pb.StatusResponse:
    with grpc.insecure_channel(address, options=client_options()) as channel:
        return pb_grpc.AdminServiceStub(channel).Status(pb.StatusRequest(), timeout=10)


def admin(cluster: Cluster, *args: str) -> tuple[int, str, str]:
    """The admin CLI across the three shards, as an operator runs it."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["admin", "--shards", str(N), "--address", cluster.template, "--timeout", "5", *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def deployments(reply: pb.StatusResponse) -> dict[str, Any]:
    return {d.deployment: d for d in reply.deployments}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_three_shards_by_pool(cluster: Cluster) -> None:
    # One pool on each shard; its members named so that their own names would land on
    # another shard: only the pool decides. A deployment outside any pool on its own.
    pools = [names_on(s, "pool-", 1)[0] for s in range(N)]
    members = {
        pool: names_on(s, f"{pool}-m", 2, avoid=s) for s, pool in enumerate(pools)
    }  # shard -> pool -> two members
    solo = names_on(2, "solo-", 1)[0]
    for s in range(N):
        cluster.start_shard(s)
    for s, pool in enumerate(pools):
        first, second = members[pool]
        cluster.member(first, pool)
        if s == 1:  # the second member of shard 1's pool through a real sidecar
            cluster.member_behind_sidecar(second, pool)
        else:
            cluster.member(second, pool)
    cluster.member(solo, "")
    cluster.start_members()
    expected = {
        s: {*members[pools[s]], *([solo] if shard_of(solo, N) == s else [])} for s in range(N)
    }

    def every_member_folding() -> bool:
        for s in range(N):
            deps = deployments(status(cluster.address(s)))
            if set(deps) != expected[s]:
                return False
            if any(d.connected_ranks < G or d.windows_folded < 2 for d in deps.values()):
                return False
        return True

    wait_for(every_member_folding, 60, "every deployment registered and folding on its shard")

    # -- each shard tells its place in its metrics (a dashboard's shard selector).
    for s in range(N):
        with urlopen(f"http://127.0.0.1:{cluster.metrics_ports[s]}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert f'rebalancer_shard_info{{shard="{s}",shards="{N}"}} 1.0' in text, s
        assert f"rebalancer_shards {float(N)}" in text, s

    # -- a pool's members all on one shard: the fan-out status says where each one is.
    code, out, err = admin(cluster, "--json", "status")
    assert code == 0, err
    by_shard = {e["shard"]: e for e in json.loads(out)["shards"]}
    assert sorted(by_shard) == list(range(N))
    for s, pool in enumerate(pools):
        entry = by_shard[s]
        assert entry["address"] == cluster.address(s)
        assert [p["pool"] for p in entry["status"]["pools"]] == [pool]
        (p,) = entry["status"]["pools"]
        assert sorted(p["members"]) == sorted(members[pool])
        assert {d["deployment"] for d in entry["status"]["deployments"]} == expected[s]
        for member in members[pool]:
            assert shard_of(member, N) != s  # its own name would have gone elsewhere
    code, text, err = admin(cluster, "status")
    assert code == 0 and err == ""
    for s, pool in enumerate(pools):
        block = text.split(f"shard {s} ({cluster.address(s)}):\n", 1)[1]
        assert block.startswith(f"  pool {pool}: placement 0, 2 members"), block

    # -- a Register another shard owns: refused in one line naming the owner, nothing made.
    owner, other = 0, 1
    with grpc.insecure_channel(cluster.address(other), options=client_options()) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.WorkerServiceStub(channel).Register(
                pb.RegisterRequest(
                    deployment="intruder", rank=0, shape=shape_msg(SHAPE), pool=pools[owner]
                ),
                timeout=10,
            )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details()
    assert details.startswith(
        f"pool {pools[owner]!r} belongs to controller shard {owner} of {N}, this is shard {other}"
    )
    assert "\n" not in details
    assert "intruder" not in deployments(status(cluster.address(other)))

    # -- force through the fan-out: the pool's shard rolls it out, no other shard moves.
    target = 1
    code, out, err = admin(cluster, "--json", "force", "--pool", pools[target])
    assert code == 0, err
    assert json.loads(out)["outcome"] == "forced" and json.loads(out)["pool"] == pools[target]

    def rolled() -> bool:
        (p,) = status(cluster.address(target)).pools
        return p.pool_version >= 1 and p.members_at_target == 2 and p.members_moving == 0

    wait_for(rolled, 60, f"pool {pools[target]} rolled out to both members (one via the sidecar)")
    for s in range(N):
        reply = status(cluster.address(s))
        versions = {d.deployment: d.placement_version for d in reply.deployments}
        if s == target:
            assert all(v >= 1 for v in versions.values()), versions
        else:
            assert all(v == 0 for k, v in versions.items() if k != solo), (s, versions)
            assert all(p.pool_version == 0 for p in reply.pools)
    # A deployment's force goes to the shard that holds it.
    code, out, err = admin(cluster, "force", solo)
    assert code == 0 and "plan v1 started" in out, (out, err)
    wait_for(
        lambda: deployments(status(cluster.address(2)))[solo].placement_version == 1,
        30,
        f"{solo}'s plan committed on shard 2",
    )
    code, out, err = admin(cluster, "history", solo)
    assert code == 0 and err == "", err
    assert out.startswith(f"shard 2 ({cluster.address(2)}):\n  plans:\n")
    assert " v1 from v0 " in out and "shard 0" not in out and "shard 1" not in out

    # -- a shard's restart affects its own pools only.
    down = 0
    before = {s: deployments(status(cluster.address(s))) for s in range(N) if s != down}
    reconnects = {
        m.name: [r.agent.reconnects for r in m.ranks]
        for m in cluster.members
        if m.pool != pools[down]
    }
    cluster.kill_shard(down)
    code, out, err = admin(cluster, "status")
    assert code == EXIT_SHARD_DOWN, (code, out, err)
    (line,) = err.splitlines()  # one line for the shard that is down
    assert line.startswith(
        f"rebalancer admin: error: shard {down} ({cluster.address(down)}): UNAVAILABLE"
    )
    assert f"shard {down} (" not in out
    for s in range(N):
        if s != down:  # the others' answers, still printed
            assert f"shard {s} ({cluster.address(s)}):\n  pool {pools[s]}:" in out
    code, out, err = admin(cluster, "--json", "status")
    assert code == EXIT_SHARD_DOWN and len(err.splitlines()) == 1
    entries = {e["shard"]: e for e in json.loads(out)["shards"]}
    assert entries[down]["error"].startswith("UNAVAILABLE: ")
    assert all("status" in entries[s] for s in range(N) if s != down)
    code, out, err = admin(cluster, "history", solo)  # on shard 2: answered, shard 0 said
    assert code == EXIT_SHARD_DOWN and len(err.splitlines()) == 1 and f"shard {down} (" in err
    assert out.startswith(f"shard 2 ({cluster.address(2)}):\n  plans:\n")
    code, _, err = admin(cluster, "force", "--pool", pools[down])  # its owner is down
    assert code == EXIT_CODES["UNAVAILABLE"] and err.count("\n") == 1
    assert f"shard {down} ({cluster.address(down)}): UNAVAILABLE" in err
    # The other shards keep folding, their ranks and the sidecar stay connected.
    time.sleep(2.0)
    for s, deps in before.items():
        now = deployments(status(cluster.address(s)))
        for name, d in deps.items():
            assert now[name].connected_ranks == G, (s, name)
            assert now[name].placement_version == d.placement_version, (s, name)
            assert now[name].plans_aborted == d.plans_aborted, (s, name)
            assert now[name].windows_folded > d.windows_folded, (s, name, "stopped folding")
    ok, seen = probe(cluster.socket, timeout=5)
    assert ok and "controller link: connected" in seen, seen
    cluster.start_shard(down)  # the same store

    def back() -> bool:
        deps = deployments(status(cluster.address(down)))
        return set(deps) == expected[down] and all(
            d.connected_ranks == G and d.windows_ingested > 0 for d in deps.values()
        )

    wait_for(back, 60, f"shard {down}'s pool members back on it")
    assert {
        m.name: [r.agent.reconnects for r in m.ranks]
        for m in cluster.members
        if m.pool != pools[down]
    } == reconnects, "a member of another shard reconnected"
    code, out, err = admin(cluster, "status")
    assert code == 0 and err == "" and all(f"shard {s} (" in out for s in range(N))
    assert owner_shard(members[pools[down]][0], pools[down], N) == down
