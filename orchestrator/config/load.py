"""Reading a config: YAML files, `--set dotted.key=value` overrides, and the one-line wording of
a validation error that names the key and what it accepts."""

from __future__ import annotations

import functools
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from orchestrator.config.base import suggest
from orchestrator.config.tree import Config
from orchestrator.errors import ConfigError


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{'.'.join(keys[: depth + 1])}' is a value, not a "
                              "section")
        node = child
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """'optim.lr=1e-3' -> ('optim.lr', 0.001); the value is parsed as YAML (numbers, lists,
    null)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set '{item}' must look like section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    # YAML 1.1 reads '1e-3' as a string; users mean a number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.strip(), value


def _section_model(annotation: Any) -> Any:
    """The section class a field holds (also when optional), or None for a leaf."""
    members = [m for m in typing.get_args(annotation) if m is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(members) == 1:
        annotation = members[0]
    is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation if is_section else None


def _is_union(annotation: Any) -> bool:
    """A union whose members pydantic tries one by one, reporting an error per member (`X | None`
    is not one)."""
    members = [m for m in typing.get_args(annotation) if m is not type(None)]
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(members) > 1


def _field_names(loc: tuple[Any, ...]) -> list[str]:
    """The valid keys of the section at `loc` (for 'did you mean')."""
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = _section_model(field.annotation) if field is not None else None
        if model is None:
            return []
    return list(model.model_fields)


@functools.cache
def _keys_by_leaf() -> dict[str, list[str]]:
    """Every dotted key of the tree, sections included, by its last part: {'lr': ['optim.lr'],
    ...}."""
    found: dict[str, list[str]] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            found.setdefault(name, []).append(prefix + name)
            section = _section_model(field.annotation)
            if section is not None:
                walk(section, f"{prefix}{name}.")

    walk(Config, "")
    return found


def either(items: list[str]) -> str:
    """The items quoted and listed as a sentence would: 'a' | 'a' or 'b' | 'a', 'b' or 'c'."""
    quoted = [f"'{item}'" for item in items]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def keys_elsewhere(name: str, section: str) -> list[str]:
    """The dotted keys named `name` outside `section` ('' = top level): 'lr' -> ['optim.lr']."""
    return [key for key in _keys_by_leaf().get(name, []) if key.rpartition(".")[0] != section]


# Names other libraries (transformers, Lightning, timm) give keys of ours, too unlike ours for a
# spelling match.
_SYNONYMS = {"learning_rate": ("lr",), "batch_size": ("global_batch_size", "micro_batch_size"),
             "clip_grad_norm": ("max_grad_norm",), "gradient_clip_val": ("max_grad_norm",),
             "warmup": ("warmup_steps",), "gradient_accumulation_steps": ("grad_accum_steps",)}


def _unknown_key_hint(loc: tuple[str, ...]) -> str:
    """' (did you mean ...?)': a synonym's key in any section (optim.learning_rate -> optim.lr),
    the same name in another section (lr -> optim.lr, train.lr -> optim.lr), else the closest key
    of its own section (optim.lrr -> optim.lr), else ''."""
    synonyms = _SYNONYMS.get(loc[-1], ())
    elsewhere = ([key for leaf in synonyms for key in _keys_by_leaf().get(leaf, [])] if synonyms
                 else keys_elsewhere(loc[-1], ".".join(loc[:-1])))
    if elsewhere:
        return f" (did you mean {either(elsewhere)}?)"
    return suggest(loc[-1], _field_names(loc[:-1]), "".join(f"{p}." for p in loc[:-1]))


def _locate(loc: tuple[Any, ...]) -> tuple[tuple[str, ...], tuple[str, ...] | None, Any]:
    """An error location as (dotted key parts, the key of the union field the error is one
    member's error of, that field): pydantic puts a tag per union member into the location
    (num_workers.int, num_workers.list[int]) and list indices, neither of which is a key the user
    can set."""
    key: list[str] = []
    model: Any = Config
    field: Any = None
    for part in loc:
        if isinstance(part, int):
            continue
        if model is not None and part in model.model_fields:
            field = model.model_fields[part]
            model = _section_model(field.annotation)
            key.append(part)
        elif field is not None and model is None and _is_union(field.annotation):
            # `part` is the member's tag; what follows is inside the member
            return tuple(key), tuple(key), field
        else:
            model, field = None, None
            key.append(part)
    return tuple(key), None, None


_NOUNS = {int: ("a whole number", "whole numbers"), float: ("a number", "numbers"),
          str: ("a string", "strings"), bool: ("true or false", "booleans")}


def _accepts(field: Any) -> str:
    """What a union field takes, in words: its `accepts` note (json_schema_extra), else read off
    its members."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("accepts"):
        return str(extra["accepts"])
    words = []
    for member in typing.get_args(field.annotation):
        origin, args = typing.get_origin(member), typing.get_args(member)
        if member is type(None):
            continue
        if origin is Literal:
            words += [str(arg) for arg in args]
        elif origin is list:
            words.append(f"a list of {_NOUNS[args[0]][1]}" if args and args[0] in _NOUNS
                         else "a list")
        elif origin is dict:
            words.append("a mapping")
        else:
            words.append(_NOUNS[member][0] if member in _NOUNS
                         else getattr(member, "__name__", str(member)))
    if type(None) in typing.get_args(field.annotation):
        words.append("null")
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _shown(value: Any) -> str:
    """A value near enough as the user wrote it in YAML: null, true, 'abc', [1, 'a']."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def format_validation_error(exc: ValidationError) -> str:
    """One line, one clause per problem, naming the dotted key; for typos, the closest valid key;
    for a value that fits no member of a union, the key once and what it takes (not one clause
    per member, tagged with its type)."""
    # A union's clause is written once all its members' errors are in.
    clauses: list[str | tuple[str, ...]] = []
    members: dict[tuple[str, ...], list[Any]] = {}
    fields: dict[tuple[str, ...], Any] = {}
    for err in exc.errors():
        loc, union, field = _locate(err["loc"])
        key = ".".join(loc) or "config"
        if union is not None:
            if union not in members:
                clauses.append(union)
                members[union], fields[union] = [], field
            members[union].append(err)
        elif err["type"] == "extra_forbidden":
            clauses.append(f"unknown config key '{key}'{_unknown_key_hint(loc)}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            clauses.append(f"config key '{key}': {msg}" if loc else f"config: {msg}")

    def union_clause(union: tuple[str, ...]) -> str:
        # The field's value, not an item's.
        value = min(members[union], key=lambda err: len(err["loc"]))["input"]
        key = ".".join(union)
        return f"config key '{key}': give {_accepts(fields[union])}, got {_shown(value)}"

    return "; ".join(clause if isinstance(clause, str) else union_clause(clause)
                     for clause in clauses)


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Validate a plain dict (as loaded from YAML, or as shipped to a Ray worker)."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def _closest_file(file: Path) -> str:
    """' (did you mean 'examples/digits.yaml'?)': the most similar file name in the directory
    `file` names."""
    try:
        names = [entry.name for entry in file.parent.iterdir() if entry.is_file()]
    except OSError:
        return ""
    return suggest(file.name, names, "" if file.parent == Path(".") else f"{file.parent}/")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """' at line L, column C: problem' from PyYAML's several-line report (which quotes the file
    around the mark)."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return ": " + " ".join(str(exc).split())
    text = f"{problem}"
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    # e.g. the line where an unclosed [ opened
    if context and start is not None and start.line != mark.line:
        text += f" ({context} that starts at line {start.line + 1}, column {start.column + 1})"
    return f" at line {mark.line + 1}, column {mark.column + 1}: {' '.join(text.split())}"


def read_yaml_mapping(path: str | Path, what: str, missing_hint: str = "") -> dict[str, Any]:
    """A YAML file holding a mapping (empty: {}); ConfigError naming `what` and the file
    otherwise."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"{what} '{path}' is a directory, not a YAML file")
    if not file.is_file():
        raise ConfigError(f"{what} '{path}' not found{_closest_file(file)}{missing_hint}")
    try:
        loaded = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} '{path}' is not valid YAML{_yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{what} '{path}' cannot be read: {exc.strerror}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{what} '{path}' must hold a mapping, got {type(loaded).__name__}")
    return loaded or {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults < YAML file < overrides; raises ConfigError with one clear line."""
    tree = read_yaml_mapping(path, "config file") if path is not None else {}
    # Where each model option came from, for the message that refuses one
    # (models.check_model_options).
    model = tree.get("model")
    origins = {key: str(path) for key in model} if isinstance(model, dict) else {}
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
        if key == "model":
            origins = {option: "--set" for option in value} if isinstance(value, dict) else {}
        elif key.startswith("model.") and key.count(".") == 1:
            origins[key.removeprefix("model.")] = "--set"
    config = config_from_dict(tree)
    config.model._origins = {key: origin for key, origin in origins.items()
                             if key in config.model.kwargs}
    return config


def to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as plain data (crosses into Ray workers, saved with the run)."""
    return config.model_dump(mode="json")


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def with_values(config: Config, values: dict[str, Any]) -> Config:
    """The config with dotted keys set (`{"train.max_steps": 40}`), validated again as a whole."""
    tree = to_dict(config)
    for dotted, value in values.items():
        _set_dotted(tree, dotted, value)
    return config_from_dict(tree)
