"""What `pip install moe-rebalancer` puts on a user's machine.

A wheel built from the tree holds only the product's two sides, `rebalancer` and
`worker_hooks`; installed into a fresh virtual environment (outside the repository, so
nothing of the tree is on the path) it runs `rebalancer demo`, imports every engine
adapter module with its engine absent, and says what to install only when an adapter is
used. The fresh environment takes the wheel's dependencies (numpy, grpcio, torch, ...)
from the development venv through a path file, so no download happens; the project itself
comes from the wheel alone (checked by where it is imported from).

Beside each engine's pinned code (the folders scripts/vllm_env.sh and scripts/sglang_env.sh
provision, on the fresh environment's path as if installed there) the engine's own plugin
loader finds the wheel's entry point and runs it: `vllm.plugins.load_general_plugins()`
with `VLLM_PLUGINS=rebalancer` puts the controller's policy in vLLM's EPLB, and SGLang's
`load_plugins()` with `SGLANG_PLUGINS=rebalancer` registers and applies the adapter's hooks.
The engine images' install step (deploy/engines/layer.py) is run there too. Each engine
runs in a process of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import sglang_cpu
from tests.conftest import MARKER
from tests.engines.sglang import sglang_env
from tests.engines.vllm import vllm_env
from worker_hooks.engines.sglang.plugin import ON_FORWARD_PASS_END, STAT_ACCUMULATOR_APPEND

ROOT = Path(__file__).resolve().parents[2]
# What the wheel is built from: what the Containerfiles copy into their build stage.
SOURCES = ("pyproject.toml", "README.md", "rebalancer", "worker_hooks")
LAYER = ROOT / "deploy" / "engines" / "layer.py"


def pinned(engine: str) -> str:
    """The engine version pyproject.toml's extra pins, the one place it is set."""
    (requirement,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ][engine]
    name, _, version = requirement.partition("==")
    assert name == engine, requirement
    return version


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the sources, as the images build it: a build in the tree would
    write build/ and the egg-info there, and pack whatever an older build left in build/."""
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name,
                src / name,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
            )
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "--disable-pip-version-check",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("moe_rebalancer-*.whl")
    return built


def make_venv(wheel: Path, venv: Path, beside: tuple[Path, ...] = ()) -> Path:
    """A fresh venv holding the wheel; `beside` (an engine's folder) and then the dev venv's
    packages on its path, through a path file."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    # Dependencies only: a path line does not run the dev venv's own .pth files, so its
    # editable install of this project stays out of the fresh environment (and its metadata,
    # later on the path, is shadowed by the wheel's).
    paths = [*map(str, beside), site.getsitepackages()[0]]
    Path(purelib, "dependencies-from-dev-venv.pth").write_text("\n".join(paths) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "-q",
            "--disable-pip-version-check",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return Path(purelib)


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("venv")
    make_venv(wheel, venv)
    yield venv


@pytest.fixture(scope="module")
def vllm_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed beside vLLM's pinned code."""
    if not vllm_env.available():
        pytest.skip(vllm_env.MISSING)
    venv = tmp_path_factory.mktemp("vllm-venv")
    make_venv(wheel, venv, (vllm_env.SITE,))
    return venv


@pytest.fixture(scope="module")
def sglang_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed beside SGLang's pinned code (and the CPU stubs of its GPU imports)."""
    venv = tmp_path_factory.mktemp("sglang-venv")
    make_venv(wheel, venv, (sglang_cpu.SITE, sglang_cpu.SHIMS))
    return venv


def run_in(
    venv: Path, cwd: Path, *args: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """A clean environment: nothing of the tree or the dev venv but what the venv's path file
    names (the session's marker passes, so a process left behind is caught)."""
    base = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(cwd)}
    if MARKER in os.environ:
        base[MARKER] = os.environ[MARKER]
    return subprocess.run(
        list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**base, **env}
    )


def last_json(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_wheel_holds_only_rebalancer_and_worker_hooks(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"rebalancer", "worker_hooks"}
    # The adapters and the examples travel inside worker_hooks; the routing data too.
    assert "worker_hooks/engines/sglang/plugin.py" in names
    assert "worker_hooks/examples/cpu_worker.py" in names
    assert any(n.startswith("rebalancer/data/deepseek-v3/") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "rebalancer = worker_hooks.engines.sglang:register" in text
    assert "rebalancer = worker_hooks.engines.vllm:register" in text


def test_installed_adapters_import_without_their_engine(fresh_venv: Path, tmp_path: Path) -> None:
    probe = (
        "import importlib, json, importlib.metadata as md\n"
        "import rebalancer, worker_hooks.engines.sglang, worker_hooks.engines.transformers\n"
        "import worker_hooks.engines.vllm\n"
        "import worker_hooks.engines.sglang.adapter as adapter\n"
        "out = {'rebalancer': rebalancer.__file__, 'missing': [], 'strays': []}\n"
        "for m in ('bench', 'engines', 'reference'):\n"
        "    try:\n"
        "        importlib.import_module(m); out['strays'].append(m)\n"
        "    except ImportError:\n"
        "        pass\n"
        "(ep,) = [e for e in md.entry_points(group='sglang.srt.plugins') if e.name == "
        "'rebalancer']\n"
        "out['entry_point'] = ep.value\n"
        "ep.load()\n"
        "try:\n"
        "    adapter.SGLangRebalanceAdapter(None, None)\n"
        "except ImportError as exc:\n"
        "    out['missing'] = [type(exc).__name__, str(exc)]\n"
        "print(json.dumps(out))\n"
    )
    done = run_in(fresh_venv, tmp_path, str(fresh_venv / "bin" / "python"), "-c", probe)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["rebalancer"].startswith(str(fresh_venv)), (
        "the project came from the tree, not the wheel"
    )
    assert out["strays"] == []
    assert out["entry_point"] == "worker_hooks.engines.sglang:register"
    kind, message = out["missing"]
    assert kind == "EngineMissingError"
    # No index serves moe-rebalancer: the way that works, with the version the wheel pins.
    assert message == (
        "the SGLang adapter needs SGLang (sglang is not installed): install the moe-rebalancer "
        f"wheel into SGLang {pinned('sglang')}'s own environment (the version "
        "tested), e.g. its image with deploy/engines/sglang.Containerfile "
        '(docs/operations.md, "Engine images")'
    )


def test_installed_wheel_runs_the_demo(fresh_venv: Path, tmp_path: Path) -> None:
    done = run_in(
        fresh_venv,
        tmp_path,
        str(fresh_venv / "bin" / "rebalancer"),
        "demo",
        "--workers",
        "2",
        "--windows",
        "6",
        "--json",
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["workers"] == 2 and summary["windows"] >= 6
    assert summary["max_output_diff"] == 0.0
    assert summary["weights_match_map"] and summary["ranks_agree_on_versions"]


# vLLM's own loader in a fresh process: vLLM's EPLB policy before and after it ran.
VLLM_PROBE = """
import importlib.metadata as md, json
from vllm.distributed.eplb import policy
import vllm.plugins
before = policy.EPLB_POLICIES["default"]
vllm.plugins.load_general_plugins()
after = policy.EPLB_POLICIES["default"]
import worker_hooks
print(json.dumps({
    "before": f"{before.__module__}.{before.__qualname__}",
    "after": f"{after.__module__}.{after.__qualname__}",
    "adapter": worker_hooks.__file__,
    "entries": {e.name: [e.value, e.dist.metadata["Name"], str(e.dist.locate_file(""))]
                for e in md.entry_points(group="vllm.general_plugins")},
}))
"""


def test_vllms_plugin_loader_registers_the_installed_wheel(vllm_venv: Path, tmp_path: Path) -> None:
    purelib = str(next(vllm_venv.glob("lib/python*/site-packages")))
    done = run_in(
        vllm_venv,
        tmp_path,
        str(vllm_venv / "bin" / "python"),
        "-c",
        VLLM_PROBE,
        timeout=240,
        VLLM_TARGET_DEVICE="cpu",
        VLLM_PLUGINS="rebalancer",
        REBALANCER_ADDRESS=f"unix:{tmp_path}/agent.sock",
    )
    out = last_json(done)
    # vLLM's loader ran the plugin: its EPLB, on vLLM's own policy before, now asks the controller.
    assert out["before"].startswith("vllm."), out["before"]
    assert (
        out["after"]
        == "worker_hooks.engines.vllm.plugin.controller_policy.<locals>.ControllerEplbPolicy"
    ), (out, done.stderr[-3000:])
    assert out["entries"]["rebalancer"] == [
        "worker_hooks.engines.vllm:register",
        "moe-rebalancer",
        purelib,
    ]
    assert out["adapter"].startswith(purelib), "the adapter came from elsewhere than the wheel"


# SGLang's own loader in a fresh process: its hook registry and the hooked method after it ran.
SGLANG_PROBE = """
import json
from sglang.srt.eplb.eplb_manager import EPLBManager
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
original = id(EPLBManager.on_forward_pass_end)  # an id: SGLang rebinds module globals that hold it
load_plugins()
import worker_hooks
live = EPLBManager.on_forward_pass_end
print(json.dumps({
    "hooks": [[target, kind.value, f"{hook.__module__}.{hook.__qualname__}", list(source or ())]
              for target, hooks in sorted(HookRegistry._hooks.items()) for kind, hook, source in hooks],
    "applied": sorted(HookRegistry._patched),
    "wraps_original": id(live) != original and id(getattr(live, "__wrapped__", None)) == original,
    "adapter": worker_hooks.__file__,
}))
"""  # noqa: E501


@sglang_env.needed()
def test_sglangs_plugin_loader_registers_the_installed_wheel(
    sglang_venv: Path, tmp_path: Path
) -> None:
    purelib = str(next(sglang_venv.glob("lib/python*/site-packages")))
    done = run_in(
        sglang_venv,
        tmp_path,
        str(sglang_venv / "bin" / "python"),
        "-c",
        SGLANG_PROBE,
        timeout=240,
        SGLANG_ROLE_NAMESPACES="off",
        SGLANG_PLUGINS="rebalancer",
        REBALANCER_ADDRESS=f"unix:{tmp_path}/agent.sock",
    )
    out = last_json(done)
    registered = {(target, kind, hook): source for target, kind, hook, source in out["hooks"]}
    plugin = "worker_hooks.engines.sglang.plugin"
    assert (ON_FORWARD_PASS_END, "around", f"{plugin}._on_forward_pass_end") in registered, out[
        "hooks"
    ]
    assert (STAT_ACCUMULATOR_APPEND, "after", f"{plugin}._on_pass_counts") in registered, out[
        "hooks"
    ]
    # SGLang's record of each hook: the entry point's name and the wheel's distribution.
    assert set(map(tuple, registered.values())) == {("rebalancer", "moe-rebalancer")}
    # ... and it applied every one: each target exists in the pinned SGLang.
    assert out["applied"] == sorted({target for target, _, _ in registered}), done.stderr[-3000:]
    assert out["wraps_original"], "SGLang's EPLB manager still runs its own on_forward_pass_end"
    assert out["adapter"].startswith(purelib), "the adapter came from elsewhere than the wheel"


def test_the_engine_images_check_passes_beside_the_tested_vllm_only(
    vllm_venv: Path, fresh_venv: Path, tmp_path: Path
) -> None:
    """deploy/engines/layer.py, the engine images' install step, on the wheel beside vLLM."""
    python = str(vllm_venv / "bin" / "python")
    check = (python, str(LAYER), "check", "vllm")
    assert (
        run_in(vllm_venv, tmp_path, *check, vllm_env.VERSION, "vllm.general_plugins").returncode
        == 0
    )
    newer = run_in(vllm_venv, tmp_path, *check, "99.0.0", "vllm.general_plugins")
    assert newer.returncode == 1
    assert newer.stderr.strip() == (
        f"engine layer: the image runs vllm {vllm_env.VERSION}, not 99.0.0, the "
        'version the adapter is tested with: see docs/operations.md, "A newer engine"'
    )
    wrong_group = run_in(vllm_venv, tmp_path, *check, vllm_env.VERSION, "vllm.platform_plugins")
    assert (
        wrong_group.returncode == 1 and "holds 0 entries named 'rebalancer'" in wrong_group.stderr
    )
    absent = run_in(
        fresh_venv,
        tmp_path,
        str(fresh_venv / "bin" / "python"),
        str(LAYER),
        "check",
        "vllm",
        vllm_env.VERSION,
        "vllm.general_plugins",
    )
    assert absent.returncode == 1 and "vllm is not installed" in absent.stderr
    # The constraints hold the engine and the torch it runs on at their versions.
    pins = run_in(vllm_venv, tmp_path, python, str(LAYER), "constraints")
    assert pins.returncode == 0, pins.stderr
    lines = pins.stdout.split()
    assert f"vllm=={vllm_env.VERSION}" in lines and "moe-rebalancer==0.1.0" in lines
    assert any(line.startswith("torch==") for line in lines)
    names = [line.split("==")[0].lower().replace("_", "-") for line in lines]
    assert len(names) == len(set(names)), "one version per package, or pip refuses the constraints"
