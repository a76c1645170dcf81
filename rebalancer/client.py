"""Channels to the controller: TLS / mutual TLS and bearer tokens, in one place.

Used by the admin CLI and by worker agents so both speak to the server with
the same keepalive and message-size settings (controller/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from rebalancer.controller.config import client_options
from rebalancer.errors import InputError


@dataclass(frozen=True)
class ChannelConfig:
    address: str
    ca_file: str | None = None      # server CA: TLS on when set
    cert_file: str | None = None    # client certificate (mutual TLS)
    key_file: str | None = None
    token: str | None = None        # bearer token sent as `authorization` metadata

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.ca_file:
            if self.cert_file or self.key_file:
                raise InputError("a client certificate needs --ca as well (TLS)")
            return None
        if bool(self.cert_file) != bool(self.key_file):
            raise InputError("mutual TLS needs both a client certificate and its key")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file) if self.key_file else None,
            certificate_chain=_read(self.cert_file) if self.cert_file else None,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def _read(path: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{path}: no such file")
    return p.read_bytes()


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
