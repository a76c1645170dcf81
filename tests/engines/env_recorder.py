"""An environment that remembers every name read from it: the docs tests of each engine
adapter check that every `REBALANCER_*` variable the adapter reads is documented."""

from __future__ import annotations


class EnvRecorder(dict):  # type: ignore[type-arg]
    """A dict standing in for os.environ that records each key looked up."""

    def __init__(self, **values: str) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key, default=None):  # type: ignore[no-untyped-def] # noqa: ANN001, ANN201
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):  # type: ignore[no-untyped-def] # noqa: ANN001, ANN204
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:  # type: ignore[no-untyped-def] # noqa: ANN001
        self.read.add(key)
        return super().__contains__(key)
