"""The search-space grammar of `tune.space` (`optim.lr: {loguniform: [1e-4, 1e-1]}` over dotted
config keys): parsing and checking a space against the config's own schema. Pure Python below the
config's sections, which use it to validate the tune section (search.py turns a Domain into Ray
Tune's)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

from orchestrator.config.base import suggest

RANGES = ("loguniform", "uniform", "randint")  # [low, high]; randint includes high
LISTS = ("choice", "grid")  # grid: every value once per sample (random searcher only)
KINDS = RANGES + LISTS
# Sections a trial must share with its study: where results go, how they are tracked, the study
# itself.
UNSEARCHABLE = ("experiment", "tune", "storage", "tracking")

@dataclass(frozen=True)
class Domain:
    """One searched key: `kind` in KINDS and its values ([low, high] for ranges)."""

    kind: str
    values: tuple[Any, ...]

    def extremes(self) -> list[Any]:
        """The values that bound what a trial can get: both ends of a range, every listed value."""
        return list(self.values)


def _flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Accept both `optim.lr: {...}` and `optim: {lr: {...}}` (what `--set
    tune.space.optim.lr.choice=[..]` builds)."""
    flat: dict[str, Any] = {}
    for key, spec in raw.items():
        name = f"{prefix}{key}"
        if isinstance(spec, dict) and spec and not (set(spec) & set(KINDS)):
            flat.update(_flatten(spec, f"{name}."))
        else:
            flat[name] = spec
    return flat


def _number(value: Any) -> Any:
    """YAML 1.1 reads '1e-4' as a string; users mean a number ('adamw' stays a string)."""
    if isinstance(value, str) and any(c.isdigit() for c in value):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_domain(key: str, spec: Any) -> Domain:
    """`{loguniform: [1e-4, 1e-1]}` -> Domain; raises ValueError naming the key and the fix."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ValueError(f"search space '{key}' must be one of {{{': [..]}, {'.join(KINDS)}: "
                         f"[..]}}, got {spec!r}")
    kind, values = next(iter(spec.items()))
    if not isinstance(values, list) or not values:
        raise ValueError(f"search space '{key}': {kind} needs a non-empty list, got {values!r}")
    values = [_number(v) for v in values]
    if kind in LISTS:
        return Domain(kind, tuple(values))
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if len(values) != 2 or not numbers:
        raise ValueError(f"search space '{key}': {kind} needs [low, high] numbers, got {values!r}")
    low, high = values
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ValueError(f"search space '{key}': {kind} range [{low}, {high}] is empty or "
                         "inverted: low must be below high (for one value, set the key itself "
                         "instead)")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"search space '{key}': loguniform needs low > 0, got {low}")
    if kind == "randint":
        if not all(isinstance(v, int) for v in values):
            raise ValueError(f"search space '{key}': randint needs integer bounds, got {values!r}")
        return Domain(kind, (int(low), int(high)))
    return Domain(kind, (float(low), float(high)))


def _unwrap(annotation: Any) -> Any:
    """`X | None` -> X."""
    if get_origin(annotation) in (Union, type(int | None)):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def check_key(key: str, root: type[BaseModel]) -> None:
    """Raise ValueError unless `key` names a config value (a leaf; any key of a section with
    extras, e.g. model)."""
    parts = key.split(".")
    if parts[0] in UNSEARCHABLE:
        raise ValueError(f"search space key '{key}': the '{parts[0]}' section is shared by the "
                         "whole study and cannot be searched")
    model: type[BaseModel] = root
    for depth, part in enumerate(parts):
        fields = model.model_fields
        prefix = "".join(f"{p}." for p in parts[:depth])
        if part not in fields:
            if model.model_config.get("extra") == "allow" and depth == len(parts) - 1:
                # a model kwarg: checked against the model's signature when a trial config is built
                return
            raise ValueError(f"search space key '{key}' is not a config "
                             f"key{suggest(part, fields, prefix)}")
        inner = _unwrap(fields[part].annotation)
        is_section = isinstance(inner, type) and issubclass(inner, BaseModel)
        if depth == len(parts) - 1:
            if is_section:
                raise ValueError(f"search space key '{key}' is a section: name one of its keys, "
                                 f"e.g. '{key}.{next(iter(inner.model_fields))}'")
            return
        if not is_section:
            raise ValueError(f"search space key '{key}': '{prefix}{part}' is a value, not a "
                             "section (a search space is {kind: [..]} with kind one of "
                             f"{', '.join(KINDS)})")
        model = inner


def parse_space(raw: dict[str, Any], root: type[BaseModel]) -> dict[str, dict[str, list[Any]]]:
    """Validate a `tune.space` mapping; returns it flat and normalised (plain data, as it is
    saved)."""
    space = {}
    for key, spec in _flatten(raw).items():
        check_key(key, root)
        domain = parse_domain(key, spec)
        space[key] = {domain.kind: list(domain.values)}
    return space
