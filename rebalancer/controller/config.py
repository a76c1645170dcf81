"""Controller settings, and the gRPC channel options both sides must agree on."""

from __future__ import annotations

from dataclasses import dataclass, field

from rebalancer.controller.decide import PolicyConfig

# A DeepSeek-V3 window is 58 x 256 int64 = 119 KB (+ 58 x 288 physical); 16 MiB
# leaves room for the largest models while refusing absurd messages early.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# Keepalive: clients ping every 20 s; the server permits pings that often even
# without calls in flight, so neither side closes the other with GOAWAY.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def client_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


@dataclass
class ControllerConfig:
    host: str = "127.0.0.1"
    port: int = 50051                # 0 picks a free port
    db_path: str = "rebalancer.sqlite"
    admin_token: str | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    tick_seconds: float = 0.2        # plan timeouts are checked this often
    grace_seconds: float = 5.0       # drain time on shutdown
    policy: PolicyConfig = field(default_factory=PolicyConfig)
