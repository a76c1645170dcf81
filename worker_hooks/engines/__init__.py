"""Adapters that let real inference engines use the rebalancer without patching them.

Each engine is imported lazily inside its own subpackage, so importing an adapter module
costs nothing and a CPU path never loads an engine it does not use. An adapter used where
its engine is missing raises `EngineMissingError` (an `ImportError`) saying how to install
the project beside it, at the point of use, never at import time.

The engine versions the adapters are tested with are pinned once, in pyproject.toml's
extras (`vllm==...`, `sglang==...`); an installed package reads them from its metadata.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class EngineMissingError(ImportError):
    """An adapter was used where its engine is not installed."""


def require_engine(module: str, engine: str, extra: str) -> ModuleType:
    """Import `module` of `engine`, or raise `EngineMissingError` with the install line."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the engine is there but one of its own dependencies is not: say that
        version = tested_version(extra)
        where = (
            f"{engine} {version}'s own environment (the version tested), e.g. its image "
            f"with deploy/engines/{extra}.Containerfile"
            if version
            else f"{engine}'s own environment"
        )
        raise EngineMissingError(
            f"the {engine} adapter needs {engine} ({top} is not installed): install the "
            f'moe-rebalancer wheel into {where} (docs/operations.md, "Engine images")'
        ) from exc


def tested_version(extra: str) -> str | None:
    """The engine version the extra `extra` pins (`vllm==0.33.0` -> "0.33.0"), read from the
    installed package's metadata; None for an extra without an exact pin, or no metadata."""
    from importlib import metadata

    try:
        requires = metadata.requires("moe-rebalancer") or []
    except metadata.PackageNotFoundError:
        return None
    for requirement in requires:
        spec, _, marker = requirement.partition(";")
        name, equals, version = spec.partition("==")
        if equals and name.strip() == extra and f'extra == "{extra}"' in marker:
            return version.strip()
    return None
