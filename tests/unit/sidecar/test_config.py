"""The sidecar's settings from flags and the pod's environment, and what it may import."""

from __future__ import annotations

import json
import subprocess
import sys
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

ROOT = Path(__file__).resolve().parents[3]


def test_ranks_from_flags() -> None:
    assert parse_ranks("0-7") == tuple(range(8))
    assert parse_ranks("8,9, 10") == (8, 9, 10)
    assert parse_ranks("0-1,4-5") == (0, 1, 4, 5)
    assert format_ranks((4, 5, 6, 7)) == "4-7" and format_ranks((0, 2)) == "0,2"
    for bad, words in (("7-0", "empty"), ("a", "not a rank"), ("0-3,3", "twice"), ("", "not a rank")):
        with pytest.raises(InputError, match=words):
            parse_ranks(bad)


def test_ranks_from_a_leaderworkerset() -> None:
    assert lws_ranks({"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}, 8) == tuple(range(16, 24))
    with pytest.raises(InputError, match="LWS_WORKER_INDEX is not set"):
        lws_ranks({"LWS_GROUP_SIZE": "4"}, 8)
    with pytest.raises(InputError, match="not in a group"):
        lws_ranks({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "2"}, 8)
    with pytest.raises(InputError, match="ranks-per-pod"):
        lws_ranks({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}, 0)


def test_pod_identity_from_the_downward_api() -> None:
    assert pod_identity({"POD_NAME": "vllm-0", "POD_NAMESPACE": "serving"}) == "serving/vllm-0"
    assert pod_identity({"POD_NAME": "vllm-0"}) == "vllm-0"


def test_listen_must_be_an_absolute_unix_socket() -> None:
    assert socket_path("unix:///run/rebalancer/agent.sock") == Path("/run/rebalancer/agent.sock")
    for bad in ("127.0.0.1:7000", "unix:relative.sock", "unix:///" + "x" * 120):
        with pytest.raises(InputError):
            socket_path(bad)


def test_config_is_checked_with_one_line_errors(tmp_path: Path) -> None:
    ok = SidecarConfig(controller="c:1", ranks=(0, 1))
    assert ok.modes == (0o750, 0o660) and ok.channel().token is None
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert SidecarConfig(controller="c:1", ranks=(0,), token_file=str(token)).channel().metadata() == (
        ("authorization", "Bearer s3cret"),)
    for kw, words in (
        (dict(controller=""), "controller"),
        (dict(ranks=()), "ranks"),
        (dict(ranks=(1, 1)), "distinct"),
        (dict(max_buffered_windows=0), "buffered"),
        (dict(token_file=str(tmp_path / "missing")), "no such file"),
        (dict(cert_file=str(token), key_file=str(token)), "needs --ca"),
        (dict(socket_access="world"), "socket access"),
    ):
        with pytest.raises(InputError, match=words):
            SidecarConfig(**{"controller": "c:1", "ranks": (0,), **kw})  # type: ignore[arg-type]


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
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "rebalancer.sidecar.daemon" in loaded
    leaked = [m for m in loaded if m.startswith(("torch", "worker_hooks", "rebalancer.controller",
                                                   "rebalancer.placement", "scipy"))]
    assert leaked == []
