"""Importing a user's `module:function` (model builders, data transforms) with one clear error per
mistake."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def load_function(spec: str) -> Callable[..., object]:
    """Import `module:function`; ValueError naming what is wrong when either part is missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"entrypoint '{spec}' must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"entrypoint '{spec}': cannot import module '{module_name}' ({exc}); "
                         "is it installed or on PYTHONPATH?") from exc
    if not callable(getattr(module, attr, None)):
        raise ValueError(f"entrypoint '{spec}': module '{module_name}' has no callable '{attr}'")
    return getattr(module, attr)
