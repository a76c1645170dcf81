"""A deployment's state has one owner: `Deployment` itself (controller/deployment.py).

Every other module of the project asks it to change (its transition methods) and never
assigns one of its fields, or a field of what it holds (`dep.stats.x = ...`,
`dep.loop.shape = ...`). The walk below reads every assignment in `rebalancer/` and fails
on one whose target starts at a deployment (a name `dep` or `deployment`, or an attribute
of that name, as the controller's modules spell it). Nor does it call through the parts a
deployment holds (`dep.windows.add(...)`, `dep.loop.force(...)`: the deployment's own
verbs, `dep.ingest(...)`, `dep.force(...)`, do that) or bind one of its changeable parts to
a name of its own (`loop = dep.loop`), which would let such calls past the walk. The
transitions keep their own rules (one plan in flight, built on the committed placement;
only the plan in flight ends).
"""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rebalancer.controller.coordinate import Plan
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.deployment import Deployment
from rebalancer.wire.shape import ClusterShape

ROOT = Path(__file__).resolve().parents[3]
OWNER = ROOT / "rebalancer" / "controller" / "deployment.py"
NAMES = {"dep", "deployment"}


def parse(path: Path) -> ast.Module:
    """`ast.parse`, or the same in a fresh interpreter when this one's AST recursion count
    is off ("AST constructor recursion depth mismatch", CPython 3.11 after a test that
    changed the recursion limit mid-way; once in a full CI run)."""
    try:
        return ast.parse(path.read_text(), filename=str(path))
    except SystemError:
        code = (
            "import ast, pickle, sys; "
            "sys.stdout.buffer.write(pickle.dumps(ast.parse(open(sys.argv[1]).read())))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(path)], capture_output=True, check=True, timeout=60
        )
        tree: ast.Module = pickle.loads(out.stdout)
        return tree


def deployment_writes(path: Path) -> list[str]:
    """`file:line: dep.field` for every assignment to a deployment's field in `path`."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        else:
            continue
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                chain = []
                base = item.value if isinstance(item, ast.Subscript) else item
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                name = (
                    base.id
                    if isinstance(base, ast.Name)
                    else (base.attr if isinstance(base, ast.Attribute) else "")
                )
                if name in NAMES and chain:
                    found.append(f"{path.name}:{node.lineno}: {name}.{'.'.join(reversed(chain))}")
    return found


# What a deployment holds that has methods of its own: asked only through the deployment.
PARTS = {"windows", "loop", "estimator", "sessions", "stated", "stats", "next_seq"}
# Of those, the ones whose methods change them: never bound to another name.
CHANGEABLE = {"windows", "loop", "estimator", "sessions", "stated"}


def _through(node: ast.AST, names: set[str]) -> tuple[str, str] | None:
    """(name, part) when `node` is `dep.part` (or `self.dep.part`), `dep` in `names`."""
    if not isinstance(node, ast.Attribute):
        return None
    base = node.value
    name = (
        base.id
        if isinstance(base, ast.Name)
        else (base.attr if isinstance(base, ast.Attribute) else "")
    )
    return (name, node.attr) if name in names else None


def calls_through_parts(
    path: Path,
    names: set[str] = NAMES,
    parts: set[str] = PARTS,
    changeable: set[str] = CHANGEABLE,
) -> list[str]:
    """`file:line: dep.part.method` for every call through a deployment's part in `path`,
    and `file:line: x = dep.part` for every changeable part bound to a name (`names`,
    `parts`, `changeable`: of another owner, a replica pool say)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            chain, base = [node.func.attr], node.func.value
            while isinstance(base, ast.Attribute) and _through(base, names) is None:
                chain.append(base.attr)
                base = base.value
            hit = _through(base, names)
            if hit is not None and hit[1] in parts:
                found.append((node.lineno, f"{'.'.join(hit)}.{'.'.join(reversed(chain))}"))
        elif isinstance(node, ast.Assign | ast.NamedExpr | ast.AnnAssign) and node.value:
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for value in values:
                hit = _through(value, names)
                if hit is not None and hit[1] in changeable:
                    found.append((node.lineno, f"x = {'.'.join(hit)}"))
    return [f"{path.name}:{line}: {what}" for line, what in sorted(found)]


# What a deployment holds whose state it answers for itself (`dep.last_decision`,
# `dep.regime_library`): not even read through from outside.
ANSWERED = {"loop"}


def reads_through_parts(
    path: Path, names: set[str] = NAMES, parts: set[str] = ANSWERED
) -> list[str]:
    """`file:line: dep.part.attr` for every attribute read (or call) through `parts`."""
    found = sorted(
        (node.lineno, f"{'.'.join(hit)}.{node.attr}")
        for node in ast.walk(parse(path))
        if isinstance(node, ast.Attribute)
        and (hit := _through(node.value, names)) is not None
        and hit[1] in parts
    )
    return [f"{path.name}:{line}: {what}" for line, what in found]


def product_files() -> list[Path]:
    return sorted(
        p for p in (ROOT / "rebalancer").rglob("*.py") if p != OWNER and "v1" not in p.parts
    )


def test_no_module_but_the_deployments_own_calls_through_its_parts() -> None:
    assert [c for p in product_files() for c in calls_through_parts(p)] == []


def test_the_walk_sees_a_call_through_a_part(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(self, dep, now):\n    dep.windows.add(0, 1)\n"
        "    self.dep.loop.amend(now)\n    loop = dep.loop\n"
        "    dep.mixed.describe(); dep.force(now); x = dep.version\n"
    )
    assert calls_through_parts(probe) == [
        "probe.py:2: dep.windows.add",
        "probe.py:3: dep.loop.amend",
        "probe.py:4: x = dep.loop",
    ]


def test_no_module_but_the_deployments_own_reads_through_its_policy_loop() -> None:
    """What the loop knows (the newest decision, the regime library) the deployment tells."""
    assert [r for p in product_files() for r in reads_through_parts(p)] == []


def test_the_walk_sees_a_read_through_the_loop(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(dep, pool):\n    last = dep.loop.last_decision\n"
        "    n = self.deployment.loop.regimes\n    ok = dep.last_decision\n"
    )
    assert reads_through_parts(probe) == [
        "probe.py:2: dep.loop.last_decision",
        "probe.py:3: deployment.loop.regimes",
    ]


def test_no_module_but_the_deployments_own_assigns_its_fields() -> None:
    assert [w for p in product_files() for w in deployment_writes(p)] == []


def test_the_walk_sees_a_write(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(dep, plan):\n    dep.version, dep.phy2log = 3, plan\n"
        "    dep.stats.plans_committed += 1\n    dep.sessions[0] = None\n"
    )
    assert deployment_writes(probe) == [
        "probe.py:2: dep.version",
        "probe.py:2: dep.phy2log",
        "probe.py:3: dep.stats.plans_committed",
        "probe.py:4: dep.sessions",
    ]


SHAPE = ClusterShape(num_layers=1, num_logical=4, num_slots=4, num_gpus=2)


def _plan(version: int, base: int) -> Plan:
    return Plan(
        version=version,
        base_version=base,
        phy2log=np.array([[1, 0, 3, 2]]),
        transfers=np.zeros((0, 5), np.int64),
        num_ranks=2,
        trigger="policy",
        created=0.0,
        deadline=10.0,
        slots_moved=4,
        bytes_moved=40,
        started_at=0.0,
    )


def test_transitions_keep_one_plan_in_flight_built_on_the_committed_placement() -> None:
    dep = Deployment("d", SHAPE, PolicyConfig(), 1, np.array([[0, 1, 2, 3]]))
    with pytest.raises(ValueError, match="built on v0"):
        dep.begin(_plan(2, 0))
    plan = _plan(2, 1)
    dep.begin(plan)
    with pytest.raises(ValueError, match="still in flight"):
        dep.begin(_plan(3, 1))
    with pytest.raises(ValueError, match="not the plan in flight"):
        dep.commit(_plan(2, 1))
    dep.commit(plan)
    dep.finish()
    assert dep.version == 2 and dep.phy2log.tolist() == [[1, 0, 3, 2]] and dep.plan is None
    assert (dep.stats.plans_committed, dep.stats.slots_moved, dep.stats.bytes_moved) == (1, 4, 40)
