"""The install step of the engine images (deploy/engines/*.Containerfile), run by the engine
image's own Python; standard library only, as the project is not installed yet.

  python3 layer.py constraints
      the environment's packages as NAME==VERSION lines, for `pip install --constraint`:
      installing the wheel then changes none of the engine's packages (or fails, naming the
      one it would change). Versions pip cannot read (not PEP 440, as some OS packages'
      `1.1build1`) are left out; nothing the wheel needs has one.
  python3 layer.py check ENGINE VERSION GROUP
      the environment runs ENGINE at VERSION (a local part such as `+cu129` aside), and its
      entry point group GROUP holds `rebalancer` from moe-rebalancer, which loads. One line
      on stderr and exit status 1 otherwise.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys

PEP440 = re.compile(r"\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?(\+[A-Za-z0-9.]+)?")
PLUGIN = "rebalancer"
DISTRIBUTION = "moe-rebalancer"


def constraints() -> list[str]:
    """One line per installed package: the copy Python imports (the first on its path)."""
    pins: dict[str, str] = {}
    for dist in metadata.distributions():
        name, version = dist.metadata["Name"], dist.version
        key = re.sub(r"[-_.]+", "-", name or "").lower()
        if key and key not in pins and version and PEP440.fullmatch(version):
            pins[key] = f"{name}=={version}"
    return [pins[key] for key in sorted(pins)]


def check(engine: str, version: str, group: str) -> str | None:
    """Why the environment is not what the image promises, or None."""
    try:
        found = metadata.version(engine).split("+")[0]
    except metadata.PackageNotFoundError:
        return f"{engine} is not installed in this image's Python ({sys.executable})"
    if found != version:
        return (f"the image runs {engine} {found}, not {version}, the version the adapter is "
                "tested with: see docs/operations.md, \"A newer engine\"")
    points = [ep for ep in metadata.entry_points(group=group) if ep.name == PLUGIN]
    if len(points) != 1:
        return f"entry point group {group} holds {len(points)} entries named {PLUGIN!r}, not 1"
    (point,) = points
    owner = point.dist.metadata["Name"] if point.dist is not None else None
    if owner != DISTRIBUTION:
        return f"the {group} entry point {PLUGIN!r} comes from {owner}, not {DISTRIBUTION}"
    point.load()
    return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["constraints"] and len(argv) == 1:
        print("\n".join(constraints()))
        return 0
    if argv[:1] == ["check"] and len(argv) == 4:
        problem = check(*argv[1:])
        if problem is not None:
            print(f"engine layer: {problem}", file=sys.stderr)
            return 1
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
