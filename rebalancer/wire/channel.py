"""gRPC channels: the options both ends must agree on, and client channels.

Servers (controller) and clients (worker agents, sidecars, the admin CLI) take their
message-size and keepalive settings from here, so neither side closes the other for a
ping it did not expect or refuses a message the other thought fine. Client channels are
opened from a `rebalancer.wire.link.Link` (address, TLS / mutual TLS, bearer token).
"""

from __future__ import annotations

import ipaddress
import re
import ssl
from pathlib import Path

import grpc

from rebalancer.errors import InputError
from rebalancer.wire.link import Link, TlsFlags
from rebalancer.wire.shards import shard_address

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


def unavailable_cause(config: Link, details: str, flags: TlsFlags = TlsFlags()) -> str:
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
        return (
            f"the server at {where} does not speak TLS: "
            f"leave out {flags.ca}, {flags.cert} and {flags.key}"
        )
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
            f"certificate {config.cert_file} (not signed by the CA it trusts for clients, or "
            "an extendedKeyUsage without clientAuth?)"
        )
    return ""


def read_file(path: str) -> bytes:
    """The bytes of `path`; InputError, one line, naming it if it cannot be read."""
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
    later, at every connection attempt (`notahost:xx`, a missing port). The address of
    controller shards (`{shard}` where the index goes, rebalancer.wire.shards) is checked
    as shard 0's."""
    target = shard_address(address, 0)
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


# Both client channels go to the controller shard that owns the link's deployment
# (Link.routed; the one address when there is one controller).


def sync_channel(link: Link) -> grpc.Channel:
    creds = link.credentials()
    address = link.routed().address
    if creds is None:
        return grpc.insecure_channel(address, options=client_options())
    return grpc.secure_channel(address, creds, options=client_options())


def aio_channel(link: Link) -> grpc.aio.Channel:
    creds = link.credentials()
    address = link.routed().address
    if creds is None:
        return grpc.aio.insecure_channel(address, options=client_options())
    return grpc.aio.secure_channel(address, creds, options=client_options())
