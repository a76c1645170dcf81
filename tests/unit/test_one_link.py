"""One spelling of "how to reach the controller" (issue 31): `rebalancer.wire.link.Link`.

Every config that talks to the controller nests a `Link`; no other dataclass (nor a
Protocol standing for one) of `rebalancer` or `worker_hooks` defines the address, the
token or the TLS files again. The link's environment names are one table (`LINK_ENV`),
read alike by the engine adapters and the sidecar: the canonical names, the old ones with
a warning naming the new, an old and a new name that disagree refused in one line, a
blank value unset.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import warnings
from pathlib import Path

import pytest

from rebalancer.cli.sidecar_cmd import LINK_FLAGS, link_of
from rebalancer.errors import InputError
from rebalancer.wire.link import (
    ENV_TLS_NAMES,
    LINK_ENV,
    LINK_ENV_RENAMED,
    Link,
    link_from_env,
    link_settings,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rebalancer", "worker_hooks")
# The link's own fields: a dataclass naming one of them holds a second copy of the link
# (`controller` is what the address was called in some configs; `shards`, how many
# controller shards the address names).
LINK_FIELDS = {
    "address",
    "controller",
    "ca_file",
    "cert_file",
    "key_file",
    "token",
    "token_file",
    "shards",
}
HOME = ("rebalancer/wire/link.py", "Link")


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def _is_protocol(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(base).split(".")[-1] == "Protocol" for base in cls.bases)


def link_copies(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """`path: Class.field` for every field of LINK_FIELDS a dataclass (or a Protocol's
    member) of `packages` defines, but Link's own."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "_pb2" in path.name:
                continue
            for cls in ast.walk(ast.parse(path.read_text(), rel)):
                if not isinstance(cls, ast.ClassDef) or (rel, cls.name) == HOME:
                    continue
                dataclass, protocol = _is_dataclass(cls), _is_protocol(cls)
                if not (dataclass or protocol):
                    continue
                for node in cls.body:
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                        name = node.target.id
                    elif protocol and isinstance(node, ast.FunctionDef):
                        name = node.name
                    else:
                        continue
                    if name in LINK_FIELDS:
                        found.append(f"{rel}: {cls.name}.{name}")
    return found


def test_no_second_definition_of_the_link() -> None:
    """A config that talks to the controller nests `link: Link` instead of its own copy."""
    assert link_copies() == [], "nest a rebalancer.wire.link.Link instead"


def test_the_walk_finds_a_second_definition(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "configs.py").write_text(
        "from dataclasses import dataclass\nfrom typing import Protocol\n\n"
        "@dataclass(frozen=True)\nclass A:\n    controller: str\n    pool: str = ''\n\n"
        "class P(Protocol):\n    @property\n    def ca_file(self) -> str: ...\n\n"
        "class NotAConfig:\n    token: str\n"
    )
    assert link_copies(tmp_path, ("pkg",)) == [
        "pkg/configs.py: A.controller",
        "pkg/configs.py: P.ca_file",
    ]


def test_every_field_but_the_token_has_its_environment_name() -> None:
    """A secret travels as a file: the token itself has no variable, its file has."""
    fields = {f.name for f in dataclasses.fields(Link)}
    assert set(LINK_ENV) == fields - {"token"}
    assert all(name.startswith("REBALANCER_") for name in LINK_ENV.values())
    assert set(LINK_ENV_RENAMED.values()) <= set(LINK_ENV)
    assert not set(LINK_ENV_RENAMED) & set(LINK_ENV.values())
    assert (LINK_ENV["ca_file"], LINK_ENV["cert_file"], LINK_ENV["key_file"]) == (
        "REBALANCER_TLS_CA",
        "REBALANCER_TLS_CERT",
        "REBALANCER_TLS_KEY",
    )
    # Every field the sidecar takes from a flag falls back to its variable.
    assert set(LINK_FLAGS) <= set(LINK_ENV)


def test_the_canonical_names_are_read_without_a_warning() -> None:
    env = {name: f"value of {field}" for field, name in LINK_ENV.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert link_settings(env) == {field: f"value of {field}" for field in LINK_ENV}
        # The shard count is a number, and more than one needs {shard} in the address.
        env.update(REBALANCER_SHARDS="3", REBALANCER_ADDRESS="value of {shard}")
        link = link_from_env(env)
    assert link is not None and link.address == "value of {shard}" and link.token is None
    assert link.shards == 3


@pytest.mark.parametrize(("old", "field"), sorted(LINK_ENV_RENAMED.items()))
def test_an_old_name_is_read_with_a_warning_naming_the_new(old: str, field: str) -> None:
    new = LINK_ENV[field]
    with pytest.warns(FutureWarning, match=f"{old} is deprecated: .* set {new} instead"):
        assert link_settings({old: "/x"}) == {field: "/x"}
    with pytest.warns(FutureWarning, match=f"{old} is deprecated"):  # the same: taken, said
        assert link_settings({old: "/x", new: "/x"}) == {field: "/x"}


@pytest.mark.parametrize(("old", "field"), sorted(LINK_ENV_RENAMED.items()))
def test_an_old_and_a_new_name_that_disagree_are_refused_in_one_line(old: str, field: str) -> None:
    new = LINK_ENV[field]
    with pytest.raises(
        InputError, match=f"{old}='/a' and {new}='/b' set one setting twice"
    ) as info:
        link_settings({old: "/a", new: "/b"})
    assert "\n" not in str(info.value) and f"set {new} only" in str(info.value)


def test_a_blank_value_is_unset() -> None:
    blank = {name: " " for name in [*LINK_ENV.values(), *LINK_ENV_RENAMED]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a blank old name is not a use of it
        assert link_settings(blank) == {}
        assert link_from_env(blank) is None  # no address: the engine adapters stay off
        assert link_settings({**blank, "REBALANCER_TLS_CA": "/ca"}) == {"ca_file": "/ca"}


def test_the_tls_rule_is_one_and_names_what_the_user_set() -> None:
    cert_only = Link("c:1", cert_file="c", key_file="k")
    with pytest.raises(InputError, match=r"\(--cert and --key: mutual TLS\) needs --ca"):
        cert_only.check()
    with pytest.raises(
        InputError, match=r"\(REBALANCER_TLS_CERT and REBALANCER_TLS_KEY: mutual TLS\) needs"
    ):
        cert_only.check(ENV_TLS_NAMES)
    with pytest.raises(InputError, match=r"both a client certificate and its key \(--cert"):
        Link("c:1", ca_file="a", cert_file="c").check()
    Link("c:1", ca_file="a", cert_file="c", key_file="k").check()
    Link("c:1").check()


def _sidecar_args(**flags: str | None) -> argparse.Namespace:
    return argparse.Namespace(**{name: flags.get(name) for name in LINK_FLAGS})


def test_the_sidecar_and_the_engines_read_one_table(tmp_path: Path) -> None:
    """The same environment gives the sidecar and an engine adapter the same link (the
    engine reads the token file once; the sidecar at each connection)."""
    from worker_hooks.engines.sglang.config import SGLangAdapterConfig
    from worker_hooks.engines.vllm.config import VLLMAdapterConfig

    for name in ("ca", "cert", "key", "token"):
        (tmp_path / name).write_text(f"{name}\n")
    env = {
        "REBALANCER_ADDRESS": "rebalancer.ns.svc:50051",
        "REBALANCER_TLS_CA": str(tmp_path / "ca"),
        "REBALANCER_TLS_CERT": str(tmp_path / "cert"),
        "REBALANCER_TLS_KEY": str(tmp_path / "key"),
        "REBALANCER_TOKEN_FILE": str(tmp_path / "token"),
        "REBALANCER_DEPLOYMENT": "ds-v3",
        "REBALANCER_POOL": "fleet",
    }
    sidecar = link_of(_sidecar_args(), env)
    assert sidecar.token is None and sidecar.token_file == str(tmp_path / "token")
    for adapter in (SGLangAdapterConfig, VLLMAdapterConfig):
        config = adapter.from_env(env)
        assert config is not None
        assert config.link == dataclasses.replace(sidecar, token="token"), adapter.__name__
    # A flag given wins, even empty (off); an unset flag takes the variable.
    flagged = link_of(_sidecar_args(address="other:1", ca_file=""), env)
    assert (flagged.address, flagged.ca_file, flagged.pool) == ("other:1", None, "fleet")


def test_the_sidecar_reads_its_old_address_name_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="REBALANCER_CONTROLLER is deprecated"):
        link = link_of(_sidecar_args(), {"REBALANCER_CONTROLLER": "c:1"})
    assert link.address == "c:1"
