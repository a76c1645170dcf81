"""gRPC channels: the options both ends must agree on, and client credentials.

Servers (controller) and clients (worker agents, the admin CLI) take their message-size
and keepalive settings from here, so neither side closes the other for a ping it did not
expect or refuses a message the other thought fine. Client channels carry TLS / mutual
TLS and a bearer token, built in one place.
"""

from __future__ import annotations

import ipaddress
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from rebalancer.errors import InputError

# A DeepSeek-V3 window is 58 x 256 int64 = 119 KB (+ 58 x 288 physical); 16 MiB
# leaves room for the largest models while refusing absurd messages early.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# Keepalive: clients ping every 20 s; the server permits pings that often even
# without calls in flight, so neither side closes the other with GOAWAY.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


# gRPC takes channel arguments as C ints: a larger limit is this one.
MAX_GRPC_INT = 2**31 - 1


def _shared_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """What both ends must agree on: message sizes and keepalive."""
    max_message_bytes = min(int(max_message_bytes), MAX_GRPC_INT)
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        *_shared_options(max_message_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        # gRPC sets SO_REUSEPORT by default: a second controller on the same port would then
        # bind too, and the kernel would share connections between the two. Off, so the
        # second bind fails and that controller is refused (one controller per port).
        ("grpc.so_reuseport", 0),
    ]


def client_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [*_shared_options(max_message_bytes), ("grpc.http2.max_pings_without_data", 0)]


@dataclass(frozen=True)
class ChannelConfig:
    address: str
    ca_file: str | None = None  # server CA: TLS on when set
    cert_file: str | None = None  # client certificate (mutual TLS)
    key_file: str | None = None
    token: str | None = None  # bearer token sent as `authorization` metadata

    def check(self) -> None:
        """The settings fit together (no file is read): InputError, one line, if not."""
        if not self.ca_file and (self.cert_file or self.key_file):
            raise InputError("a client certificate needs --ca as well (TLS)")
        if bool(self.cert_file) != bool(self.key_file):
            raise InputError("mutual TLS needs both a client certificate and its key")

    def credentials(self) -> grpc.ChannelCredentials | None:
        self.check()
        if not self.ca_file:
            return None
        root, key, chain = (
            _read(self.ca_file),
            _read(self.key_file) if self.key_file else None,
            _read(self.cert_file) if self.cert_file else None,
        )
        if self.cert_file and self.key_file:
            # gRPC would only fail the handshake, which reads as an unreachable controller.
            check_key_pair(self.cert_file, self.key_file, "client certificate", "client key")
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=chain
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


@dataclass(frozen=True)
class TlsFlags:
    """How a command names the channel's TLS files, for the hints below."""

    ca: str = "--ca"
    cert: str = "--cert"
    key: str = "--key"


def check_key_pair(cert_file: str, key_file: str, cert_what: str, key_what: str) -> None:
    """The private key in `key_file` is the key of the certificate in `cert_file`, checked with
    Python's own TLS (InputError, one line, naming both files as `cert_what` / `key_what` say):
    gRPC only fails the handshake, or the bind, without saying which file is wrong or why."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # A password-protected key would prompt on the terminal without `password`.
        context.load_cert_chain(cert_file, key_file, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or str(exc)
        if "MISMATCH" in str(reason).upper():
            raise InputError(
                f"{key_what} {key_file} is not the key of {cert_what} {cert_file}"
            ) from None
        raise InputError(
            f"{cert_what} {cert_file} and {key_what} {key_file}: not a usable PEM "
            f"certificate and private key ({reason})"
        ) from None


def unavailable_cause(config: ChannelConfig, details: str, flags: TlsFlags = TlsFlags()) -> str:
    """The likely cause of an UNAVAILABLE call, in words, from gRPC's details (which say
    "Socket closed" when the server ends a TLS handshake, or quote the TLS library);
    "" when the details name none of the causes known here."""
    tls = bool(config.ca_file)
    where = config.address
    if "Connection refused" in details:
        return f"nothing listens on {where} (is the controller running there?)"
    if "Failed parsing HTTP/2" in details:
        # An HTTP/1 server (the controller's or a sidecar's metrics port) answers gRPC's preface.
        return (
            f"the server at {where} answers HTTP, not gRPC: it is not the controller's gRPC port "
            "(is it the metrics port?)"
        )
    if "WRONG_VERSION_NUMBER" in details:
        return f"the server at {where} does not speak TLS: leave out {flags.ca}, {flags.cert} and {flags.key}"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return f"the server's certificate is not signed by the CA of {flags.ca} {config.ca_file}"
    if "Hostname Verification" in details or "Peer name" in details:
        return (
            f"the server's certificate does not name the host of {where}: connect by a name "
            "or address its subjectAltName lists"
        )
    if "Socket closed" in details:
        if not tls:
            return (
                f"the server at {where} closed the connection at once: it likely serves TLS "
                f"(give {flags.ca}, and {flags.cert} / {flags.key} for mutual TLS)"
            )
        if not config.cert_file:
            return (
                f"the server at {where} ended the TLS handshake: it likely asks for a client "
                f"certificate (mutual TLS): give {flags.cert} and {flags.key}"
            )
        return (
            f"the server at {where} ended the TLS handshake: it likely does not accept the client "
            f"certificate {config.cert_file} (not signed by the CA it trusts for clients?)"
        )
    return ""


def _read(path: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{path}: no such file")
    try:
        return p.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}") from None


# A host name (RFC 1123 labels) or an IPv4 address, then a port: what `host:port` allows.
_HOST = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$"
)


def check_address(address: str) -> None:
    """A controller's gRPC target: `host:port`, `[ipv6]:port`, `dns:[//authority/]host:port`
    or `unix:/absolute/path`. InputError (one line) for anything gRPC would only fail on
    later, at every connection attempt (`notahost:xx`, a missing port)."""
    target = address
    if target.startswith("unix:"):
        if not target[len("unix:") :].lstrip("/"):
            raise InputError(f"controller address {address!r}: a unix: target needs a path")
        return
    if target.startswith("dns:"):
        target = target[len("dns:") :]
        if target.startswith("//"):  # dns://authority/host:port, the authority may be empty
            target = target[2:].partition("/")[2]
    host, sep, port = target.rpartition(":")
    if not sep or not host:
        raise InputError(
            f"controller address {address!r} must be host:port (e.g. rebalancer:50051)"
        )
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise InputError(
            f"controller address {address!r}: port {port!r} is not a number from 1 to 65535"
        )
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise InputError(
                f"controller address {address!r}: {host} is not an IPv6 address"
            ) from None
    elif not _HOST.match(host):
        raise InputError(
            f"controller address {address!r}: {host!r} is not a host name or IP address"
        )


def sync_channel(config: ChannelConfig) -> grpc.Channel:
    creds = config.credentials()
    if creds is None:
        return grpc.insecure_channel(config.address, options=client_options())
    return grpc.secure_channel(config.address, creds, options=client_options())


def aio_channel(config: ChannelConfig) -> grpc.aio.Channel:
    creds = config.credentials()
    if creds is None:
        return grpc.aio.insecure_channel(config.address, options=client_options())
    return grpc.aio.secure_channel(config.address, creds, options=client_options())
