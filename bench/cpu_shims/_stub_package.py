"""Test-only stand-ins for two packages SGLang imports at module level but never runs
on a CPU: triton (GPU kernels; its wheel is 1 GB unpacked and the CPU torch has none)
and torchvision (image decoding; PyPI's wheels are built against CUDA torch and do not
load on the CPU torch). They sit on the path of the SGLang test and bench processes only
(tests/engines/sglang, bench/sglang_staged.py, through bench/sglang_cpu.py), never beside
the adapter in production, where the real ones are installed with SGLang. Every attribute is a
permissive object: a decorator returns the function it decorates, so `@triton.jit` kernels stay
plain (never called) functions.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Anything:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, key: str) -> _Anything:
        if key.startswith("__"):
            raise AttributeError(key)
        return _Anything(f"{self._name}.{key}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator
        return _Anything(f"{self._name}()")

    def __getitem__(self, key):
        return _Anything(f"{self._name}[]")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<cpu stub {self._name}>"


class _StubType(type):
    def __getattr__(cls, key: str) -> _Anything:
        if key.startswith("__"):
            raise AttributeError(key)
        return _Anything(f"{cls.__name__}.{key}")


class _StubModule(types.ModuleType):
    def __getattr__(self, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        if key[:1].isupper():  # a class: isinstance() needs a real type
            cls = _StubType(key, (), {})
            setattr(self, key, cls)
            return cls
        return _Anything(f"{self.__name__}.{key}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots and name not in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install(package: types.ModuleType, version: str) -> None:
    """Make `package` and every submodule of it a stub module."""
    package.__class__ = _StubModule
    package.__version__ = version
    package.__path__ = []
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(set()))
    for finder in sys.meta_path:
        if isinstance(finder, _Finder):
            finder.roots.add(package.__name__)
