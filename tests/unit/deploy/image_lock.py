"""The image's lock files (deploy/image), read: each requirement's pinned version and the
sha256 hashes pip accepts for it. Shared by the lock check (test_image_lock.py) and the
image test (tests/integration/test_image.py), which fetches the locked wheels with them."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[3]
IMAGE = ROOT / "deploy" / "image"
# What the runtime venv (/opt/rebalancer) installs, and what the build stage needs to build
# the project's wheel (never in the image).
RUNTIME_LOCK = IMAGE / "requirements.txt"
BUILD_LOCK = IMAGE / "build-requirements.txt"

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class Pin:
    name: str  # canonical (PEP 503)
    version: str
    hashes: frozenset[str]


def read_lock(path: Path) -> dict[str, Pin]:
    """Requirements of a pip-compile file with --generate-hashes, by canonical name."""
    pins: dict[str, Pin] = {}
    for line in path.read_text().replace("\\\n", " ").splitlines():  # backslash continues a line
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pin = _parse(line, path)
        assert pin.name not in pins, f"{path.name}: {pin.name} twice"
        pins[pin.name] = pin
    return pins


def _parse(entry: str, path: Path) -> Pin:
    match = _PIN.match(entry)
    assert match, f"{path.name}: not a name==version pin: {entry[:80]}"
    hashes = frozenset(_HASH.findall(entry))
    assert hashes, f"{path.name}: {match.group(1)} has no --hash"
    return Pin(canonicalize_name(match.group(1)), match.group(2), hashes)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def missing_wheels(pins: dict[str, Pin], folder: Path) -> list[str]:
    """The pins no file in `folder` matches by hash."""
    have = {sha256(p) for p in folder.glob("*.whl")} if folder.is_dir() else set()
    return sorted(name for name, pin in pins.items() if not pin.hashes & have)
