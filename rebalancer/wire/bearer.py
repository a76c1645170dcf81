"""Bearer tokens on gRPC calls: the one reading of `authorization: Bearer <token>` (what
`Link.metadata` sends), for whoever checks it: the controller's interceptor
(rebalancer/controller/auth.py) and a merging sidecar's leader (rebalancer/sidecar/ranks.py)."""

from __future__ import annotations

import hmac
from typing import Any


def bearer_token(metadata: Any) -> str | None:
    """The token of an `authorization: Bearer <token>` header, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, str) and value.startswith("Bearer "):
                return value[len("Bearer ") :]
            return None
    return None


def same_token(a: str, b: str) -> bool:
    """Whether two tokens are equal, compared in constant time."""
    return hmac.compare_digest(a.encode(), b.encode())
