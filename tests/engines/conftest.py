"""The engine tests' zygotes (tests/engines/zygote.py) end with the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engines import zygote


@pytest.fixture(scope="session", autouse=True)
def zygotes_end_with_the_session() -> Iterator[None]:
    yield
    zygote.close_all()
