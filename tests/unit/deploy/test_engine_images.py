"""The engine images (deploy/engines/*.Containerfile), read: the project's wheel layered on
vLLM's and SGLang's published images. hadolint passes; each builds on the engine version
pyproject.toml's extra pins (the one place it is set) and checks, in the build, that the
image runs it and that the entry point the engine's loader looks for is there and loads;
the wheel is built as the controller's image builds it (same pinned base, hashed build
tools, same sources); the engine's own packages are held (constraints) and no extra
reinstalls the engine; the engine's entrypoint and user stay; the build context holds
what the builds copy. The images cannot be pulled here: what their install step does is
run for real beside the pinned engines' code in tests/integration/test_wheel.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy import test_containerfile as controller
from tests.unit.deploy.conftest import ROOT
from tests.unit.deploy.image_lock import BUILD_LOCK

ENGINES = ROOT / "deploy" / "engines"
# engine (the extra, the distribution, the file's stem) -> the published image's repository
IMAGES = {"vllm": "vllm/vllm-openai", "sglang": "lmsysorg/sglang"}
LAYER = "deploy/engines/layer.py"


def containerfile(engine: str) -> Path:
    return ENGINES / f"{engine}.Containerfile"


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pinned(engine: str) -> str:
    """The version pyproject.toml's extra pins exactly (an extra that takes a range could
    install a version nobody tested)."""
    (requirement,) = pyproject()["project"]["optional-dependencies"][engine]
    match = re.fullmatch(rf"{engine}==(\d+(\.\d+)+)", requirement)
    assert match, f"the {engine} extra must pin one tested version exactly: {requirement}"
    return match.group(1)


def plugin_group(engine: str) -> str:
    """The entry point group whose `rebalancer` entry is this engine's adapter."""
    groups = [
        group
        for group, entries in pyproject()["project"]["entry-points"].items()
        if entries.get("rebalancer", "").startswith(f"worker_hooks.engines.{engine}:")
    ]
    assert len(groups) == 1, groups
    return groups[0]


def args(engine: str) -> dict[str, str]:
    return dict(
        rest.split("=", 1)
        for word, rest in controller.instructions(containerfile(engine))
        if word == "ARG" and "=" in rest
    )


@pytest.fixture(params=sorted(IMAGES))
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_every_engine_with_an_extra_has_an_image() -> None:
    extras = pyproject()["project"]["optional-dependencies"]
    adapters = {
        p.name for p in (ROOT / "worker_hooks" / "engines").iterdir() if (p / "plugin.py").is_file()
    }
    assert adapters == set(IMAGES) and adapters <= set(extras)
    assert {p.name for p in ENGINES.glob("*.Containerfile")} == {
        f"{e}.Containerfile" for e in IMAGES
    }


def test_hadolint(hadolint: str, engine: str) -> None:
    result = subprocess.run(
        [hadolint, "--no-color", str(containerfile(engine))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_parser_directive_pulls_a_frontend(engine: str) -> None:
    for line in containerfile(engine).read_text().splitlines():
        assert not re.match(r"#\s*syntax\s*=", line.strip(), re.IGNORECASE), line


def test_on_the_tested_engine_image(engine: str) -> None:
    version, name = pinned(engine), engine.upper()
    defaults = args(engine)
    assert defaults[f"{name}_VERSION"] == version, "the image's version is the one pyproject pins"
    assert defaults[f"{name}_IMAGE"] == f"{IMAGES[engine]}:v{version}"
    wheel, final = controller.stages(containerfile(engine))
    assert final[0] == ("FROM", f"${{{name}_IMAGE}} AS engine")
    assert ("ARG", f"{name}_VERSION") in final, "the version reaches the final stage's check"
    runs = " ".join(" ".join(rest.split()) for word, rest in final if word == "RUN")
    # The build fails unless the image runs that version and the engine's entry point loads.
    check = (
        f'/tmp/rebalancer-dist/layer.py check {engine} "${{{name}_VERSION}}" {plugin_group(engine)}'
    )
    assert check in runs, runs


def test_the_wheel_is_built_as_the_controllers(engine: str) -> None:
    wheel, final = controller.stages(containerfile(engine))
    assert wheel[0] == ("FROM", "${PYTHON_IMAGE} AS wheel")
    assert (
        args(engine)["PYTHON_IMAGE"]
        == dict(
            rest.split("=", 1)
            for word, rest in controller.instructions()
            if word == "ARG" and "=" in rest
        )["PYTHON_IMAGE"]
    ), "the same pinned base as the controller's image"
    runs = " ".join(" ".join(rest.split()) for word, rest in wheel if word == "RUN")
    assert f"--require-hashes -r {BUILD_LOCK.name}" in runs, "the build tools from the hashed lock"
    assert "pip wheel --no-deps --no-build-isolation" in runs
    copied = {path for word, rest in wheel if word == "COPY" for path in rest.split()[:-1]}
    controller_copied = {
        path
        for word, rest in controller.stages()[0]
        if word == "COPY"
        for path in rest.split()[:-1]
    }
    assert copied == controller_copied - {"deploy/image/requirements.txt"}, (
        "the wheel's sources, as there"
    )


def test_the_engine_stays_as_published(engine: str) -> None:
    wheel, final = controller.stages(containerfile(engine))
    words = [word for word, _ in final]
    for kept in ("USER", "ENTRYPOINT", "CMD"):
        assert kept not in words, f"the engine image's own {kept} stays"
    commands = [
        " ".join(c.split()) for word, rest in final if word == "RUN" for c in rest.split("&&")
    ]
    (install,) = [c for c in commands if " pip install " in f" {c} "]
    assert "--constraint /tmp/rebalancer-dist/constraints.txt" in install, (
        "the engine's packages are held"
    )
    assert "layer.py constraints > /tmp/rebalancer-dist/constraints.txt" in commands[0], commands[0]
    assert install.endswith("/tmp/rebalancer-dist/moe_rebalancer-*.whl"), (
        "the wheel, without an extra"
    )
    assert "--no-deps" not in install, "the wheel's dependencies come with it"
    assert commands[-1] == "rm -rf /tmp/rebalancer-dist", "nothing of the install stays behind"
    assert [rest for word, rest in final if word == "COPY"] == [
        "--from=wheel /dist /tmp/rebalancer-dist",
        f"{LAYER} /tmp/rebalancer-dist/",
    ]


def test_the_build_context_holds_what_the_builds_copy(engine: str) -> None:
    patterns = [
        line.strip()
        for line in controller.DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for stage in controller.stages(containerfile(engine)):
        for word, rest in stage:
            if word == "COPY" and not rest.startswith("--from="):
                for path in rest.split()[:-1]:
                    assert (ROOT / path).exists(), path
                    assert not controller._ignored(path, patterns), f".dockerignore hides {path}"
    assert controller._ignored("deploy/engines/vllm.Containerfile", patterns), (
        "only layer.py joins the context"
    )


@pytest.mark.parametrize("change", ["version", "group", "constraints", "extra"])
def test_the_checks_catch_what_they_should(
    change: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    text = containerfile("vllm").read_text()
    broken = {
        "version": text.replace("ARG VLLM_VERSION=0.33.0", "ARG VLLM_VERSION=0.34.0"),
        "group": text.replace(" vllm.general_plugins \\", " vllm.platform_plugins \\"),
        "constraints": text.replace("--constraint /tmp/rebalancer-dist/constraints.txt ", ""),
        "extra": text.replace("moe_rebalancer-*.whl \\", "moe_rebalancer-*.whl[vllm] \\"),
    }[change]
    assert broken != text, change
    (tmp_path / "vllm.Containerfile").write_text(broken)
    monkeypatch.setattr(sys.modules[__name__], "ENGINES", tmp_path)
    check = (
        test_on_the_tested_engine_image
        if change in ("version", "group")
        else test_the_engine_stays_as_published
    )
    with pytest.raises(AssertionError):
        check("vllm")
