"""The layering of ARCHITECTURE.md, held: which package may import which.

Two checks. A static walk of every import statement in `rebalancer/` and `worker_hooks/`
(function-level lazy imports included, and every `-m module` a process is started with)
against the allowed edges; and a fresh
interpreter that imports every `worker_hooks` module and must not have loaded the
controller, the placement engine or scipy (what an inference process pays for).

Beside the product, the same walk over `bench/`, `reliability/`, `tests/` and `scripts/`:
one way only, product <- bench <- tests, product <- reliability <- tests and product <-
scripts (the product imports none of them, bench and reliability import no test and not
each other, nothing imports a script); and no import circle among the product's modules at
import time.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Layer of a module: the longest matching prefix wins.
LAYERS = {
    "rebalancer": "base",  # the package itself (__version__)
    "rebalancer.errors": "base",
    "rebalancer.v1": "base",
    "rebalancer.wire": "wire",
    "rebalancer.data": "data",
    "rebalancer.datasets": "data",
    "rebalancer.formats": "data",
    "rebalancer.placement": "placement",
    "rebalancer.controller": "controller",
    "worker_hooks": "worker_hooks",
    "rebalancer.sidecar": "sidecar",
    "rebalancer.sim": "sim",
    "worker_hooks.examples": "examples",
    "worker_hooks.engines": "engines",
    "rebalancer.launch": "launch",
    "rebalancer.demo": "demo",
    "rebalancer.cli": "top",
    "rebalancer.__main__": "top",
    # Beside the product, never imported by it.
    "bench": "bench",
    "reliability": "reliability",
    "tests": "tests",
    "scripts": "scripts",
}

# The product's layers (what the CLI may import) and the rest of the tree.
BESIDE = {"bench", "reliability", "tests", "scripts"}
PRODUCT = {layer for layer in LAYERS.values() if layer not in BESIDE}

# What each layer may import (besides itself). Bottom: base and wire; placement on top of
# them; controller and worker_hooks beside each other; the rest above.
ALLOWED = {
    "base": {"base"},
    "wire": {"base"},
    "data": {"base", "wire"},
    "placement": {"base", "wire"},
    "controller": {"base", "wire", "data", "placement"},
    "worker_hooks": {"base", "wire"},
    "sidecar": {"base", "wire"},
    "sim": {"base", "wire", "data", "placement", "controller"},
    "examples": {"base", "wire", "worker_hooks"},
    "engines": {"base", "wire", "data", "worker_hooks"},
    # The launch toolkit (ports, reaping, controller, sidecars, workers, the instant rank):
    # what the demo, bench, scripts and tests launch with; never the demo or the CLI.
    "launch": {
        "base",
        "wire",
        "data",
        "placement",
        "controller",
        "worker_hooks",
        "sidecar",
        "examples",
    },
    "demo": {
        "base",
        "wire",
        "data",
        "placement",
        "controller",
        "worker_hooks",
        "sidecar",
        "examples",
        "launch",
    },
    "top": PRODUCT,
    # One way: product <- bench <- tests, product <- reliability <- tests, product <- scripts.
    "bench": PRODUCT,
    "reliability": PRODUCT,
    "tests": PRODUCT | {"bench", "reliability"},
    "scripts": PRODUCT,
}


def layer_of(module: str) -> str | None:
    best = None
    for prefix in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best):
                best = prefix
    return None if best is None else LAYERS[best]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, lazy ones included, and every
    module a child process is started with (`"-m", "pkg.mod"` in a list, tuple or call)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        items = (
            node.elts
            if isinstance(node, ast.List | ast.Tuple)
            else node.args
            if isinstance(node, ast.Call)
            else []
        )
        for flag, target in zip(items, items[1:], strict=False):
            if (
                isinstance(flag, ast.Constant)
                and flag.value == "-m"
                and isinstance(target, ast.Constant)
                and isinstance(target.value, str)
            ):
                found.append((target.value, target.lineno))
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            # `from rebalancer import placement` imports the package rebalancer.placement
            found.extend((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)
    return found


def source_files(tops: tuple[str, ...] = ("rebalancer", "worker_hooks")) -> list[Path]:
    files = []
    for top in tops:
        files += [p for p in (ROOT / top).rglob("*.py") if "v1" not in p.relative_to(ROOT).parts]
    return sorted(files)


def forbidden_edges(files: dict[str, Path] | None = None) -> list[str]:
    """Every import of `files` (module name -> path; default: the project's) that its
    layer may not make, as `path:line: layer imports module (layer)`."""
    if files is None:
        files = {module_name(p): p for p in source_files()}
    bad = []
    for importer, path in files.items():
        src = layer_of(importer)
        assert src is not None, f"{importer} belongs to no layer: add it to LAYERS"
        for imported, line in imports_of(path):
            dst = layer_of(imported)
            if dst is None or dst == src:
                continue
            if dst not in ALLOWED[src]:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                bad.append(f"{where}:{line}: {src} imports {imported} ({dst})")
    return bad


def test_no_import_crosses_the_layers_the_wrong_way() -> None:
    assert forbidden_edges() == []


def test_bench_tests_and_scripts_import_one_way() -> None:
    """bench and the reliability harness import no test, no script and not each other, tests
    import no script, scripts import none of them (the product's side is held above)."""
    files = {
        module_name(p): p
        for p in source_files(("bench", "reliability", "tests", "scripts"))
        if "cpu_shims" not in p.parts
    }  # stand-ins of third-party packages, not ours
    assert forbidden_edges(files) == []


def module_level_imports(path: Path) -> list[str]:
    """The modules a file imports when it is imported: statements at module level (inside
    `if`/`try` too), not in functions, not under `if TYPE_CHECKING:`."""
    found: list[str] = []
    body = list(ast.parse(path.read_text(), filename=str(path)).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.If) and not ast.unparse(node.test).endswith("TYPE_CHECKING"):
            body += node.body + node.orelse
        elif isinstance(node, ast.Try):
            body += (
                node.body
                + node.orelse
                + node.finalbody
                + [s for h in node.handlers for s in h.body]
            )
    return found


def import_circles(files: dict[str, Path] | None = None) -> list[list[str]]:
    """Every circle of modules (of `files`, default: the product's) that import each other
    at import time, each as its modules sorted."""
    if files is None:
        files = {module_name(p): p for p in source_files()}

    def ours(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {
        m: {
            t
            for t in map(ours, module_level_imports(p))
            if t is not None and t != m and not m.startswith(t + ".")
        }  # a package's own __init__
        for m, p in files.items()
    }
    # Strongly connected components (Tarjan's), iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle_in_the_product() -> None:
    assert import_circles() == []


def test_the_walk_sees_a_sideways_import_and_a_circle(tmp_path: Path) -> None:
    """The checkers themselves: the product importing a script or a test, bench importing
    a script or a test, a test importing a script; two modules importing each other."""
    probe = tmp_path / "probe.py"
    probe.write_text("from scripts.render_dashboard import main\nimport tests.conftest\n")
    assert forbidden_edges({"rebalancer.launch.probe": probe}) == [
        "probe.py:1: launch imports scripts.render_dashboard (scripts)",
        "probe.py:1: launch imports scripts.render_dashboard.main (scripts)",
        "probe.py:2: launch imports tests.conftest (tests)",
    ]
    assert forbidden_edges({"bench.probe": probe}) == [
        "probe.py:1: bench imports scripts.render_dashboard (scripts)",
        "probe.py:1: bench imports scripts.render_dashboard.main (scripts)",
        "probe.py:2: bench imports tests.conftest (tests)",
    ]
    assert forbidden_edges({"tests.probe": probe}) == [
        "probe.py:1: tests imports scripts.render_dashboard (scripts)",
        "probe.py:1: tests imports scripts.render_dashboard.main (scripts)",
    ]
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("from rebalancer.x.b import f\n")
    b.write_text("import rebalancer.x.a\n")
    c.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rebalancer.x.a\n"
        "def g():\n    import rebalancer.x.b\n"
    )
    assert import_circles({"rebalancer.x.a": a, "rebalancer.x.b": b, "rebalancer.x.c": c}) == [
        ["rebalancer.x.a", "rebalancer.x.b"]
    ]


def test_the_walk_sees_a_forbidden_edge(tmp_path: Path) -> None:
    """The checker itself: a worker hook importing the controller is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("import numpy\n\ndef f():\n    from rebalancer.controller import decide\n")
    assert forbidden_edges({"worker_hooks.probe": probe}) == [
        "probe.py:4: worker_hooks imports rebalancer.controller (controller)",
        "probe.py:4: worker_hooks imports rebalancer.controller.decide (controller)",
    ]
    assert forbidden_edges({"rebalancer.sim.probe": probe}) == []


def test_the_walk_sees_a_module_started_as_a_process(tmp_path: Path) -> None:
    """`python -m worker_hooks.examples.cpu_worker` from the controller is an edge too."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        'import sys\ncmd = [sys.executable, "-m", "worker_hooks.examples.cpu_worker"]\n'
    )
    assert forbidden_edges({"rebalancer.controller.probe": probe}) == [
        "probe.py:2: controller imports worker_hooks.examples.cpu_worker (examples)",
    ]
    assert forbidden_edges({"rebalancer.demo": probe}) == []


def test_importing_worker_hooks_loads_neither_controller_nor_placement_nor_scipy() -> None:
    torch = pytest.importorskip("torch")  # noqa: F841
    # deepep.py included: it must import deep_ep only when an adapter is built.
    modules = sorted(module_name(p) for p in (ROOT / "worker_hooks").rglob("*.py"))
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
    assert "worker_hooks.hook" in loaded and "worker_hooks.migration" in loaded
    leaked = [
        m
        for m in loaded
        if m.startswith(
            ("rebalancer.controller", "rebalancer.placement", "rebalancer.sim", "scipy", "deep_ep")
        )
    ]
    assert leaked == []


# Inside the worker core, the hook's parts reference one way (ARCHITECTURE.md, "Who owns
# which state"): the hot path (hook) above the plan driver (plans) above the agent; the
# settings, counters and count files below them all. Module -> the siblings it may not import.
HOOK_PARTS_BELOW = {
    "worker_hooks.agent": {
        "worker_hooks.hook",
        "worker_hooks.plans",
        "worker_hooks.counts",
        "worker_hooks.serving",
        "worker_hooks.config",
    },
    "worker_hooks.plans": {"worker_hooks.hook", "worker_hooks.counts"},
    "worker_hooks.counts": {"worker_hooks.hook", "worker_hooks.plans", "worker_hooks.agent"},
    "worker_hooks.serving": {"worker_hooks.hook", "worker_hooks.plans", "worker_hooks.agent"},
    "worker_hooks.config": {
        "worker_hooks.hook",
        "worker_hooks.plans",
        "worker_hooks.agent",
        "worker_hooks.counts",
        "worker_hooks.serving",
        "worker_hooks.migration",
        "worker_hooks.weights",
        "worker_hooks.transports",
    },
}

# Moving weights, bottom up (ARCHITECTURE.md, "Layering"): the settings (config) and the
# rank's weights (weights) below the transports (worker_hooks/transports/), the executor
# (migration) above them. Module prefix -> the modules (and their submodules) it may not import.
MIGRATION_BELOW = {
    "worker_hooks.weights": ("worker_hooks.transports", "worker_hooks.migration"),
    "worker_hooks.transports": ("worker_hooks.migration",),
}


def _forbidden(imported: str, below: set[str] | tuple[str, ...]) -> bool:
    return any(imported == m or imported.startswith(m + ".") for m in below)


def test_the_hooks_parts_reference_one_way() -> None:
    bad = []
    for importer, forbidden in HOOK_PARTS_BELOW.items():
        path = ROOT / (importer.replace(".", "/") + ".py")
        bad += [
            f"{path.name}:{line}: imports {imported}"
            for imported, line in imports_of(path)
            if _forbidden(imported, forbidden)
        ]
    assert bad == []


def test_moving_weights_is_layered() -> None:
    files = {module_name(p): p for p in source_files()}
    bad = [
        f"{path.relative_to(ROOT)}:{line}: imports {imported}"
        for importer, path in files.items()
        for prefix, forbidden in MIGRATION_BELOW.items()
        if importer == prefix or importer.startswith(prefix + ".")
        for imported, line in imports_of(path)
        if _forbidden(imported, forbidden)
    ]
    assert bad == []


def test_the_settings_load_no_transport_code() -> None:
    """A process that reads the hook's settings (an engine's config, a launcher) imports no
    transport or executor code (worker_hooks/config.py holds `MigrationConfig`)."""
    pytest.importorskip("torch")
    code = "import json, sys\nimport worker_hooks.config\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert [
        m
        for m in loaded
        if m.startswith(
            ("worker_hooks.transports", "worker_hooks.migration", "worker_hooks.weights")
        )
    ] == []
