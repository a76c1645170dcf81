"""Shards by pool (issue 32): one rule, rebalancer.wire.shards, decides which controller
shard owns a replica pool (or a deployment outside a pool), and every caller asks it:
the links of the engines and agents (every client channel routes through
`Link.routed`), the sidecar once its ranks named deployment and pool, the admin CLI's
fan-out, and the controller, which refuses a Register another shard owns. The rule is
stable (SHA-256, never Python's salted `hash`), spreads names evenly, and gives the same
answer wherever it is computed; the settings that feed it are refused in one line when
they cannot work.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rebalancer.cli import main as cli
from rebalancer.cli.admin_cmd import EXIT_CODES
from rebalancer.cli.sidecar_cmd import LINK_FLAGS, link_of
from rebalancer.controller.config import ControllerConfig, ShardConfig, load_config
from rebalancer.errors import InputError
from rebalancer.sidecar.config import SidecarConfig
from rebalancer.wire.channel import check_address
from rebalancer.wire.link import Link, link_from_env
from rebalancer.wire.shards import (
    MAX_SHARDS,
    check_shards,
    owner_key,
    owner_shard,
    parse_shards,
    shard_address,
    shard_of,
)

TEMPLATE = "rebalancer-{shard}.rebalancer.ns.svc.cluster.local:50051"
# (deployment, pool) pairs: members of pools, and deployments outside one.
OWNERS = [
    *((f"member-{i}", f"pool-{i % 7}") for i in range(40)),
    *((f"solo-{i}", "") for i in range(20)),
    ("deepseek-v3-prod", ""),
    ("m1", "fleet"),
    ("m2", "fleet"),
]


def test_the_rule_is_stable() -> None:
    """Fixed answers: a rule that changed would move every pool to another shard on upgrade
    (SHA-256 of the UTF-8 name, its first 8 bytes big-endian, modulo N)."""
    assert [shard_of("deepseek-v3-prod", n) for n in (2, 3, 4, 8)] == [0, 2, 0, 0]
    assert [shard_of("fleet", n) for n in (2, 3, 4, 8)] == [1, 0, 1, 5]
    assert [shard_of("solo", n) for n in (2, 3, 4, 8)] == [1, 1, 1, 1]
    assert all(shard_of(key, 1) == 0 for key in ("a", "b", ""))


def test_the_rule_is_the_same_in_another_process() -> None:
    """Python's str hash is salted per process; the rule is not."""
    names = [f"deployment-{i}" for i in range(50)]
    code = (
        "from rebalancer.wire.shards import shard_of\n"
        f"print(' '.join(str(shard_of(n, 5)) for n in {names!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [int(x) for x in out] == [shard_of(n, 5) for n in names]


@pytest.mark.parametrize("shards", [2, 3, 5, 8])
def test_the_rule_spreads_names_evenly(shards: int) -> None:
    counts = Counter(shard_of(f"deployment-{i}", shards) for i in range(6000))
    mean = 6000 / shards
    assert set(counts) == set(range(shards))
    assert all(abs(c - mean) < 0.1 * mean for c in counts.values()), counts


def test_a_pool_decides_for_its_members() -> None:
    assert owner_key("m1", "fleet") == "fleet" and owner_key("solo", "") == "solo"
    members = {owner_shard(f"member-{i}", "fleet", 3) for i in range(30)}
    assert members == {shard_of("fleet", 3)}, "a pool's members all land on one shard"
    # ... though the members' own names spread over every shard.
    assert {shard_of(f"member-{i}", 3) for i in range(30)} == {0, 1, 2}


def test_the_address_of_a_shard() -> None:
    assert shard_address(TEMPLATE, 2) == "rebalancer-2.rebalancer.ns.svc.cluster.local:50051"
    assert shard_address("rebalancer:50051", 2) == "rebalancer:50051"
    check_address(TEMPLATE)  # checked as shard 0's
    with pytest.raises(InputError, match=r"'rebalancer-\{shard\}:x'.*port 'x'"):
        check_address("rebalancer-{shard}:x")


def test_settings_that_cannot_work_are_refused_in_one_line() -> None:
    for bad in ("0", "-1", "x", "", str(MAX_SHARDS + 1), "2.5"):
        with pytest.raises(InputError, match="whole number from 1") as info:
            parse_shards(bad, "REBALANCER_SHARDS")
        assert "\n" not in str(info.value) and "REBALANCER_SHARDS" in str(info.value)
    assert parse_shards(" 3 ") == 3
    with pytest.raises(InputError, match=r"3 controller shards need \{shard\} in the address"):
        check_shards("rebalancer:50051", 3)
    check_shards("unix:///run/rebalancer/agent.sock", 3)  # the sidecar picks the shard
    check_shards("rebalancer:50051", 1)
    check_shards("rebalancer-{shard}:50051", 1)  # shard 0
    env = {"REBALANCER_ADDRESS": "rebalancer:50051", "REBALANCER_SHARDS": "3"}
    with pytest.raises(InputError, match=r"\{shard\} in the REBALANCER_ADDRESS"):
        link_from_env(env)
    with pytest.raises(InputError, match="REBALANCER_SHARDS 'three'"):
        link_from_env({**env, "REBALANCER_SHARDS": "three"})


def test_a_link_routes_to_the_owning_shard() -> None:
    link = Link(TEMPLATE, deployment="m1", pool="fleet", shards=3)
    routed = link.routed()
    owner = shard_of("fleet", 3)
    assert routed.address == shard_address(TEMPLATE, owner) and routed.shards == 1
    assert routed.routed() == routed
    assert link.routed(deployment="solo", pool="").address == shard_address(
        TEMPLATE, shard_of("solo", 3)
    )
    assert Link(TEMPLATE).routed().address == shard_address(TEMPLATE, 0)  # one shard: 0
    plain = Link("rebalancer:50051", deployment="m1", shards=3)
    assert plain.routed() is plain  # one server (a sidecar's socket, a merging leader)
    with pytest.raises(InputError, match="needs the deployment"):
        Link(TEMPLATE, shards=3).routed()
    assert [link.shard(i).address for i in range(3)] == [
        shard_address(TEMPLATE, i) for i in range(3)
    ]


def _sidecar_args(**flags: str | None) -> argparse.Namespace:
    return argparse.Namespace(**{name: flags.get(name) for name in LINK_FLAGS})


def _admin(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli(["admin", "--timeout", "2", *argv])
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_one_answer_in_the_sidecar_the_engines_the_cli_and_the_controller(
    tmp_path: Path,
) -> None:
    """For every pool and deployment, the shard is the same wherever it is computed: the
    sidecar (its link from the environment, or from --shards; routed by the names its
    ranks register with), an engine adapter reading the same environment, the admin CLI
    (force --pool goes to the pool's shard) and the controllers (exactly the owner takes
    the Register)."""
    from worker_hooks.engines.sglang.config import SGLangAdapterConfig

    env = {"REBALANCER_ADDRESS": TEMPLATE, "REBALANCER_SHARDS": "3"}
    sidecar = SidecarConfig(link=link_of(_sidecar_args(), env), ranks=(0, 1))
    flagged = link_of(_sidecar_args(address=TEMPLATE, shards="3"), {})
    assert sidecar.link.shards == flagged.shards == 3
    controllers = [ShardConfig(index=i, count=3) for i in range(3)]
    for deployment, pool in OWNERS:
        expected = shard_address(TEMPLATE, owner_shard(deployment, pool, 3))
        # The sidecar learns the names from its ranks (Upstream._target routes by them).
        assert sidecar.channel().routed(deployment, pool).address == expected
        assert flagged.routed(deployment, pool).address == expected
        engine = SGLangAdapterConfig.from_env(
            {**env, "REBALANCER_DEPLOYMENT": deployment, "REBALANCER_POOL": pool}
        )
        assert engine is not None and engine.link.routed().address == expected
        takers = [c.index for c in controllers if not c.refusal(deployment, pool)]
        assert takers == [owner_shard(deployment, pool, 3)]
        assert shard_address(TEMPLATE, takers[0]) == expected
    # The admin CLI: nothing listens on these sockets, so its one error line names the
    # shard it went to.
    template = f"unix://{tmp_path}/shard-{{shard}}.sock"
    for pool in sorted({pool for _, pool in OWNERS if pool}):
        code, out, err = _admin("--shards", "3", "--address", template, "force", "--pool", pool)
        owner = shard_of(pool, 3)
        assert code == EXIT_CODES["UNAVAILABLE"], err
        assert out == "" and err.count("\n") == 1
        assert f"shard {owner} ({shard_address(template, owner)}): UNAVAILABLE" in err


def test_the_controller_refuses_what_another_shard_owns() -> None:
    config = ShardConfig(index=0, count=3)
    member = next(f"m{i}" for i in range(100) if shard_of(f"m{i}", 3) == 0)
    pool = next(f"p{i}" for i in range(100) if shard_of(f"p{i}", 3) == 2)
    assert config.refusal(member, "") == ""
    why = config.refusal(member, pool)  # the pool decides, not the member's own name
    assert why.startswith(f"pool {pool!r} belongs to controller shard 2 of 3, this is shard 0")
    assert "\n" not in why
    assert ShardConfig().refusal(member, pool) == ""  # one shard owns everything


def test_the_shard_section_of_the_config(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[shard]\nindex = 2\ncount = 3\n")
    assert load_config(path).shard == ShardConfig(index=2, count=3)
    assert ControllerConfig().shard == ShardConfig(index=0, count=1)
    for text, error in (
        ("[shard]\nindex = 3\ncount = 3\n", "shard index must be a whole number from 0 to 2"),
        ("[shard]\ncount = 0\n", "shard count must be a whole number from 1"),
        ("[shard]\nindex = true\ncount = 2\n", "shard index"),
        ("[shard]\nordinal = 1\n", r"unknown \[shard\] key\(s\) \['ordinal'\]"),
    ):
        path.write_text(text)
        with pytest.raises(InputError, match=error):
            load_config(path)


def test_the_admin_cli_refuses_shard_settings_that_cannot_work() -> None:
    code, _, err = _admin("--shards", "3", "--address", "127.0.0.1:1", "status")
    assert code == 2 and re.search(r"need \{shard\} in the --address", err)
    assert err.count("\n") == 1
    code, _, err = _admin("--shards", "0", "status")
    assert code == 2 and "--shards '0'" in err


def test_every_shard_down_is_one_line_each_and_the_error_code(tmp_path: Path) -> None:
    template = f"unix://{tmp_path}/shard-{{shard}}.sock"
    code, out, err = _admin("--shards", "3", "--address", template, "status")
    lines = err.splitlines()
    assert code == EXIT_CODES["UNAVAILABLE"] and out == ""
    assert [line.split(": UNAVAILABLE")[0] for line in lines] == [
        f"rebalancer admin: error: shard {i} ({shard_address(template, i)})" for i in range(3)
    ]
