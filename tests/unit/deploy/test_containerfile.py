"""Containerfile and .dockerignore, read: hadolint passes, and the properties the manifests
rely on hold: a pinned base, no frontend pulled, multi-stage, every package installed from
the hashed lock (deploy/image), no torch, the non-root UID the manifests run as, nothing
written at run time, `rebalancer` as the entrypoint, and a build context that holds what
the wheel and the lock need and none of the clutter (no bench, no tests). The image itself
is built and run in tests/integration/test_image.py."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy.conftest import BASE, COMPONENTS, ROOT, documents
from tests.unit.deploy.image_lock import BUILD_LOCK, RUNTIME_LOCK

CONTAINERFILE = ROOT / "Containerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def instructions(path: Path | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of `path` (the controller's Containerfile by default), with
    continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (path or CONTAINERFILE).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        word, _, rest = pending.partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, "a continuation line runs off the end"
    return out


def stages(path: Path | None = None) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for word, rest in instructions(path):
        if word == "FROM":
            out.append([])
        if out:
            out[-1].append((word, rest))
    return out


def test_hadolint(hadolint: str) -> None:
    result = subprocess.run(
        [hadolint, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_on_a_pinned_base() -> None:
    args = dict(
        rest.split("=", 1) for word, rest in instructions() if word == "ARG" and "=" in rest
    )
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", base), base
    froms = [rest for word, rest in instructions() if word == "FROM"]
    assert len(froms) >= 2, "a build stage and a runtime stage"
    for rest in froms:
        assert rest.split()[0] == "${PYTHON_IMAGE}", (
            f"every stage starts from the pinned base: {rest}"
        )
    assert froms[0].endswith("AS build") and froms[-1].endswith("AS runtime")


def test_no_parser_directive_pulls_a_frontend() -> None:
    """A `# syntax=` line makes BuildKit pull a frontend image: a build that cannot pull
    (air-gapped, or the test here) fails on it."""
    for line in CONTAINERFILE.read_text().splitlines():
        assert not re.match(r"#\s*syntax\s*=", line.strip(), re.IGNORECASE), line


def test_installs_only_the_lock_and_no_torch() -> None:
    build, runtime = stages()[0], stages()[-1]
    runs = " ".join(rest for word, rest in build if word == "RUN")
    runtime_lock = RUNTIME_LOCK.name
    assert f"--require-hashes -r {runtime_lock}" in " ".join(runs.split()), (
        "the venv installs the hashed lock"
    )
    assert f"--require-hashes -r {BUILD_LOCK.name}" in " ".join(runs.split()), "the build tools too"
    commands = [c for word, rest in build if word == "RUN" for c in rest.split("&&")]
    for command in commands:
        if " install " in command and " -r " in command:
            assert "--no-deps" not in command, (
                f"--no-deps lets an unlocked dependency pass: {command}"
            )
    for word, rest in build + runtime:
        if word == "RUN" and "pip" in rest:
            assert "torch" not in rest.replace("find_spec('torch')", ""), rest
            assert not re.search(r"\.\[|\w\[\w", rest), f"no extras: {rest}"
    assert "find_spec('torch') is not None" in runs, "the build fails if torch got in"
    # The runtime stage installs nothing itself: it takes the venv from the build stage.
    assert not any(word == "RUN" and "pip" in rest for word, rest in runtime)
    copies = [rest for word, rest in runtime if word == "COPY"]
    assert copies == ["--from=build /opt/rebalancer /opt/rebalancer"], copies
    env = " ".join(rest for word, rest in runtime if word == "ENV")
    assert "PATH=/opt/rebalancer/bin:" in env, "`rebalancer` (the manifests' command) is on PATH"


def test_runs_as_the_manifests_user_on_a_read_only_root() -> None:
    runtime = stages()[-1]
    (user,) = [rest for word, rest in runtime if word == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so that runAsNonRoot can check it"
    (deployment,) = documents(BASE / "deployment.yaml")
    pod_sc = deployment["spec"]["template"]["spec"]["securityContext"]
    assert (int(uid), int(gid)) == (pod_sc["runAsUser"], pod_sc["runAsGroup"])
    (patch,) = documents(COMPONENTS / "sidecar" / "pod-patch.yaml")
    (sidecar,) = patch["spec"]["initContainers"]
    assert (int(uid), int(gid)) == (
        sidecar["securityContext"]["runAsUser"],
        sidecar["securityContext"]["runAsGroup"],
    )
    env = " ".join(rest for word, rest in runtime if word == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env, "no .pyc written next to the read-only site-packages"
    (entrypoint,) = [rest for word, rest in runtime if word == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["rebalancer"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["rebalancer"] and sidecar["command"] == ["rebalancer"]


def _ignored(path: str, patterns: list[str]) -> bool:
    hit = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(
            fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.replace("**/", ""))
            for p in prefixes
        ):
            hit = not negate
    return hit


def test_build_context() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in (
        ".venv",
        ".git",
        "tests",
        "bench",
        "reliability/chaos/harness.py",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        "docs/sim.png",
        "out",
        ".ci/tools",
        "rebalancer/__pycache__/x.pyc",
        "x.sqlite",
        "deploy/kubernetes",
        "deploy/controller.toml",
    ):
        assert _ignored(path, patterns), f".dockerignore lets {path} into the build context"
    # What the build stage copies is in the context, and covers the wheel's packages.
    copied: list[str] = []
    for word, rest in stages()[0]:
        if word == "COPY":
            copied.extend(rest.split()[:-1])
    pyproject: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    locks = {str(lock.relative_to(ROOT)) for lock in (RUNTIME_LOCK, BUILD_LOCK)}
    assert packages | locks | {"pyproject.toml", pyproject["project"]["readme"]} == set(copied)
    assert not {"bench", "reliability", "tests"} & {path.split("/")[0] for path in copied}, (
        "neither bench, the reliability harness nor tests ships"
    )
    for path in copied:
        assert (ROOT / path).exists(), path
        assert not _ignored(path, patterns), f".dockerignore hides {path}, which the build copies"
    for data in pyproject["tool"]["setuptools"]["package-data"]["rebalancer"]:
        assert not _ignored(f"rebalancer/{data}", patterns), f"the wheel's data {data} is ignored"


@pytest.mark.parametrize("line", ["FROM python:3.11-slim AS build", "USER root", "USER rebalancer"])
def test_the_checks_catch_what_they_should(
    line: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    text = CONTAINERFILE.read_text()
    word = line.split()[0]
    first = next(
        raw
        for raw in text.splitlines()
        if raw.startswith(word + " ") and (word != "FROM" or "AS build" in raw)
    )
    broken = tmp_path / "Containerfile"
    broken.write_text(text.replace(first, line))
    monkeypatch.setattr(sys.modules[__name__], "CONTAINERFILE", broken)
    check = (
        test_multi_stage_on_a_pinned_base
        if word == "FROM"
        else test_runs_as_the_manifests_user_on_a_read_only_root
    )
    with pytest.raises((AssertionError, ValueError)):
        check()
