"""Search spaces over dotted config keys (`optim.lr: {loguniform: [1e-4, 1e-1]}`): parsing, checks that run before
any trial starts, and the config each trial trains with. Pure Python: Ray Tune is imported only by `to_tune`."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin

from pydantic import BaseModel

from orchestrator.errors import ConfigError
from orchestrator.registry import suggest

if TYPE_CHECKING:
    from orchestrator.config import Config

RANGES = ("loguniform", "uniform", "randint")  # [low, high]; randint includes high
LISTS = ("choice", "grid")  # grid: every value once per sample (random searcher only)
KINDS = RANGES + LISTS
# Sections a trial must share with its study: where results go, how they are tracked, the study itself.
UNSEARCHABLE = ("experiment", "tune", "storage", "tracking")

# What train/loop.py reports (`_interval_metrics` every log_every steps, `evaluate` at eval steps);
# tests/unit/test_search.py runs the loop and fails if this drifts.
TRAIN_METRICS = ("step", "epoch", "samples_seen", "train_loss", "lr", "grad_norm", "samples_per_s",
                 "data_wait_frac", "skipped_steps", "world_size")
VAL_METRICS = ("val_loss", "val_accuracy")
_HIGHER_IS_BETTER = ("val_accuracy", "samples_per_s")


@dataclass(frozen=True)
class Domain:
    """One searched key: `kind` in KINDS and its values ([low, high] for ranges)."""

    kind: str
    values: tuple[Any, ...]

    def extremes(self) -> list[Any]:
        """The values that bound what a trial can get: both ends of a range, every listed value."""
        return list(self.values)

    def to_tune(self) -> Any:
        from ray import tune

        low, high = (self.values + (None,))[:2]
        if self.kind == "loguniform":
            return tune.loguniform(low, high)
        if self.kind == "uniform":
            return tune.uniform(low, high)
        if self.kind == "randint":
            return tune.randint(low, high + 1)  # Tune's upper bound is exclusive
        if self.kind == "choice":
            return tune.choice(list(self.values))
        return tune.grid_search(list(self.values))


def _flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Accept both `optim.lr: {...}` and `optim: {lr: {...}}` (what `--set tune.space.optim.lr.choice=[..]` builds)."""
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
        raise ValueError(f"search space '{key}' must be one of {{{': [..]}, {'.join(KINDS)}: [..]}}, got {spec!r}")
    kind, values = next(iter(spec.items()))
    if not isinstance(values, list) or not values:
        raise ValueError(f"search space '{key}': {kind} needs a non-empty list, got {values!r}")
    values = [_number(v) for v in values]
    if kind in LISTS:
        return Domain(kind, tuple(values))
    if len(values) != 2 or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ValueError(f"search space '{key}': {kind} needs [low, high] numbers, got {values!r}")
    low, high = values
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ValueError(f"search space '{key}': {kind} range [{low}, {high}] is empty or inverted: "
                         "low must be below high (for one value, set the key itself instead)")
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
    """Raise ValueError unless `key` names a config value (a leaf; any key of a section with extras, e.g. model)."""
    parts = key.split(".")
    if parts[0] in UNSEARCHABLE:
        raise ValueError(f"search space key '{key}': the '{parts[0]}' section is shared by the whole study "
                         "and cannot be searched")
    model: type[BaseModel] = root
    for depth, part in enumerate(parts):
        fields = model.model_fields
        prefix = "".join(f"{p}." for p in parts[:depth])
        if part not in fields:
            if model.model_config.get("extra") == "allow" and depth == len(parts) - 1:
                return  # a model kwarg: checked against the model's signature when a trial config is built
            raise ValueError(f"search space key '{key}' is not a config key{suggest(part, fields, prefix)}")
        inner = _unwrap(fields[part].annotation)
        is_section = isinstance(inner, type) and issubclass(inner, BaseModel)
        if depth == len(parts) - 1:
            if is_section:
                raise ValueError(f"search space key '{key}' is a section: name one of its keys, e.g. "
                                 f"'{key}.{next(iter(inner.model_fields))}'")
            return
        if not is_section:
            raise ValueError(f"search space key '{key}': '{prefix}{part}' is a value, not a section "
                             f"(a search space is {{kind: [..]}} with kind one of {', '.join(KINDS)})")
        model = inner


def parse_space(raw: dict[str, Any], root: type[BaseModel]) -> dict[str, dict[str, list[Any]]]:
    """Validate a `tune.space` mapping; returns it flat and normalised (plain data, as it is saved)."""
    space = {}
    for key, spec in _flatten(raw).items():
        check_key(key, root)
        domain = parse_domain(key, spec)
        space[key] = {domain.kind: list(domain.values)}
    return space


def domains(config: Config) -> dict[str, Domain]:
    return {key: parse_domain(key, spec) for key, spec in config.tune.space.items()}


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value  # numpy scalars from samplers


def user_tree(config: Config) -> dict[str, Any]:
    """Only what the user set (file + --set): derived values (micro-batch, accumulation) are derived again
    for each trial, so a searched `scaling.num_workers` does not clash with the base config's derivation."""
    return config.model_dump(mode="json", exclude_unset=True)


def apply_params(tree: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(tree)
    for dotted, value in params.items():
        node = out
        *sections, leaf = dotted.split(".")
        for key in sections:
            node = node.setdefault(key, {})
        node[leaf] = _plain(value)
    return out


def trial_config(tree: dict[str, Any], params: dict[str, Any]) -> Config:
    """The config one trial trains with: the user's tree with the sampled values set."""
    from orchestrator.config import config_from_dict

    return config_from_dict(apply_params(tree, params))


def resolved_mode(config: Config) -> str:
    t = config.tune
    return t.mode or ("max" if t.metric in _HIGHER_IS_BETTER else "min")


def check_study(config: Config) -> None:
    """Everything about the study that can be checked without data or Ray; raises ConfigError."""
    t = config.tune
    if not t.space:
        raise ConfigError("tune.space is empty: add the keys to search, e.g. "
                          "tune.space: {optim.lr: {loguniform: [1.0e-4, 1.0e-1]}}")
    reported = TRAIN_METRICS + (VAL_METRICS if config.data.val is not None else ())
    if t.metric not in reported:
        if t.metric in VAL_METRICS:
            raise ConfigError(f"tune.metric={t.metric} is only reported with a validation split: set data.val")
        raise ConfigError(f"tune.metric={t.metric} is never reported by the training loop"
                          f"{suggest(t.metric, reported, 'tune.metric=')}; reported: {', '.join(reported)}")
    found = domains(config)
    if t.searcher == "optuna" and any(d.kind == "grid" for d in found.values()):
        raise ConfigError("tune.space uses grid, which only the random searcher expands: use choice with "
                          "tune.searcher=optuna, or tune.searcher=random")
    if t.scheduler == "asha":
        budget = {"train.max_steps", "train.epochs"} & set(found)
        if budget:
            raise ConfigError(f"tune.space searches {', '.join(sorted(budget))}, but ASHA's budget is the training "
                              "length: fix it, or set tune.scheduler=fifo")
        if config.train.max_steps is not None and t.asha[0] >= config.train.max_steps:
            raise ConfigError(f"tune.grace_period={t.asha[0]} is not below train.max_steps="
                              f"{config.train.max_steps}: ASHA could never stop a trial early; lower it or set "
                              "tune.scheduler=fifo")
    tree = user_tree(config)
    for key, domain in found.items():
        for value in domain.extremes():
            try:
                trial_config(tree, {key: value})
            except ConfigError as exc:
                raise ConfigError(f"tune.space.{key}: a trial with {key}={value!r} would be invalid ({exc}); "
                                  "narrow the range") from None


def widest_trial(config: Config) -> Config:
    """The config of the trial that asks for the most CPUs (for sizing a local cluster and capacity checks)."""
    found = domains(config)
    params = {k: max(found[k].extremes()) for k in ("scaling.num_workers", "scaling.cpus_per_worker") if k in found}
    return trial_config(user_tree(config), params) if params else config


def trial_cpus(config: Config) -> float:
    s = widest_trial(config).scaling
    return s.max_workers * s.cpus_per_worker


def max_concurrent(config: Config, cluster_cpus: float) -> int:
    """tune.max_concurrent_trials, else as many trials as the CPUs hold with one CPU left for Ray Data's
    read tasks (ingest waits forever when workers hold every CPU)."""
    if config.tune.max_concurrent_trials is not None:
        return config.tune.max_concurrent_trials
    return max(1, int((cluster_cpus - 1) // trial_cpus(config)))


def check_capacity(config: Config, resources: dict[str, float]) -> None:
    """Refuse a study whose trials could never be scheduled on this cluster."""
    missing = widest_trial(config).scaling.shortfall(resources)
    if missing:
        raise ConfigError(f"a trial needs {missing}")
