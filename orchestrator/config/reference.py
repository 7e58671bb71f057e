"""The config explained: `explain` writes a resolved config as YAML with each key's description (the pydantic
schema's `Field(description=...)`) as a `#` comment above it, nested sections indented under their key; what
`orchestrator show-config --explain` prints. Comments only: the YAML loads back to what `show-config` prints."""

from __future__ import annotations

import textwrap
from typing import Any

import yaml
from pydantic import BaseModel

from orchestrator.config.load import to_dict
from orchestrator.config.schema import Config

WIDTH = 116  # comment lines, indentation included


def explain(config: Config) -> str:
    """`config` as YAML, each key preceded by its description as `#` comment lines."""
    return "".join(_section(config, to_dict(config), ""))


def _section(model: BaseModel, values: dict[str, Any], indent: str) -> list[str]:
    """The lines of one section: its keys in the order `to_dict` gives them. A nested section (a non-empty model)
    becomes an indented block; any other value is written by yaml.safe_dump, as `to_yaml` writes it. Keys a model
    accepts beyond its fields (a model's options) have no description."""
    fields = type(model).model_fields
    lines: list[str] = []
    for key, value in values.items():
        field = fields.get(key)
        if field is not None and field.description:
            text = " ".join(field.description.split())
            lines += [f"{line}\n" for line in textwrap.wrap(text, WIDTH, initial_indent=f"{indent}# ",
                                                             subsequent_indent=f"{indent}# ")]
        child = getattr(model, key, None)
        if isinstance(child, BaseModel) and isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:\n")
            lines += _section(child, value, indent + "  ")
        else:
            dumped = yaml.safe_dump({key: value}, sort_keys=False)
            lines += [f"{indent}{line}\n" for line in dumped.splitlines()]
    return lines
