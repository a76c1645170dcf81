"""Adapters that let real inference engines use the rebalancer without patching them.

Each engine is imported lazily inside its own subpackage, so importing an adapter module
costs nothing and a CPU path never loads an engine it does not use. An adapter used where
its engine is missing raises `EngineMissingError` (an `ImportError`) naming the extra to
install, at the point of use, never at import time.
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
        raise EngineMissingError(
            f"the {engine} adapter needs {engine} ({top} is not installed): "
            f"pip install 'moe-rebalancer[{extra}]'"
        ) from exc
