"""One small generic registry for models, optimizers and schedules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from orchestrator.config import suggest
from orchestrator.errors import ConfigError
from pipelines.entrypoints import load_function

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> builder. Duplicate names raise; an unknown name lists the valid ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorate(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            self._items[name] = item
            return item

        return decorate

    def get(self, name: str) -> T:
        if name not in self._items:
            raise ConfigError(f"unknown {self.kind} '{name}'{suggest(name, self._items)}; valid: "
                              f"{sorted(self._items)}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)


def load_entrypoint(spec: str) -> Callable[..., object]:
    """Import `module:function`, with a clear error when either part is missing."""
    try:
        return load_function(spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
