"""Fuzz the controller's TOML config (rebalancer.controller.config.load_config): random and
mutated documents, unknown keys, wrong types, out-of-range values, bad ports. Every
refusal must be an InputError of one line, and a config that loads must be usable.

The defects this found (sections that are not tables, paths that are not strings, files
that are not UTF-8 or are folders, deep nesting, [server] values of any type loaded as
is) were fixed in config.py while the campaign ran; they stay pinned below as regressions.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from rebalancer.controller.config import ControllerConfig, load_config
from rebalancer.controller.decide import PolicyConfig
from rebalancer.errors import InputError

SERVER_KEYS = [
    "host",
    "port",
    "db_path",
    "admin_token",
    "admin_token_file",
    "metrics_port",
    "max_message_bytes",
    "tick_seconds",
    "grace_seconds",
    "drain_seconds",
    "persist_seconds",
    "ack_interval_seconds",
    "insecure",
]
POLICY_KEYS = list(PolicyConfig.setting_names())
SECONDS = [
    "tick_seconds",
    "grace_seconds",
    "drain_seconds",
    "persist_seconds",
    "ack_interval_seconds",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("fuzz_config")


# ------------------------------------------------------------------ a small TOML writer

BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_key(key: str) -> str:
    return key if BARE.match(key) else json.dumps(key, ensure_ascii=False)


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def toml_doc(doc: dict[str, object]) -> str:
    """Top-level scalars first, then one [table] per dict value."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for name, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{toml_key(name)}]")
            lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def write(folder: Path, text: str | bytes) -> Path:
    path = folder / "controller.toml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


# ------------------------------------------------------------------ checks


def load_or_refuse(path: Path) -> ControllerConfig | None:
    try:
        config = load_config(path)
    except InputError as exc:
        assert str(exc) and "\n" not in str(exc).strip(), repr(str(exc))
        return None
    assert isinstance(config, ControllerConfig)
    for name in ("port", "metrics_port"):
        value = getattr(config, name)
        assert value is None or (isinstance(value, int) and 0 <= value < 65536)
    config.policy.validate()
    assert isinstance(config.worker_tokens, dict)
    assert all(isinstance(v, str) and v for v in config.worker_tokens.values())
    return config


def fully_valid(config: ControllerConfig) -> None:
    """What the server goes on to assume of a loaded config (types and ranges)."""
    assert isinstance(config.host, str) and config.host
    assert isinstance(config.db_path, str) and config.db_path
    for name in ("port", "metrics_port"):
        value = getattr(config, name)
        assert value is None or (type(value) is int and 0 <= value < 65536), (name, value)
    assert config.admin_token is None or (
        isinstance(config.admin_token, str) and config.admin_token
    )
    assert type(config.max_message_bytes) is int and config.max_message_bytes > 0
    for name in SECONDS:
        value = getattr(config, name)
        assert type(value) in (int, float) and math.isfinite(value) and value >= 0, (name, value)
    assert config.tick_seconds > 0
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        assert getattr(config, name) is None or isinstance(getattr(config, name), str)


# ------------------------------------------------------------------ strategies

text = st.text(st.characters(codec="utf-8", exclude_categories=["Cc", "Cs"]), max_size=8)
scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-1, 70000),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
)
values = st.one_of(
    scalars, st.lists(scalars, max_size=3), st.dictionaries(text, scalars, max_size=2)
)

good_server = st.fixed_dictionaries(
    {},
    optional={
        "host": st.sampled_from(["127.0.0.1", "0.0.0.0", "::", "localhost"]),
        "port": st.integers(0, 65535),
        "db_path": st.sampled_from(["r.sqlite", "/tmp/x.sqlite"]),
        "admin_token": st.text("abcdef0123", min_size=1, max_size=8),
        "metrics_port": st.integers(0, 65535),
        "max_message_bytes": st.integers(1, 2**31),
        "tick_seconds": st.floats(0.01, 10),
        "grace_seconds": st.floats(0, 60),
        "drain_seconds": st.floats(0, 60),
        "persist_seconds": st.floats(0, 60),
        "ack_interval_seconds": st.floats(0, 10),
    },
)
good_policy = st.fixed_dictionaries(
    {},
    optional={
        "gain_threshold": st.floats(0, 1),
        "decay": st.floats(0, 1),
        "min_windows": st.integers(0, 100),
        "max_moved_fraction": st.floats(0.01, 1),
        "horizon_seconds": st.floats(1, 1e4),
        "shrink": st.booleans(),
        "paused": st.booleans(),
        "estimate_window": st.integers(0, 10),
    },
)
good_tokens = st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True),
    st.text("xyz019", min_size=1, max_size=8),
    max_size=3,
)


@st.composite
def good_docs(draw: st.DrawFn) -> dict:
    doc: dict[str, object] = {}
    for name, strategy in (
        ("server", good_server),
        ("policy", good_policy),
        ("worker_tokens", good_tokens),
    ):
        if draw(st.booleans()):
            doc[name] = draw(strategy)
    return doc


@given(good_docs())
def test_valid_documents_load_as_written(folder: Path, doc: dict) -> None:
    config = load_config(write(folder, toml_doc(doc)))
    fully_valid(config)
    for key, value in doc.get("server", {}).items():
        assert getattr(config, key) == value
    for key, value in doc.get("policy", {}).items():
        assert config.policy.to_flat()[key] == value
    assert config.worker_tokens == doc.get("worker_tokens", {})


@st.composite
def fuzzed_docs(draw: st.DrawFn) -> dict:
    """A valid document with keys added, values replaced by any TOML value, unknown
    sections, or a section that is not a table."""
    doc = draw(good_docs())
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(["server", "policy", "worker_tokens", "tls", "bogus"]))
        if draw(st.integers(0, 9)) == 0:
            doc[section] = draw(scalars | st.lists(scalars, max_size=2))
            continue
        table = doc.setdefault(section, {})
        if not isinstance(table, dict):
            continue
        keys = {
            "server": SERVER_KEYS + ["bogus"],
            "policy": POLICY_KEYS + ["bogus"],
            "worker_tokens": ["dep", "a b", ""],
            "tls": ["cert", "key", "client_ca", "bogus"],
            "bogus": ["x"],
        }[section]
        table[draw(st.sampled_from(keys))] = draw(values)
    return doc


@given(fuzzed_docs())
@example(doc={"server": {"port": 65536}})
@example(doc={"server": {"metrics_port": -1}})
@example(doc={"policy": {"decay": float("nan")}})
@example(doc={"policy": {"min_windows": 1.5}})
@example(doc={"worker_tokens": {"dep": 5}})
@example(doc={"server": {"port": True}})  # loaded as port 1
@example(doc={"server": {"tick_seconds": -1.0}})  # loaded as is
@example(doc={"server": {"host": 5}})  # loaded as is
@example(doc={"server": {"max_message_bytes": -1}})  # loaded as is
@example(doc={"server": {"grace_seconds": float("inf")}})  # loaded as is
@example(doc={"server": 5})  # TypeError
@example(doc={"tls": {"cert": 5, "key": 5}})  # TypeError in Path(5)
@example(doc={"server": {"admin_token_file": 5}})  # TypeError in Path(5)
def test_fuzzed_documents_refused_or_loaded_valid(folder: Path, doc: dict) -> None:
    config = load_or_refuse(write(folder, toml_doc(doc)))
    if config is not None:
        fully_valid(config)


CRASHES = {
    "server-not-a-table": "server = 5\n",  # TypeError: 'int' object is not iterable
    "tls-not-a-table": "tls = 5\n",  # TypeError: 'int' object is not iterable
    "tokens-not-a-table": "worker_tokens = [1]\n",  # AttributeError
    "policy-not-a-table": "policy = [1]\n",  # TypeError in PolicyConfig(**values)
    "token-file-not-a-string": "[server]\nadmin_token_file = 5\n",  # TypeError: Path(5)
    "tls-cert-not-a-string": "[tls]\ncert = 5\nkey = 5\n",  # TypeError: Path(5)
    "deep-nesting": "x = " + "[" * 5000 + "]" * 5000 + "\n",  # RecursionError in tomllib
}


@pytest.mark.parametrize("case", sorted(CRASHES))
def test_crashes_fixed(folder: Path, case: str) -> None:
    load_or_refuse(write(folder, CRASHES[case]))


@pytest.mark.parametrize("case", ["latin-1", "directory"])  # UnicodeDecodeError, IsADirectoryError
def test_unreadable_file(folder: Path, case: str) -> None:
    if case == "directory":
        path = folder / "a-directory.toml"
        path.mkdir(exist_ok=True)
    else:
        path = write(folder, b'[server]\nhost = "h\xf6st"\n')
    load_or_refuse(path)


def test_admin_token_file_not_utf8(folder: Path) -> None:
    token = folder / "token"
    token.write_bytes(b"\xff\xfe")
    load_or_refuse(write(folder, f"[server]\nadmin_token_file = {json.dumps(str(token))}\n"))


@given(st.binary(max_size=200).filter(lambda b: b.isascii()))
def test_random_ascii_bytes(folder: Path, content: bytes) -> None:
    load_or_refuse(write(folder, content))


VALID = Path(__file__).resolve().parents[2] / "deploy" / "controller.toml"


@given(
    st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from(list(" =[]\"'#.,{}0123456789-+eaxntf\n"))),
        min_size=1,
        max_size=4,
    ),
    st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_mutated_shipped_config(
    folder: Path, edits: list[tuple[int, str]], cut: int | None
) -> None:
    text = list(VALID.read_text())
    for pos, char in edits:
        text[pos % len(text)] = char
    doc = "".join(text)
    if cut is not None:
        doc = doc[: cut % (len(doc) + 1)]
    config = load_or_refuse(write(folder, doc))
    if config is not None:
        fully_valid(config)
