"""Every file of this repository that the docs, docstrings and comments name exists: a
file moved or renamed without its references fails here, not in a reader's hands.

What counts as naming a file (each check lists its offenders as `file:line -> name`):
1. A repository path: a word that starts with one of the repository's top folders and a
   slash (`rebalancer/`, `tests/`, `docs/`, ...), anywhere in a tracked text file (code
   included); `a/b/c` also stands for the module file `a/b/c.py`. It must exist.
2. In prose (Markdown files; docstrings and comments of the Python code; comments of the
   .proto files):
   - a relative path, a word `x/...` whose first folder `x` is a folder one level under a
     top folder (`controller/`, `engines/`, `session/`, `chaos/`, ...): it must end a
     path of the tree (`engines/vllm/plugin.py` names worker_hooks/engines/vllm/plugin.py);
   - a bare file name, a word ending in .py, .md, .toml, .yaml, .yml, .proto or .sh with no
     folder (`fold.py`, `ARCHITECTURE.md`): some file of the tree has that name. The dated
     records (RECORDS) may name a file by the name it had on the day, so this one is not
     asked of them.
A word preceded by a slash or a dot is part of a longer path (`../shared/DESIGN.md` is
outside the repository, `vllm/distributed/eplb/x.py` names the engine's files). The few
names that mean something made at run time, someone else's file or an instruction's target
are listed in NOT_IN_THE_TREE with the reason.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = (
    "rebalancer",
    "worker_hooks",
    "bench",
    "reliability",
    "tests",
    "docs",
    "scripts",
    "deploy",
    "proto",
    ".ci",
)
SUFFIXES = (".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".cfg", ".proto")
CODE = (
    "rebalancer/",
    "worker_hooks/",
    "bench/",
    "reliability/",
    "tests/",
    "scripts/",
)  # prose: docstrings, comments
GENERATED = ("rebalancer/v1/",)  # protoc's output names the .proto by its import path
THIS = "tests/unit/test_doc_paths.py"  # its examples name missing files on purpose
# Dated records: each entry says what was true on its day, in that day's file names.
RECORDS = ("BENCHMARKS.md", "RELIABILITY.md", "docs/benchmarks-history.md")

# A top folder, a slash, then path characters; not inside a longer word or path
# (`vllm/distributed/eplb/...` names the engine's files, not ours).
TOP = "|".join(re.escape(t) for t in TOPS)
PATH = re.compile(rf"(?<![\w./-])((?:{TOP})/[\w./-]*\w)")
RELATIVE = re.compile(r"(?<![\w./*<>{}$-])((?:[\w-]+/)+[\w-]+(?:\.\w+)?)(?![\w/])")
BARE = re.compile(r"(?<![\w./*<>{}$-])(\w[\w-]*\.(?:py|md|toml|yaml|yml|proto|sh))(?![\w/(-])")

NOT_IN_THE_TREE = {
    ".ci/tools/image-wheels": "made by the image test at run time",
    "bench/pod-0": "the sidecar cost bench's pod name, not a path",
    "deploy/kubernetes/base/controller.toml": (
        "where operations.md tells the reader to move the file"
    ),
    "deploy/rebalancer": "kubectl's kind/name, not a path",
    "docs/sim.png": "a plot file the image must leave out",
    "docs/sim_": "prefix of the simulator's plot files",
    "rebalancer/__pycache__/x.pyc": "a cache file the image must leave out",
    "rebalancer/fence": "a key prefix in the fence's store",
    "v1/worker/gpu/eplb_utils.py": "vLLM's file (vllm/v1/...), not rebalancer/v1",
    "eplb.py": "DeepSeek's EPLB reference, not ours",
    "eplb_utils.py": "vLLM's file",
    "drain.toml": "the config a restart test writes at run time",
    "prometheus.yml": "the config rebalancer/launch/prometheus.py writes at run time",
    "my-inference.yaml": "the reader's own manifest in an example kustomization",
}


def tracked_files() -> list[str]:
    return subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()


class Tree:
    """The files of the tree: whole paths (files and folders), their tails, their names."""

    def __init__(self, files: Iterable[str]) -> None:
        files = [f for f in files if (ROOT / f).exists()]  # deleted in the work tree: gone
        folders = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
        self.paths = set(files) | folders
        self.tails = {p.split("/", i)[-1] for p in self.paths for i in range(p.count("/") + 1)}
        self.names = {f.rsplit("/", 1)[-1] for f in files}
        self.second = {
            d.split("/")[1] for d in folders if d.count("/") == 1 and d.split("/")[0] in TOPS
        }

    def has_path(self, ref: str) -> bool:
        return ref in self.paths or f"{ref}.py" in self.paths or (ROOT / ref).exists()


def prose_lines(name: str, text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of the prose of a file: all of a Markdown file, the docstrings
    (modules, classes, functions, attributes) and comments of Python code, the comments of
    a .proto file."""
    if name.endswith(".md"):
        yield from enumerate(text.splitlines(), 1)
    elif name.endswith(".proto"):
        yield from (
            (n, line.split("//", 1)[1])
            for n, line in enumerate(text.splitlines(), 1)
            if "//" in line
        )
    elif name.endswith(".py") and name.startswith(CODE):
        tree = ast.parse(text)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if not isinstance(body, list):
                continue
            for before, stmt in zip([None, *body], body, strict=False):
                documents = (
                    before is None
                    and isinstance(
                        node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
                    )
                    or isinstance(before, ast.Assign | ast.AnnAssign)
                )
                if (
                    documents
                    and isinstance(stmt, ast.Expr)
                    and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)
                ):
                    yield from enumerate(stmt.value.value.splitlines(), stmt.lineno)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string


def missing_paths(name: str, text: str, tree: Tree) -> list[str]:
    """Check 1 on one file: `name:line -> path` for each repository path not in the tree."""
    return [
        f"{name}:{n} -> {ref}"
        for n, line in enumerate(text.splitlines(), 1)
        for ref in (m.group(1).rstrip(".") for m in PATH.finditer(line))
        if ref not in NOT_IN_THE_TREE and not tree.has_path(ref)
    ]


def missing_in_prose(name: str, text: str, tree: Tree) -> list[str]:
    """Check 2 on one file: `name:line -> name` for each relative path or bare file name of
    its prose that names no file of the tree."""
    bad = []
    for n, line in prose_lines(name, text):
        for m in RELATIVE.finditer(line):
            ref = m.group(1).rstrip(".")
            first = ref.split("/")[0]
            if (
                first in tree.second
                and first not in TOPS
                and ref not in NOT_IN_THE_TREE
                and ref not in tree.tails
                and f"{ref}.py" not in tree.tails
            ):
                bad.append(f"{name}:{n} -> {ref}")
        if name in RECORDS:
            continue
        bad += [
            f"{name}:{n} -> {ref}"
            for ref in (m.group(1) for m in BARE.finditer(line))
            if ref not in tree.names and ref not in NOT_IN_THE_TREE
        ]
    return bad


def scanned() -> Iterator[tuple[str, str]]:
    for name in tracked_files():
        if not name.endswith(SUFFIXES) or name.startswith(GENERATED) or name == THIS:
            continue
        path = ROOT / name
        if path.is_file():  # else deleted in the work tree, not yet committed
            yield name, path.read_text(errors="replace")


def test_every_repository_path_named_exists() -> None:
    tree = Tree(tracked_files())
    bad = [line for name, text in scanned() for line in missing_paths(name, text, tree)]
    assert not bad, "paths named but not in the tree:\n  " + "\n  ".join(bad)


def test_every_file_named_in_prose_exists() -> None:
    tree = Tree(tracked_files())
    bad = [line for name, text in scanned() for line in missing_in_prose(name, text, tree)]
    assert not bad, (
        "files named in docs, docstrings or comments but not in the tree:\n  " + "\n  ".join(bad)
    )


def test_the_checks_find_a_missing_file() -> None:
    tree = Tree(tracked_files())
    doc = (
        "See rebalancer/controller/nosuch.py and worker_hooks/agent.py, not "
        "vllm/distributed/eplb/x.py;\n"
        "engines/vllm/extension.py, engines/vllm/plugin.py, DESIGN.md and ARCHITECTURE.md;\n"
        "the brief is ../shared/DESIGN.md.\n"
    )
    assert missing_paths("a.md", doc, tree) == ["a.md:1 -> rebalancer/controller/nosuch.py"]
    assert missing_in_prose("a.md", doc, tree) == [
        "a.md:2 -> engines/vllm/extension.py",
        "a.md:2 -> DESIGN.md",
    ]
    # In code only docstrings and comments are prose; a record may use a name of its day.
    code = (
        '"""Moves weights (migrate.py)."""\n\nNAME = "nosuch.toml"\n\n\ndef f() -> None:\n'
        '    """Per controller/nosuch.py."""\n    x = 1  # as fold.py and gone.py say\n'
    )
    assert missing_in_prose("tests/x.py", code, tree) == [
        "tests/x.py:1 -> migrate.py",
        "tests/x.py:7 -> controller/nosuch.py",
        "tests/x.py:8 -> gone.py",
    ]
    assert missing_in_prose("BENCHMARKS.md", "after the refactor of migrate.py\n", tree) == []


def test_every_exception_is_still_needed() -> None:
    """An exception that names a file of the tree, or whose text is gone from the tree, is
    removed from the list."""
    tree = Tree(tracked_files())
    texts = [text for _, text in scanned()]
    assert not [ref for ref in NOT_IN_THE_TREE if ref in tree.paths or ref in tree.names]
    assert not [ref for ref in NOT_IN_THE_TREE if not any(ref in text for text in texts)]
