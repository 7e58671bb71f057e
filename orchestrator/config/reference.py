"""The config reference, generated from the sections' field descriptions (the files of
orchestrator/config/ and pipelines/config.py), so that the meaning of a key is written once, next
to its type and default: `markdown()` is docs/config.md (a test keeps the page current;
regenerate it with `python -m orchestrator.config.reference > docs/config.md`), and
`explain(config)` is a resolved config as YAML with each key's meaning as a `#` comment above it,
which loads back to the same config. A leaf like the rest of orchestrator/config: pydantic and
YAML only."""

from __future__ import annotations

import json
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from orchestrator.config.load import to_dict
from orchestrator.config.model import ModelConfig
from orchestrator.config.tree import Config

REGENERATE = "python -m orchestrator.config.reference > docs/config.md"
# A `model:` key that is not a field of ModelConfig is an option of the model's builder.
MODEL_OPTION = ("An option of the model's builder, passed as a keyword argument (null: left out, "
                "the builder's default).")
WIDTH = 116  # comment lines of explain() wrap here


@dataclass(frozen=True)
class Key:
    """One key of the config tree: its dotted name, its field, and the section model it opens
    (None for a value)."""

    name: str
    field: FieldInfo
    section: type[BaseModel] | None


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds when it is a section (`data`, `data.s3`), else None."""
    is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation if is_section else None


def keys(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[Key]:
    """Every key of the tree, depth first in declaration order: a section, then its keys."""
    for name, field in model.model_fields.items():
        section = _section_of(field.annotation)
        yield Key(prefix + name, field, section)
        if section is not None:
            yield from keys(section, f"{prefix}{name}.")


def description(key: str) -> str:
    """The meaning of a dotted key (`model.<option>` included); KeyError for a key the tree does
    not have."""
    found = {k.name: k.field.description for k in keys()}
    if key not in found and key.startswith("model.") and key.count(".") == 1:
        return MODEL_OPTION
    return found[key] or ""


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


_NOUNS = {int: "integer", float: "number", str: "string", bool: "true/false"}


def takes(field: FieldInfo) -> str:
    """What a key takes, in a few words: its `accepts` note (json_schema_extra), else read off
    its type."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("accepts"):
        return str(extra["accepts"])
    words: list[str] = []
    for member in _members(field.annotation):
        origin, args = typing.get_origin(member), typing.get_args(member)
        if member is type(None):
            continue
        if origin is Literal:
            words += [str(arg) for arg in args]
        elif origin is list:
            words.append(f"list of {_NOUNS.get(args[0], 'values')}s" if args and args[0] in _NOUNS
                         else "list")
        elif origin is dict:
            words.append("mapping")
        else:
            words.append(_NOUNS.get(member, getattr(member, "__name__", str(member))))
    if type(None) in _members(field.annotation):
        words.append("null")
    return " | ".join(words)


def _default(field: FieldInfo) -> str:
    """The declared default as YAML shows it (`null`, `true`, `[pixels]`)."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return yaml.safe_dump(value).split("\n")[0]


def _cell(text: str) -> str:
    # One line; a pipe would end the table cell, and <experiment> would read as an HTML tag.
    return " ".join(text.split()).replace("|", "\\|").replace("<", "\\<")


def _row(key: Key) -> str:
    meaning = _cell(key.field.description or "")
    return f"| `{key.name}` | `{_default(key.field)}` | {_cell(takes(key.field))} | {meaning} |"


def markdown() -> str:
    """docs/config.md: every section with its description, every key with its default, what it
    takes, its meaning."""
    sections = [k for k in keys() if k.section is not None]
    out = [
        "# Config reference",
        "",
        "<!-- Generated from the schema's field descriptions (orchestrator/config/, "
        f"pipelines/config.py) by `{REGENERATE}`: edit those, then regenerate. "
        "tests/unit/config/test_reference.py checks it is current. -->",
        "",
        "Every key of the config, with its default and meaning. Precedence: the defaults below < "
        "`--config FILE.yaml` < repeated `--set dotted.key=value` (values parse as YAML). Every "
        "key is validated before Ray starts; a typo or a bad value exits with status 2 and one "
        "line naming the key. `orchestrator show-config --config FILE.yaml` prints the resolved "
        "config (derived values filled in), and with `--explain` each key's meaning from this page "
        "as a comment above it; with `--plan` the config resolved for the data and the run's plan "
        "(data, model, memory, price, place, resume), checked as `train` checks it before Ray "
        "starts.",
        "",
        "Sections: " + ", ".join(f"[{k.name}](#{k.name.replace('.', '')})" for k in sections) + ".",
        "",
        "## Top level",
        "",
        "| key | default | takes | meaning |",
        "|---|---|---|---|",
    ]
    out += [_row(k) for k in keys() if "." not in k.name and k.section is None]
    for section in sections:
        out += ["", f"## {section.name}", "", _cell(section.field.description or ""), ""]
        out += ["| key | default | takes | meaning |", "|---|---|---|---|"]
        prefix = section.name + "."
        for k in keys():
            if k.name.startswith(prefix) and "." not in k.name[len(prefix):] and k.section is None:
                out.append(_row(k))
        nested = [k for k in sections
                  if k.name.startswith(prefix) and "." not in k.name[len(prefix):]]
        if nested:
            links = ", ".join(f"[{k.name}](#{k.name.replace('.', '')})" for k in nested)
            out += ["", f"Sub-sections: {links}."]
        if section.section is ModelConfig:
            out += ["", "Any other key under `model`: "
                    f"{MODEL_OPTION[0].lower()}{MODEL_OPTION[1:-1]}; e.g. `model.hidden` and "
                    "`model.dropout` for `mlp`."]
    return "\n".join(out) + "\n"


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), width=WIDTH - len(indent),
                         initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ",
                         break_on_hyphens=False, break_long_words=False)


def _value_lines(name: str, value: Any, indent: str) -> list[str]:
    """`name: value` as YAML at this indent (a list or a mapping in flow style where it holds
    only scalars)."""
    # None would write a scalar's pair as {name: value}
    flow = None if isinstance(value, (list, dict)) else False
    text = yaml.safe_dump({name: value}, sort_keys=False, default_flow_style=flow, width=10**6)
    return [indent + line for line in text.splitlines()]


def explain(config: Config) -> str:
    """The resolved config as YAML (what `show-config` prints), each key's meaning as a `#`
    comment above it."""
    sections = {k.name for k in keys() if k.section is not None}
    lines = ["# The resolved config; each key's meaning above it (all of them: docs/config.md)."]

    def walk(tree: dict[str, Any], prefix: str, indent: str) -> None:
        for name, value in tree.items():
            key = prefix + name
            if not indent and len(lines) > 1:
                lines.append("")  # a blank line between top-level sections
            lines.extend(_comment(description(key), indent))
            if key in sections:
                lines.append(f"{indent}{name}:")
                walk(value, f"{key}.", indent + "  ")
            else:
                lines.extend(_value_lines(name, value, indent))

    walk(to_dict(config), "", "")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
