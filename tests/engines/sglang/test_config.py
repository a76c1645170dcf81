"""The adapter's settings and count folding, without SGLang."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.errors import InputError
from worker_hooks.engines.sglang.adapter import logical_counts
from worker_hooks.engines.sglang.config import SGLangAdapterConfig


def test_off_without_address_and_defaults_from_the_dataclass(tmp_path) -> None:
    assert SGLangAdapterConfig.from_env({}) is None
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    config = SGLangAdapterConfig.from_env({
        "REBALANCER_ADDRESS": "unix:/run/rebalancer.sock", "REBALANCER_TOKEN_FILE": str(token),
        "REBALANCER_WINDOW_STEPS": "8",
    })
    assert config is not None
    assert (config.token, config.window_steps) == ("s3cret", 8)
    assert config.agree_every == SGLangAdapterConfig.agree_every
    assert config.deployment == SGLangAdapterConfig.deployment


@pytest.mark.parametrize(("env", "message"), [
    ({"REBALANCER_WINDOW_STEPS": "x"}, "REBALANCER_WINDOW_STEPS='x' is not a int"),
    ({"REBALANCER_AGREE_EVERY": "0"}, "REBALANCER_AGREE_EVERY must be >= 1"),
    ({"REBALANCER_AGREE_TIMEOUT_SECONDS": "-1"}, "must be > 0"),
    ({"REBALANCER_TOKEN_FILE": "/nonexistent/token"}, "REBALANCER_TOKEN_FILE /nonexistent/token"),
])
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(InputError, match=message):
        SGLangAdapterConfig.from_env({"REBALANCER_ADDRESS": "127.0.0.1:1", **env})


def test_logical_counts_sum_replicas_per_layer() -> None:
    phy2log = np.array([[0, 1, 2, 0], [2, 2, 1, 0]])
    physical = np.array([[5, 1, 2, 3], [4, 6, 7, 0]])
    assert logical_counts(physical, phy2log, 3).tolist() == [[8, 1, 2], [0, 7, 10]]
