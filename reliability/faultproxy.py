"""A loopback fault proxy for gRPC links (TCP or Unix socket), for the chaos harness.

Each `Link` listens where a client connects (a TCP port on 127.0.0.1, or a Unix socket
path) and forwards every connection to the real server (TCP `host:port` or a Unix socket),
byte for byte. Faults are set on a live link, from any thread:

- latency: every chunk is delivered `seconds` after it arrived (order kept);
- bandwidth: each direction paced to `bytes_per_second`;
- drop: every open connection is reset now (the client reconnects);
- half_open: open connections are reset, and new ones are accepted but never answered
  (nothing is read or forwarded) until the fault ends, when they are closed;
- blackhole: nothing moves on any connection, open or new, for the fault's length (a
  partition); what was sent meanwhile is delivered when it ends, as TCP retransmission
  would.

The proxy runs its own asyncio loop on a daemon thread, so the harness's polling never
slows it, and it starts no process. gRPC framing is never touched: every fault is one a
real network can produce.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

LinkFault = Literal["latency", "bandwidth", "drop", "half_open", "blackhole"]
LINK_FAULTS: tuple[LinkFault, ...] = ("latency", "bandwidth", "drop", "half_open", "blackhole")

_CHUNK = 64 * 1024


@dataclass
class LinkState:
    """What the link does to its bytes now (changed only on the proxy's loop)."""

    latency: float = 0.0  # seconds added to every chunk
    bytes_per_second: float = 0.0  # 0: unlimited
    half_open: bool = False  # new connections accepted, never answered
    moving: asyncio.Event = field(default_factory=asyncio.Event)  # cleared: blackhole


def _split(address: str) -> tuple[str, int] | str:
    """'unix:///path' or '/path' -> the path; 'host:port' -> (host, port)."""
    if address.startswith("unix://"):
        return address[len("unix://") :]
    if address.startswith("/"):
        return address
    host, port = address.rsplit(":", 1)
    return host, int(port)


class Link:
    """One proxied gRPC link: clients connect to `listen`, bytes go to `upstream`."""

    def __init__(
        self, name: str, listen: str, upstream: str, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.name = name
        self.upstream = upstream
        self._listen = listen
        self._loop = loop
        self.state = LinkState()
        self.state.moving.set()
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter | None]] = set()
        self._held: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections_total = 0

    @property
    def address(self) -> str:
        """Where clients connect: 'unix://path' or '127.0.0.1:port'."""
        where = _split(self._listen)
        if isinstance(where, str):
            return f"unix://{where}"
        assert isinstance(self._server, asyncio.Server)
        port = self._server.sockets[0].getsockname()[1]
        return f"{where[0]}:{port}"

    async def start(self) -> None:
        where = _split(self._listen)
        if isinstance(where, str):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(where)
            self._server = await asyncio.start_unix_server(self._accept, path=where)
        else:
            self._server = await asyncio.start_server(
                self._accept, where[0], where[1], reuse_address=True
            )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._reset_all()
        for w in list(self._held):
            w.close()
        self._held.clear()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        where = _split(self._listen)
        if isinstance(where, str):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(where)

    # ------------------------------------------------------------ faults (on the loop)

    def _reset_all(self) -> None:
        for client, server in list(self._conns):
            for w in (client, server):
                if w is None:
                    continue
                sock = w.get_extra_info("socket")
                if sock is not None and sock.family != socket.AF_UNIX:
                    # RST, not FIN: what a dropped connection looks like to the peer.
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                        )
                w.close()
        self._conns.clear()

    def _end_half_open(self) -> None:
        self.state.half_open = False
        for w in list(self._held):
            w.close()
        self._held.clear()

    # ------------------------------------------------------------ forwarding

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_total += 1
        if self.state.half_open:
            self._held.add(writer)  # accepted, never read, never answered
            return
        await self.state.moving.wait()  # a blackhole holds new connections too
        where = _split(self.upstream)
        try:
            if isinstance(where, str):
                up_r, up_w = await asyncio.open_unix_connection(where)
            else:
                up_r, up_w = await asyncio.open_connection(where[0], where[1])
        except OSError:
            writer.close()  # the server is down: the client sees a refused/closed link
            return
        pair = (writer, up_w)
        self._conns.add(pair)
        a = asyncio.ensure_future(self._pump(reader, up_w))
        b = asyncio.ensure_future(self._pump(up_r, writer))
        for t in (a, b):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        await asyncio.wait([a, b], return_when=asyncio.FIRST_COMPLETED)
        for w in pair:
            w.close()
        self._conns.discard(pair)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: chunks go through a queue so latency delays each by the same
        amount without serialising the delays."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                while data := await reader.read(_CHUNK):
                    await queue.put((time.monotonic(), data))
            except (OSError, asyncio.IncompleteReadError):
                pass
            await queue.put(None)

        reading = asyncio.ensure_future(read())
        try:
            while (item := await queue.get()) is not None:
                arrived, data = item
                await self.state.moving.wait()
                due = arrived + self.state.latency - time.monotonic()
                if due > 0:
                    await asyncio.sleep(due)
                if self.state.bytes_per_second > 0:
                    await asyncio.sleep(len(data) / self.state.bytes_per_second)
                await self.state.moving.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading


class FaultProxy:
    """Links on one asyncio loop in a daemon thread; faults are set from the caller's thread."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="faultproxy", daemon=True
        )
        self._thread.start()
        self.links: dict[str, Link] = {}
        self._timers: list[asyncio.TimerHandle] = []

    def _call(self, fn: Callable[[], object], timeout: float = 10.0) -> object:
        async def run() -> object:
            result = fn()
            if asyncio.iscoroutine(result):
                return await result
            return result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def add(self, name: str, listen: str, upstream: str) -> Link:
        link = Link(name, listen, upstream, self._loop)
        self._call(link.start)
        self.links[name] = link
        return link

    def remove(self, name: str) -> None:
        link = self.links.pop(name, None)
        if link is not None:
            self._call(link.close)

    def inject(self, name: str, fault: LinkFault, seconds: float, amount: float = 0.0) -> None:
        """Start `fault` on link `name` for `seconds` (drop: at once, `seconds` unused).
        `amount`: latency seconds, or bandwidth bytes/s."""
        link = self.links[name]

        def start() -> None:
            s = link.state
            if fault == "drop":
                link._reset_all()
                return
            if fault == "latency":
                s.latency = amount
                end: Callable[[], object] = functools.partial(setattr, s, "latency", 0.0)
            elif fault == "bandwidth":
                s.bytes_per_second = amount
                end = functools.partial(setattr, s, "bytes_per_second", 0.0)
            elif fault == "half_open":
                link._reset_all()
                s.half_open = True
                end = link._end_half_open
            elif fault == "blackhole":
                s.moving.clear()
                end = s.moving.set
            else:
                raise ValueError(f"unknown link fault {fault!r}")
            self._timers.append(self._loop.call_later(seconds, end))

        self._call(start)

    def heal(self) -> None:
        """End every fault on every link now."""

        def heal_all() -> None:
            for t in self._timers:
                t.cancel()
            self._timers.clear()
            for link in self.links.values():
                link.state.latency = 0.0
                link.state.bytes_per_second = 0.0
                link._end_half_open()
                link.state.moving.set()

        self._call(heal_all)

    def close(self) -> None:
        for name in list(self.links):
            with contextlib.suppress(Exception):
                self.remove(name)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
