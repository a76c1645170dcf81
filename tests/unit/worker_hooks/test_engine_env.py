"""The engine adapters' `REBALANCER_*` settings refuse, at the adapter's start and in one
line naming the variable, what the sidecar refuses in its flags: a controller address
gRPC could only fail on at every connection (`notahost:xx`), and a window longer than
the wire's uint32 of steps (issue 34)."""

from __future__ import annotations

import pytest

from rebalancer.errors import InputError
from worker_hooks.engines.sglang.config import SGLangAdapterConfig
from worker_hooks.engines.vllm.config import VLLMAdapterConfig

ADAPTERS = [SGLangAdapterConfig, VLLMAdapterConfig]


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"REBALANCER_ADDRESS": "notahost:xx"},
            "REBALANCER_ADDRESS: controller address 'notahost:xx': port 'xx'",
        ),
        (
            {"REBALANCER_ADDRESS": "rebalancer"},
            "REBALANCER_ADDRESS: controller address 'rebalancer' must be host:port",
        ),
        (
            {
                "REBALANCER_ADDRESS": "unix:/run/rebalancer/agent.sock",
                "REBALANCER_WINDOW_STEPS": str(10**20),
            },
            "REBALANCER_WINDOW_STEPS='100000000000000000000' is out of range",
        ),
    ],
)
def test_settings_the_sidecar_refuses_are_refused(
    adapter, env: dict[str, str], message: str
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InputError, match=message) as info:
        adapter.from_env(env)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize(
    "address",
    [
        "unix:/run/rebalancer/agent.sock",
        "unix:///run/rebalancer/agent.sock",
        "rebalancer.serving:50051",
        "10.0.0.7:50051",
        "[::1]:50051",
    ],
)
def test_addresses_the_sidecar_takes_are_taken(adapter, address: str) -> None:  # type: ignore[no-untyped-def]
    config = adapter.from_env(
        {"REBALANCER_ADDRESS": address, "REBALANCER_WINDOW_STEPS": str(2**32 - 1)}
    )
    assert config is not None and config.link.address == address
    assert config.windows.steps == 2**32 - 1


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_the_sidecars_tls_names_mean_the_same_files(adapter, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """REBALANCER_TLS_CA/_CERT/_KEY, the sidecar's names, are the engines' too (one table:
    rebalancer.wire.link.LINK_ENV); the engines' old names still mean TLS, never plain
    text, and an old and a new name that disagree are refused in one line (issue 31)."""
    files = {}
    for name in ("ca", "cert", "key"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text("x")
    base = {"REBALANCER_ADDRESS": "controller:50051"}
    config = adapter.from_env(
        {
            **base,
            "REBALANCER_TLS_CA": str(files["ca"]),
            "REBALANCER_TLS_CERT": str(files["cert"]),
            "REBALANCER_TLS_KEY": str(files["key"]),
        }
    )
    assert (config.link.ca_file, config.link.cert_file, config.link.key_file) == (
        str(files["ca"]),
        str(files["cert"]),
        str(files["key"]),
    )
    with pytest.raises(
        InputError, match="REBALANCER_CA_FILE=.* and REBALANCER_TLS_CA=.* set one setting twice"
    ) as info:
        adapter.from_env(
            {
                **base,
                "REBALANCER_CA_FILE": str(files["ca"]),
                "REBALANCER_TLS_CA": str(files["cert"]),
            }
        )
    assert "\n" not in str(info.value)
