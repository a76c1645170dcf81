"""Prometheus text exposition (format 0.0.4) of the fleet's series, and the HTTP server
that answers scrapes.

prometheus_client turns each sample into objects (a Sample, its label dict, validated
names, escaped values) before writing its line: at 2,048 DeepSeek-V3 deployments (about
100,000 series) a whole scrape took 0.8 s of one core in-process, and 6 s beside a busy
event loop, whose windows queued behind it for seconds (issue 32). A `Family` here is a
list of finished lines: one %-format a sample, label values escaped once per name.

Only the text format is served (Prometheus asks for OpenMetrics first and accepts this);
`name[]` restricts a scrape to the sample names given, as prometheus_client's handler does.
"""

from __future__ import annotations

import functools
import gzip
import logging
import socket
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import CancelledError
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import parse_qs, urlparse

from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Samples a `Labeled` writes between two steps of a scrape (about a millisecond).
STEP_SAMPLES = 1024

# What a scrape asks for: None for everything, else the sample names it wants
# (`rebalancer_plans_total`, `process_cpu_seconds_total`, ...).
Names = Collection[str] | None


@functools.lru_cache(maxsize=65536)
def label_value(value: str) -> str:
    """`value` escaped for a label (backslash, double quote, newline); names repeat across
    a scrape's families and scrapes, so each is escaped once."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")
    return value


def number(value: float) -> str:
    """A sample value written as prometheus_client writes it (Go's exponents from 1e+07 on;
    +Inf, -Inf, NaN), short values without its checks."""
    text = repr(float(value))
    if len(text) > 7 or text[-1] in "nf":  # 1e+07 and up, or inf, -inf, nan
        return floatToGoString(value)
    return text


class Family:
    """The lines of one metric family, added sample by sample.

    `kind` counter: the sample is `name_total`, as prometheus_client names it."""

    __slots__ = ("name", "kind", "help", "sample", "lines", "_order", "_line")

    def __init__(
        self,
        name: str,
        kind: Literal["counter", "gauge"],
        help: str,
        labels: tuple[str, ...] = (),
    ) -> None:
        self.name, self.kind, self.help = name, kind, help
        self.sample = f"{name}_total" if kind == "counter" else name
        self.lines: list[str] = []
        # Label names written sorted, as prometheus_client writes them (readers compare lines).
        order = sorted(range(len(labels)), key=labels.__getitem__)
        self._order = None if order == list(range(len(labels))) else order
        inner = ",".join(f'{labels[i]}="%s"' for i in order)
        self._line = f"{self.sample}{{{inner}}} %s\n" if labels else f"{self.sample} %s\n"

    def add(self, values: tuple[str, ...], value: float) -> None:
        """One sample: its label values in the order of `labels` (escaped here), its value."""
        if self._order is not None:
            values = tuple(values[i] for i in self._order)
        self.lines.append(self._line % (*map(label_value, values), number(value)))

    def wanted(self, names: Names) -> bool:
        return names is None or self.sample in names

    def text(self) -> str:
        escaped = self.help.replace("\\", r"\\").replace("\n", r"\n")
        # The text format names a family by its samples' name: a counter's ends in _total.
        head = f"# HELP {self.sample} {escaped}\n# TYPE {self.sample} {self.kind}\n"
        return head + "".join(self.lines)


def gauge(name: str, help: str, labels: tuple[str, ...] = ()) -> Family:
    return Family(name, "gauge", help, labels)


def counter(name: str, help: str, labels: tuple[str, ...] = ()) -> Family:
    return Family(name, "counter", help, labels)


class Labeled:
    """A counter or gauge by label values, changed where events happen (the event loop)
    and written out by a scrape on the same loop: a dict, no lock."""

    def __init__(
        self, name: str, kind: Literal["counter", "gauge"], help: str, labels: tuple[str, ...]
    ) -> None:
        self.name, self.kind, self.help, self.labels = name, kind, help, labels
        self.values: dict[tuple[str, ...], float] = {}

    def zero(self, *values: str) -> None:
        """The series from the start, at 0 (a counter's `rate()` sees its first event)."""
        self.values.setdefault(values, 0.0)

    def inc(self, *values: str, amount: float = 1.0) -> None:
        self.values[values] = self.values.get(values, 0.0) + amount

    def set(self, *values: str, value: float) -> None:
        self.values[values] = value

    def family(self, out: list[Family], names: Names) -> Iterator[None]:
        """Its family into `out`, written in steps (`write_in_steps`)."""
        family = Family(self.name, self.kind, self.help, self.labels)
        out.append(family)
        yield from write_in_steps(family, names, list(self.values.items()))


def write_in_steps(
    family: Family, names: Names, samples: Iterable[tuple[tuple[str, ...], float]]
) -> Iterator[None]:
    """`samples` (label values, value) into `family` if `names` wants it, a step every
    STEP_SAMPLES, so that a scrape on the event loop can let windows in between."""
    if not family.wanted(names):
        return
    for i, (values, value) in enumerate(samples, 1):
        family.add(values, value)
        if i % STEP_SAMPLES == 0:
            yield


def serve(
    host: str, port: int, scrape: Callable[[Names], bytes]
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Answer `GET` on `host:port` (any path) with `scrape(names)`, gzipped where the scraper
    accepts it, each request on a daemon thread; OSError if the port cannot be bound."""
    family, *_, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True  # a scrape in flight does not hold the controller's shutdown

    server = Server((str(address[0]), port), _handler(scrape))
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread


def _handler(scrape: Callable[[Names], bytes]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            query = parse_qs(urlparse(self.path).query)
            names = frozenset(query["name[]"]) if "name[]" in query else None
            try:
                body = scrape(names)
            # CancelledError: the loop stopped with the scrape handed to it (a shutdown).
            except (Exception, CancelledError) as exc:  # the controller serves on
                log.warning("metrics scrape failed: %s", exc or type(exc).__name__)
                self._reply(503, b"metrics unavailable: the scrape did not finish\n")
                return
            self._reply(200, body)

        def _reply(self, status: int, body: bytes) -> None:
            gzipped = "gzip" in self.headers.get("Accept-Encoding", "") and status == 200
            if gzipped:
                body = gzip.compress(body, compresslevel=1)
            self.send_response(status)
            self.send_header("Content-Type", CONTENT_TYPE)
            if gzipped:
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a scrape every 15 s is no news

    return Handler
