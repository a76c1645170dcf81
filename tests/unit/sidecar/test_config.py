"""The sidecar's settings from flags and the pod's environment, and what it may import."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rebalancer.errors import InputError
from rebalancer.sidecar.config import (
    SidecarConfig,
    format_ranks,
    lws_ranks,
    parse_ranks,
    pod_identity,
    socket_path,
)
from rebalancer.wire.link import Link

ROOT = Path(__file__).resolve().parents[3]


def test_ranks_from_flags() -> None:
    assert parse_ranks("0-7") == tuple(range(8))
    assert parse_ranks("8,9, 10") == (8, 9, 10)
    assert parse_ranks("0-1,4-5") == (0, 1, 4, 5)
    assert format_ranks((4, 5, 6, 7)) == "4-7" and format_ranks((0, 2)) == "0,2"
    for bad, words in (
        ("7-0", "empty"),
        ("a", "not a rank"),
        ("0-3,3", "twice"),
        ("", "not a rank"),
        ("0-2048", "rank 2048 is out of range"),
        ("0-99999999999", "out of range"),
    ):
        with pytest.raises(InputError, match=words):
            parse_ranks(bad)
    assert parse_ranks("2040-2047")[-1] == 2047


def test_ranks_from_a_leaderworkerset() -> None:
    assert lws_ranks({"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}, 8) == tuple(range(16, 24))
    with pytest.raises(InputError, match="LWS_WORKER_INDEX is not set"):
        lws_ranks({"LWS_GROUP_SIZE": "4"}, 8)
    with pytest.raises(InputError, match="not in a group"):
        lws_ranks({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "2"}, 8)
    with pytest.raises(InputError, match="ranks-per-pod"):
        lws_ranks({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}, 0)
    with pytest.raises(InputError, match="at most 2048 ranks"):
        lws_ranks({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}, 10**12)


def test_pod_identity_from_the_downward_api() -> None:
    assert pod_identity({"POD_NAME": "vllm-0", "POD_NAMESPACE": "serving"}) == "serving/vllm-0"
    assert pod_identity({"POD_NAME": "vllm-0"}) == "vllm-0"


def test_listen_must_be_an_absolute_unix_socket() -> None:
    assert socket_path("unix:///run/rebalancer/agent.sock") == Path("/run/rebalancer/agent.sock")
    for bad in ("127.0.0.1:7000", "unix:relative.sock", "unix:///" + "x" * 120):
        with pytest.raises(InputError):
            socket_path(bad)


def test_config_is_checked_with_one_line_errors(tmp_path: Path) -> None:
    ok = SidecarConfig(link=Link("c:1"), ranks=(0, 1))
    assert ok.modes == (0o750, 0o660) and ok.channel().token is None
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert SidecarConfig(
        link=Link("c:1", token_file=str(token)), ranks=(0,)
    ).channel().metadata() == (("authorization", "Bearer s3cret"),)
    for kw, words in (
        (dict(link=Link("")), "controller"),
        (dict(ranks=()), "ranks"),
        (dict(ranks=(1, 1)), "distinct"),
        (dict(max_buffered_windows=0), "buffered"),
        (dict(link=Link("c:1", cert_file=str(token), key_file=str(token))), "needs --ca"),
        (
            dict(link=Link("c:1", ca_file=str(token), cert_file=str(token))),
            "both a client certificate and its key",
        ),
        (dict(socket_access="world"), "socket access"),
        (dict(link=Link("notahost:xx")), "port 'xx' is not a number"),
        (dict(link=Link("rebalancer")), "must be host:port"),
        (dict(link=Link("a b:50051")), "not a host name"),
        (dict(metrics_port=70000), "metrics port must be a port number"),
        (dict(metrics_port=-3), "metrics port must be a port number"),
    ):
        with pytest.raises(InputError, match=words):
            SidecarConfig(**{"link": Link("c:1"), "ranks": (0,), **kw})  # type: ignore[arg-type]


def test_credential_files_are_read_at_each_connection_not_at_start(tmp_path: Path) -> None:
    """A Secret not (yet) projected never stops the sidecar: the config is accepted, a
    missing token file gives no token (and says why), a missing certificate file is an
    error of the connection attempt, not of the start."""
    token = tmp_path / "token"
    config = SidecarConfig(
        link=Link("c:1", ca_file=str(tmp_path / "ca.crt"), token_file=str(token)), ranks=(0,)
    )
    assert config.token_missing() == f"{token}: no such file (worker token)"
    with pytest.raises(InputError, match="ca.crt: no such file"):
        config.channel()
    token.write_text("\n")
    assert "empty" in config.token_missing()
    token.write_text("s3cret\n")
    (tmp_path / "ca.crt").write_text("a CA")  # appears later: read at the next attempt
    channel = config.channel()
    assert config.token_missing() == "" and channel.metadata() == (
        ("authorization", "Bearer s3cret"),
    )
    bare = SidecarConfig(link=Link("c:1", token_file=str(tmp_path / "none")), ranks=(0,))
    assert bare.channel().metadata() == () and "no such file" in bare.token_missing()


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--controller", "notahost:xx", "--ranks", "0"], "port 'xx' is not a number"),
        (
            ["--controller", "c:1", "--ranks", "0-1", "--ranks-per-pod", "2"],
            "give --ranks or --ranks-per-pod, not both",
        ),
        # Issue 34: an OverflowError traceback, the socket blamed, "out of memory" after work.
        (
            ["--controller", "c:1", "--ranks", "0", "--metrics-port", "70000"],
            "metrics port must be a port number",
        ),
        (
            ["--controller", "c:1", "--ranks", "0", "--metrics-port", "-3"],
            "metrics port must be a port number",
        ),
        (["--controller", "c:1", "--ranks", "0-99999999999"], "rank 99999999999 is out of range"),
    ],
)
def test_sidecar_cli_refuses_bad_flags_with_one_line(
    argv: list[str], words: str, tmp_path: Path
) -> None:
    """Before anything is served or created: exit 2 and one line naming the flag."""
    folder = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rebalancer",
                "sidecar",
                "--listen",
                f"unix://{folder}/run/agent.sock",
                *argv,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"},
        )
        assert out.returncode == 2, out
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith("rebalancer sidecar: error: ") and words in line, line
        assert not (folder / "run").exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_sidecar_loads_no_torch_controller_or_placement() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "rebalancer" / "sidecar").rglob("*.py")
    ) + ["rebalancer.cli.sidecar_cmd"]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "rebalancer.sidecar.daemon" in loaded
    leaked = [
        m
        for m in loaded
        if m.startswith(
            ("torch", "worker_hooks", "rebalancer.controller", "rebalancer.placement", "scipy")
        )
    ]
    assert leaked == []


def test_operations_md_states_the_links_retry_timing() -> None:
    """Issue 34: docs/operations.md said the sidecar retries an unreachable controller
    at most every 2-3 s (and reads missing certificate files every 2 s); it does both
    every `backoff_max_seconds` (1 s, jittered 0.5-1.5x for the retries)."""
    text = (ROOT / "docs" / "operations.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    every = f"{SidecarConfig.backoff_max_seconds:g} s"
    unreachable = rows["the controller unreachable"]
    assert (
        f"from {SidecarConfig.backoff_initial_seconds:g} s to at most every {every}" in unreachable
        and "(0.5-1.5 s with jitter)" in unreachable
    ), unreachable
    assert (
        f"{0.5 * SidecarConfig.backoff_max_seconds:g}-{1.5 * SidecarConfig.backoff_max_seconds:g} s"
        in unreachable
    )
    credentials = rows["a certificate file (`--ca`, `--cert`, `--key`) missing or unreadable"]
    assert f"reads the files again every {every}" in credentials, credentials
