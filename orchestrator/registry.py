"""One small generic registry for models, optimizers and schedules."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from orchestrator.errors import ConfigError

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
            raise ConfigError(f"unknown {self.kind} '{name}'{suggest(name, self._items)}; valid: {sorted(self._items)}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)


def suggest(name: str, candidates: Iterable[str], prefix: str = "") -> str:
    """' (did you mean 'x'?)' for the closest candidate, or ''."""
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def load_entrypoint(spec: str) -> Callable[..., object]:
    """Import `module:function`, with a clear error when either part is missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"entrypoint '{spec}' must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"entrypoint '{spec}': cannot import module '{module_name}' ({exc}); "
                          "is it installed or on PYTHONPATH?") from exc
    if not callable(getattr(module, attr, None)):
        raise ConfigError(f"entrypoint '{spec}': module '{module_name}' has no callable '{attr}'")
    return getattr(module, attr)
