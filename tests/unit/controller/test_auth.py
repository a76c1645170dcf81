"""Bearer tokens: one parser, and the per-deployment check the services call (the
interceptor itself runs on real servers in tests/integration/test_security.py)."""

from __future__ import annotations

import pytest

from rebalancer.controller.auth import TokenAuth, bearer_token
from rebalancer.errors import StateError


@pytest.mark.parametrize(
    "metadata, token",
    [
        ((("authorization", "Bearer abc"),), "abc"),
        ((("x-other", "1"), ("authorization", "Bearer  two")), " two"),
        ((("authorization", "Basic abc"),), None),
        ((("authorization", "bearer abc"),), None),
        ((), None),
        (None, None),
    ],
)
def test_bearer_token(metadata: object, token: str | None) -> None:
    assert bearer_token(metadata) == token


def test_deployment_check_needs_a_token_of_that_deployment() -> None:
    TokenAuth().check_deployment("any")  # no worker tokens: no check
    auth = TokenAuth(worker_tokens={"prod": "p"})
    with pytest.raises(StateError) as info:
        auth.check_deployment("prod")  # outside a call the interceptor let through
    assert info.value.code == "PERMISSION_DENIED"
