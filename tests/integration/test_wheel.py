"""What `pip install moe-rebalancer` puts on a user's machine.

A wheel built from the tree holds only the product's two sides, `rebalancer` and
`worker_hooks`; installed into a fresh virtual environment (outside the repository, so
nothing of the tree is on the path) it runs `rebalancer demo`, imports every engine
adapter module with its engine absent, and says what to install only when an adapter is
used. The fresh environment takes the wheel's dependencies (numpy, grpcio, torch, ...)
from the development venv through a path file, so no download happens; the project itself
comes from the wheel alone (checked by where it is imported from).
"""

from __future__ import annotations

import json
import site
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-q", "--disable-pip-version-check", "-w", str(out)],
        check=True, capture_output=True, timeout=300,
    )
    (built,) = out.glob("moe_rebalancer-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()
    # Dependencies only: a path line does not run the dev venv's own .pth files, so its
    # editable install of this project stays out of the fresh environment.
    Path(purelib, "dependencies-from-dev-venv.pth").write_text(site.getsitepackages()[0] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
         "--disable-pip-version-check", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    yield venv


def run_in(venv: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(cwd)})


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
        "(ep,) = [e for e in md.entry_points(group='sglang.srt.plugins') if e.name == 'rebalancer']\n"
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
    assert out["rebalancer"].startswith(str(fresh_venv)), "the project came from the tree, not the wheel"
    assert out["strays"] == []
    assert out["entry_point"] == "worker_hooks.engines.sglang:register"
    kind, message = out["missing"]
    assert kind == "EngineMissingError"
    assert message == ("the SGLang adapter needs SGLang (sglang is not installed): "
                       "pip install 'moe-rebalancer[sglang]'")


def test_installed_wheel_runs_the_demo(fresh_venv: Path, tmp_path: Path) -> None:
    done = run_in(fresh_venv, tmp_path, str(fresh_venv / "bin" / "rebalancer"), "demo",
                  "--workers", "2", "--windows", "6", "--json", timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["workers"] == 2 and summary["windows"] >= 6
    assert summary["max_output_diff"] == 0.0
    assert summary["weights_match_map"] and summary["ranks_agree_on_versions"]
