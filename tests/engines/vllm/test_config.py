"""The vLLM adapter without vLLM: importing it costs nothing, using it names the extra,
its settings are checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rebalancer.errors import InputError
from rebalancer.wire.link import Link
from tests.engines.env_recorder import EnvRecorder
from tests.engines.vllm import vllm_env
from worker_hooks.config import WindowConfig
from worker_hooks.engines.vllm.config import VLLMAdapterConfig


def test_import_without_vllm_and_register_names_the_extra() -> None:
    code = (
        "import sys, worker_hooks.engines.vllm as v\n"
        "assert 'vllm' not in sys.modules\n"
        "v.register()  # REBALANCER_ADDRESS unset: nothing to do, vLLM never imported\n"
        "assert 'vllm' not in sys.modules\n"
        "import os; os.environ['REBALANCER_ADDRESS'] = '127.0.0.1:1'\n"
        "try:\n"
        "    v.register()\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    env = {k: v for k, v in vllm_env.environment().items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(vllm_env.ROOT)
    env.pop("REBALANCER_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=vllm_env.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # The tested version appears where the package's metadata pins it
    # (tests/integration/test_wheel.py).
    assert out.stdout.startswith(
        "the vLLM adapter needs vLLM (vllm is not installed): install the "
        "moe-rebalancer wheel into vLLM"
    ), out.stdout
    assert out.stdout.strip().endswith('(docs/operations.md, "Engine images")'), out.stdout


def test_config_from_env() -> None:
    assert VLLMAdapterConfig.from_env({}) is None
    config = VLLMAdapterConfig.from_env(
        {
            "REBALANCER_ADDRESS": "unix:/s",
            "REBALANCER_WINDOW_STEPS": "8",
            "REBALANCER_COUNT_DUPLICATES": "4",
        }
    )
    assert config == VLLMAdapterConfig(
        Link("unix:/s", deployment="vllm"), windows=WindowConfig(steps=8), count_duplicates=4
    )
    with pytest.raises(InputError, match="REBALANCER_WINDOW_STEPS='x' is not an integer"):
        VLLMAdapterConfig.from_env({"REBALANCER_ADDRESS": "a:1", "REBALANCER_WINDOW_STEPS": "x"})
    with pytest.raises(InputError, match="COUNT_DUPLICATES must be >= 1"):
        VLLMAdapterConfig.from_env(
            {"REBALANCER_ADDRESS": "a:1", "REBALANCER_COUNT_DUPLICATES": "0"}
        )


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        (
            {"TLS_CERT": "cert", "TLS_KEY": "key"},
            r"REBALANCER_TLS_CERT and REBALANCER_TLS_KEY: mutual TLS\) needs REBALANCER_TLS_CA",
        ),
        (
            {"TLS_CA": "ca", "TLS_KEY": "key"},
            r"mutual TLS needs both .* \(REBALANCER_TLS_CERT and REBALANCER_TLS_KEY\)",
        ),
        ({"TLS_CA": "gone"}, "REBALANCER_TLS_CA .*gone: no such file"),
    ],
)
def test_tls_settings_that_cannot_connect_are_refused_at_start(
    tmp_path, tls: dict[str, str], message: str
) -> None:
    """The vLLM adapter took cert and key without a CA, which fails only at the agent's
    first connect; the check is the SGLang adapter's (worker_hooks/engines/env.py)."""
    for name in ("ca", "cert", "key"):
        (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\n")
    env = {
        "REBALANCER_ADDRESS": "127.0.0.1:1",
        **{f"REBALANCER_{k}": str(tmp_path / v) for k, v in tls.items()},
    }
    with pytest.raises(InputError, match=message):
        VLLMAdapterConfig.from_env(env)
    ok = {
        "REBALANCER_ADDRESS": "127.0.0.1:1",
        **{f"REBALANCER_TLS_{n.upper()}": str(tmp_path / n) for n in ("ca", "cert", "key")},
    }
    assert VLLMAdapterConfig.from_env(ok) is not None


def test_pool_and_warm_start_wait_from_env() -> None:
    config = VLLMAdapterConfig.from_env(
        {
            "REBALANCER_ADDRESS": "a:1",
            "REBALANCER_POOL": "ds-v3",
            "REBALANCER_WARM_START_SECONDS": "0.5",
        }
    )
    assert config is not None and (config.link.pool, config.warm_start_seconds) == ("ds-v3", 0.5)
    defaults = VLLMAdapterConfig.from_env({"REBALANCER_ADDRESS": "a:1"})
    assert defaults is not None and (defaults.link.pool, defaults.warm_start_seconds) == ("", 3.0)
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(
            InputError, match="REBALANCER_WARM_START_SECONDS must be >= 0 and finite"
        ):
            VLLMAdapterConfig.from_env(
                {"REBALANCER_ADDRESS": "a:1", "REBALANCER_WARM_START_SECONDS": bad}
            )


def test_the_docs_vllm_section_lists_every_setting_of_the_default_path() -> None:
    """Every REBALANCER_* variable the adapter reads, vLLM's plugin allow-list and the
    flags the default path needs are in docs/operations.md's vLLM section."""
    env = EnvRecorder(REBALANCER_ADDRESS="127.0.0.1:1")
    assert VLLMAdapterConfig.from_env(env) is not None
    section = (
        (vllm_env.ROOT / "docs" / "operations.md")
        .read_text()
        .split("### vLLM", 1)[1]
        .split("\n## ", 1)[0]
    )
    names = {n for n in env.read if n.startswith("REBALANCER_")}
    assert {"REBALANCER_ADDRESS", "REBALANCER_WINDOW_STEPS"} <= names
    needed = names | {
        "VLLM_PLUGINS",
        "VLLM_USE_V2_MODEL_RUNNER",
        "--enable-eplb",
        "--worker-extension-cls",
        "worker_hooks.engines.vllm.RebalancerWorkerExtension",
    }
    assert {n for n in needed if f"`{n}`" not in section} == set()
