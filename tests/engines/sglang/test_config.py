"""The adapter's settings and count folding, without SGLang."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.errors import InputError
from rebalancer.wire.layout import logical_counts
from tests.engines.env_recorder import EnvRecorder
from worker_hooks.config import WindowConfig
from worker_hooks.engines.sglang.config import (
    DEFAULT_DEPLOYMENT,
    DEFAULT_STAGING_BUDGET_BYTES,
    SGLangAdapterConfig,
)
from worker_hooks.session.staging import layer_groups, ticket, ticket_parts


def test_off_without_address_and_defaults_from_the_dataclass(tmp_path) -> None:
    assert SGLangAdapterConfig.from_env({}) is None
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    config = SGLangAdapterConfig.from_env(
        {
            "REBALANCER_ADDRESS": "unix:/run/rebalancer.sock",
            "REBALANCER_TOKEN_FILE": str(token),
            "REBALANCER_WINDOW_STEPS": "8",
        }
    )
    assert config is not None
    assert (config.link.token, config.windows) == ("s3cret", WindowConfig(steps=8))
    assert config.agree_every == SGLangAdapterConfig.agree_every
    assert config.link.deployment == DEFAULT_DEPLOYMENT == "sglang"
    assert config.link.pool == ""
    pooled = SGLangAdapterConfig.from_env(
        {"REBALANCER_ADDRESS": "127.0.0.1:1", "REBALANCER_POOL": "ds-v3"}
    )
    assert pooled is not None and pooled.link.pool == "ds-v3"
    # auto by default (staged on gloo, SGLang's updater on NCCL); SGLang's own updater as a setting.
    assert (config.updater, config.staging_budget_bytes) == ("auto", DEFAULT_STAGING_BUDGET_BYTES)
    fallback = SGLangAdapterConfig.from_env(
        {
            "REBALANCER_ADDRESS": "127.0.0.1:1",
            "REBALANCER_UPDATER": "sglang",
            "REBALANCER_STAGING_BUDGET_BYTES": "1048576",
        }
    )
    assert fallback is not None and (fallback.updater, fallback.staging_budget_bytes) == (
        "sglang",
        1 << 20,
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"REBALANCER_WINDOW_STEPS": "x"}, "REBALANCER_WINDOW_STEPS='x' is not an integer"),
        ({"REBALANCER_AGREE_EVERY": "0"}, "REBALANCER_AGREE_EVERY must be >= 1"),
        ({"REBALANCER_AGREE_TIMEOUT_SECONDS": "-1"}, "must be > 0"),
        (
            {"REBALANCER_TOKEN_FILE": "/nonexistent/token"},
            "REBALANCER_TOKEN_FILE /nonexistent/token",
        ),
        (
            {"REBALANCER_UPDATER": "fast"},
            "REBALANCER_UPDATER must be one of auto, staged, sglang, got 'fast'",
        ),
        ({"REBALANCER_STAGING_BUDGET_BYTES": "0"}, "REBALANCER_STAGING_BUDGET_BYTES must be >= 1"),
        (
            {"REBALANCER_STAGING_BUDGET_BYTES": "4GiB"},
            "REBALANCER_STAGING_BUDGET_BYTES='4GiB' is not an integer",
        ),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(InputError, match=message):
        SGLangAdapterConfig.from_env({"REBALANCER_ADDRESS": "127.0.0.1:1", **env})


def test_logical_counts_sum_replicas_per_layer() -> None:
    phy2log = np.array([[0, 1, 2, 0], [2, 2, 1, 0]])
    physical = np.array([[5, 1, 2, 3], [4, 6, 7, 0]])
    assert logical_counts(physical, phy2log, 3).tolist() == [[8, 1, 2], [0, 7, 10]]


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        (
            {"TLS_CERT": "cert", "TLS_KEY": "key"},
            r"REBALANCER_TLS_CERT and REBALANCER_TLS_KEY: mutual TLS\) needs REBALANCER_TLS_CA",
        ),
        (
            {"TLS_CA": "ca", "TLS_CERT": "cert"},
            r"mutual TLS needs both .* \(REBALANCER_TLS_CERT and REBALANCER_TLS_KEY\)",
        ),
        ({"TLS_CA": "gone"}, "REBALANCER_TLS_CA .*gone: no such file"),
    ],
)
def test_tls_settings_that_cannot_connect_are_refused_at_start(
    tmp_path, tls: dict[str, str], message: str
) -> None:
    """Issue 20: cert and key without a CA were accepted, then killed the agent thread at
    its first connect, for good."""
    for name in ("ca", "cert", "key"):
        (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\n")
    env = {
        "REBALANCER_ADDRESS": "127.0.0.1:1",
        **{f"REBALANCER_{k}": str(tmp_path / v) for k, v in tls.items()},
    }
    with pytest.raises(InputError, match=message):
        SGLangAdapterConfig.from_env(env)


def test_the_plugin_stays_off_with_one_line_on_bad_tls(tmp_path, monkeypatch, caplog) -> None:
    """SGLang starts and serves with its own EPLB; the reason is one log line."""
    from worker_hooks.engines.sglang import plugin

    (tmp_path / "cert").write_text("x")
    (tmp_path / "key").write_text("x")
    monkeypatch.setenv("REBALANCER_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("REBALANCER_TLS_CERT", str(tmp_path / "cert"))
    monkeypatch.setenv("REBALANCER_TLS_KEY", str(tmp_path / "key"))
    for old in ("REBALANCER_CA_FILE", "REBALANCER_CERT_FILE", "REBALANCER_KEY_FILE"):
        monkeypatch.delenv(old, raising=False)
    monkeypatch.delenv("REBALANCER_TLS_CA", raising=False)
    monkeypatch.setattr(plugin, "_config", None)
    with caplog.at_level("INFO", logger="worker_hooks.engines.sglang"):
        plugin.register()  # SGLang is not imported: the plugin is off before that
    assert plugin._config is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "rebalancer plugin off: a client certificate (REBALANCER_TLS_CERT and "
        "REBALANCER_TLS_KEY: mutual TLS) needs REBALANCER_TLS_CA as well, the controller's CA "
        "(TLS)"
    ]


def test_layer_groups_fit_the_budget_on_every_rank_and_keep_layer_order() -> None:
    """2 ranks, experts of 10 bytes, budget 30: rank 1 gains 2 experts in layer 1, 2 in
    layer 2 (40 > 30: a new group), 1 in layer 4; a layer over the budget alone is a
    group of its own."""
    t = np.array(
        [
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 1],
            [1, 0, 0, 1, 0],
            [2, 1, 0, 0, 0],
            [2, 1, 1, 0, 1],
            [4, 1, 2, 0, 2],
            [5, 0, 0, 1, 0],
            [5, 0, 1, 1, 1],
            [5, 0, 2, 1, 2],
            [5, 0, 3, 1, 3],
        ]
    )
    assert layer_groups(t, [1, 2, 4, 5], 2, 10, 30) == [[1], [2, 4], [5]]
    assert layer_groups(t, [1, 2, 4, 5], 2, 10, 10**6) == [[1, 2, 4, 5]]
    assert layer_groups(t[:0], [], 2, 10, 30) == []


def test_tickets_order_every_swap_of_every_plan() -> None:
    """All ranks agree on MIN(ticket): a later group, a later plan, or SGLang's updater's
    plan (groups_done 0) after a staged one, is always a larger ticket."""
    assert ticket(3, 2) > ticket(3, 1) > ticket(2, 40) > ticket(2, 0)
    assert ticket_parts(ticket(7, 5)) == (7, 5)
    with pytest.raises(ValueError, match="groups_done"):
        ticket(1, 1 << 16)


def test_pool_and_warm_start_wait_from_env() -> None:
    config = SGLangAdapterConfig.from_env(
        {
            "REBALANCER_ADDRESS": "a:1",
            "REBALANCER_POOL": "ds-v3",
            "REBALANCER_WARM_START_SECONDS": "0.5",
        }
    )
    assert config is not None and (config.link.pool, config.warm_start_seconds) == ("ds-v3", 0.5)
    defaults = SGLangAdapterConfig.from_env({"REBALANCER_ADDRESS": "a:1"})
    assert defaults is not None and (defaults.link.pool, defaults.warm_start_seconds) == ("", 3.0)
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(
            InputError, match="REBALANCER_WARM_START_SECONDS must be >= 0 and finite"
        ):
            SGLangAdapterConfig.from_env(
                {"REBALANCER_ADDRESS": "a:1", "REBALANCER_WARM_START_SECONDS": bad}
            )


def test_updater_auto_stages_on_gloo_and_moves_between_passes_on_nccl() -> None:
    """Issue 29: staging runs NCCL p2p from a background thread beside SGLang's forward
    collectives. By default (auto) the weights move between passes with SGLang's updater
    where the adapter's weight group is NCCL (weights on GPU), staged where it is gloo;
    REBALANCER_UPDATER overrides, staged on NCCL with a warning. The backend is the one the
    adapter builds its weight group with (P2PTransport.group_backend of the weights' device)."""
    import torch

    from worker_hooks.engines.sglang.config import choose_updater
    from worker_hooks.transports.p2p import P2PTransport

    nccl = P2PTransport.group_backend(torch.device("cuda", 0))
    gloo = P2PTransport.group_backend(torch.device("cpu"))
    assert (nccl, gloo) == ("nccl", "gloo")
    config = SGLangAdapterConfig.from_env({"REBALANCER_ADDRESS": "127.0.0.1:1"})
    assert config is not None and config.updater == "auto"
    assert choose_updater(config.updater, nccl) == ("sglang", None)
    assert choose_updater(config.updater, gloo) == ("staged", None)
    updater, warning = choose_updater("staged", nccl)
    assert (
        updater == "staged"
        and warning is not None
        and "REBALANCER_UPDATER=staged on NCCL" in warning
    )
    assert choose_updater("staged", gloo) == ("staged", None)
    assert choose_updater("sglang", gloo) == ("sglang", None)
    assert choose_updater("sglang", nccl) == ("sglang", None)


def test_recorder_modes_without_counts_are_refused_with_the_setting_to_use() -> None:
    from worker_hooks.engines.sglang.config import recorder_refusal

    assert recorder_refusal("stat") is None and recorder_refusal("stat_approx") is None
    assert recorder_refusal(None) is None
    for mode in ("per_pass", "per_token"):
        reason = recorder_refusal(mode)
        assert reason is not None and f"--expert-distribution-recorder-mode is {mode}" in reason
        assert "use --expert-distribution-recorder-mode stat" in reason


def test_the_docs_sglang_section_lists_every_setting_of_the_default_path() -> None:
    """Every REBALANCER_* variable the adapter reads, SGLang's plugin allow-list and the
    flags the default path needs are in docs/operations.md's SGLang section."""
    from pathlib import Path

    env = EnvRecorder(REBALANCER_ADDRESS="127.0.0.1:1")
    assert SGLangAdapterConfig.from_env(env) is not None
    root = Path(__file__).resolve().parents[3]
    section = (
        (root / "docs" / "operations.md")
        .read_text()
        .split("### SGLang", 1)[1]
        .split("\n### ", 1)[0]
    )
    names = {n for n in env.read if n.startswith("REBALANCER_")}
    assert {"REBALANCER_ADDRESS", "REBALANCER_UPDATER", "REBALANCER_STAGING_BUDGET_BYTES"} <= names
    needed = names | {
        "SGLANG_PLUGINS",
        "--enable-eplb",
        "--ep-num-redundant-experts",
        "--expert-distribution-recorder-mode",
        "--ep-dispatch-algorithm",
    }
    assert {n for n in needed if f"`{n}`" not in section} == set()
