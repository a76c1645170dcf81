"""Every path of this repository that the docs, docstrings and comments name exists: a
file moved or renamed without its references fails here, not in a reader's hands.

A path is a word starting with one of the repository's top folders (`rebalancer/`,
`tests/`, `docs/`, ...); `a/b/c` also stands for the module file `a/b/c.py`. The few
that name something made at run time, or an instruction's target, are listed in
NOT_IN_THE_TREE with the reason."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("rebalancer", "worker_hooks", "bench", "tests", "docs", "scripts", "deploy", "proto", ".ci")
SUFFIXES = (".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".cfg")
# A top folder, a slash, then path characters; not inside a longer word or path
# (`vllm/distributed/eplb/...` names the engine's files, not ours).
TOP = "|".join(re.escape(t) for t in TOPS)
PATH = re.compile(rf"(?<![\w./-])((?:{TOP})/[\w./-]*\w)")
GENERATED = ("rebalancer/v1/",)  # protoc's output names the .proto by its import path
THIS = "tests/unit/test_doc_paths.py"  # its example names a missing file on purpose

NOT_IN_THE_TREE = {
    ".ci/tools/image-wheels": "made by the image test at run time",
    "bench/pod-0": "the sidecar cost bench's pod name, not a path",
    "deploy/kubernetes/base/controller.toml": "where operations.md tells the reader to move the file",
    "deploy/rebalancer": "kubectl's kind/name, not a path",
    "docs/sim.png": "a plot file the image must leave out",
    "docs/sim_": "prefix of the simulator's plot files",
    "rebalancer/__pycache__/x.pyc": "a cache file the image must leave out",
    "rebalancer/fence": "a key prefix in the fence's store",
}


def referenced_paths() -> dict[str, set[str]]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    found: dict[str, set[str]] = {}
    for name in files:
        if not name.endswith(SUFFIXES) or name.startswith(GENERATED) or name == THIS:
            continue
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the work tree, not yet committed
        for match in PATH.finditer(path.read_text(errors="replace")):
            found.setdefault(match.group(1).rstrip("."), set()).add(name)
    return found


def test_every_path_named_exists() -> None:
    missing = {
        ref: sorted(where) for ref, where in referenced_paths().items()
        if ref not in NOT_IN_THE_TREE and not (ROOT / ref).exists() and not (ROOT / f"{ref}.py").exists()
    }
    assert not missing, "paths named but not in the tree:\n" + "\n".join(
        f"  {ref}: {', '.join(where[:4])}" for ref, where in sorted(missing.items()))


def test_the_check_finds_a_missing_path(tmp_path: Path) -> None:
    text = "see rebalancer/controller/nosuch.py and worker_hooks/agent.py, not vllm/distributed/eplb/x.py"
    refs = [m.group(1) for m in PATH.finditer(text)]
    assert refs == ["rebalancer/controller/nosuch.py", "worker_hooks/agent.py"]
    assert [r for r in refs if not (ROOT / r).exists()] == ["rebalancer/controller/nosuch.py"]


def test_every_exception_is_still_needed() -> None:
    """An exception whose text is gone from the tree is removed from the list."""
    refs = referenced_paths()
    assert not [ref for ref in NOT_IN_THE_TREE if ref not in refs]
