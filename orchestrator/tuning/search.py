"""A study's search over its space (grammar in space.py): checks that run before any trial starts,
the config each trial trains with, and how many trials fit the cluster. Pure Python: Ray Tune is
imported only by `to_tune`."""

from __future__ import annotations

import copy
import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from orchestrator.config import USER_TASK, Config, config_from_dict, suggest
from orchestrator.config.space import Domain, parse_domain
from orchestrator.errors import ConfigError
from orchestrator.run.model_checks import check_model_options

# What training/loop.py reports (`_interval_metrics` every log_every steps, `evaluate` at eval
# steps); tests/unit/tuning/test_search.py runs the loop and fails if this drifts.
TRAIN_METRICS = ("step", "epoch", "samples_seen", "train_loss", "lr", "grad_norm", "samples_per_s",
                 "train_samples_per_s", "data_wait_frac", "skipped_steps", "world_size")
_HIGHER_IS_BETTER = ("val_accuracy", "val_top5_accuracy", "val_f1", "val_r2", "samples_per_s")


def val_metrics(config: Config) -> tuple[str, ...]:
    """What the run's task reports at validation (a user's task: at least val_loss)."""
    return (config.task.kind or USER_TASK).metrics


def to_tune(domain: Domain) -> Any:
    """Ray Tune's sampler for a domain."""
    from ray import tune

    low, high = (domain.values + (None,))[:2]
    if domain.kind == "loguniform":
        return tune.loguniform(low, high)
    if domain.kind == "uniform":
        return tune.uniform(low, high)
    if domain.kind == "randint":
        return tune.randint(low, high + 1)  # Tune's upper bound is exclusive
    if domain.kind == "choice":
        return tune.choice(list(domain.values))
    return tune.grid_search(list(domain.values))


def domains(config: Config) -> dict[str, Domain]:
    return {key: parse_domain(key, spec) for key, spec in config.tune.space.items()}


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value  # numpy scalars from samplers


def user_tree(config: Config) -> dict[str, Any]:
    """Only what the user set (file + --set): derived values (micro-batch, accumulation) are derived
    again for each trial, so a searched `scaling.num_workers` does not clash with the base config's
    derivation."""
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
    reported = TRAIN_METRICS + (val_metrics(config) if config.data.val is not None else ())
    if t.metric not in reported and config.task.kind is not None:  # a user's task may report more
        if t.metric in val_metrics(config):
            raise ConfigError(f"tune.metric={t.metric} is only reported "
                              "with a validation split: set data.val")
        raise ConfigError(f"tune.metric={t.metric} is never reported by the training "
                          f"loop{suggest(t.metric, reported, 'tune.metric=')}; "
                          f"reported: {', '.join(reported)}")
    found = domains(config)
    if t.searcher == "optuna" and any(d.kind == "grid" for d in found.values()):
        raise ConfigError("tune.space uses grid, which only the random searcher expands: "
                          "use choice with tune.searcher=optuna, or tune.searcher=random")
    if t.scheduler == "asha":
        budget = {"train.max_steps", "train.epochs"} & set(found)
        if budget:
            raise ConfigError(f"tune.space searches {', '.join(sorted(budget))}, but ASHA's "
                              "budget is the training length: fix it, or set tune.scheduler=fifo")
        if config.train.max_steps is not None and t.asha[0] >= config.train.max_steps:
            raise ConfigError(f"tune.grace_period={t.asha[0]} is not below "
                              f"train.max_steps={config.train.max_steps}: ASHA could never "
                              "stop a trial early; lower it or set tune.scheduler=fifo")

    tree = user_tree(config)
    check_extremes(config, lambda params: check_model_options(trial_config(tree, params).model))


def check_extremes(config: Config, check: Callable[[dict[str, Any]], object]) -> None:
    """`check` on the sampled values of a trial at each end of every searched range (at every listed
    value); a ConfigError from it (building that trial's config, planning it) names the searched key
    and value."""
    for key, domain in domains(config).items():
        for value in domain.extremes():
            try:
                check({key: value})
            except ConfigError as exc:
                raise ConfigError(f"tune.space.{key}: a trial with {key}={value!r} would "
                                  f"be invalid ({exc}); narrow the range") from None


def widest_trial(config: Config) -> Config:
    """The config of the trial that asks for the most CPUs (for sizing a local cluster and capacity
    checks)."""
    found = domains(config)
    params = {k: max(found[k].extremes())
              for k in ("scaling.num_workers", "scaling.cpus_per_worker") if k in found}
    return trial_config(user_tree(config), params) if params else config


@dataclass(frozen=True)
class Concurrency:
    """How many trials a study runs at once, and what holds it there (for the study's first
    line)."""

    trials: int
    bound: str


def max_concurrent(widest_config: Config, resources: dict[str, float]) -> Concurrency:
    """As many trials as the cluster's `resources` (ray.cluster_resources()) hold at once, at most
    tune.max_concurrent_trials: a trial started beyond that waits for its workers inside its own
    (billed) time. CPUs keep one for Ray Data's read tasks (ingest waits forever when workers hold
    every CPU); with scaling.use_gpu every worker takes one GPU (Ray's ScalingConfig). Sized, like
    check_capacity, for the widest trial's largest group (`widest_config`: the study's widest trial,
    widest_trial), so an elastic trial has room to grow."""
    config, widest = widest_config, widest_config.scaling
    per_trial = widest.max_workers * widest.cpus_per_worker
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    limits = []  # (trials, what bounds them), in the order a tie names them
    if config.tune.max_concurrent_trials is not None:
        limits.append((config.tune.max_concurrent_trials,
                       f"tune.max_concurrent_trials={config.tune.max_concurrent_trials}"))
    if widest.use_gpu:
        limits.append((int(gpus // widest.max_workers),
                       f"GPUs: {gpus:g} in the cluster, {widest.max_workers} per trial"))
    limits.append((int((cpus - 1) // per_trial), f"CPUs: {cpus:g} in the cluster, 1 kept "
                                                 f"for Ray Data, {per_trial:g} per trial"))
    trials, bound = min(limits, key=lambda limit: limit[0])
    return Concurrency(max(1, trials), bound)


def ranks_per_node(trials_at_once: int, workers: int, cpus_per_worker: float,
                   node_cpus: float) -> int:
    """Training ranks of a study that may share one node's memory at once: the trials it runs at
    once times each trial's workers, at most as many as the node's CPUs hold (each rank holds
    `cpus_per_worker` of them). A one-worker trial that trains in its own process has no
    LOCAL_WORLD_SIZE, and a wider trial's counts only its own run: what
    `train.micro_batch_size=auto` divides a CPU node's memory by in a study."""
    at_once = trials_at_once * workers
    fit = int(node_cpus // cpus_per_worker) if cpus_per_worker > 0 else at_once
    return max(1, min(at_once, fit))


# Trial names: the last part of a searched key, or a shorter word for the long ones people search
# often.
_SHORT = {"warmup_steps": "warmup", "weight_decay": "wd", "num_workers": "workers",
          "cpus_per_worker": "cpus", "global_batch_size": "batch",
          "micro_batch_size": "micro_batch", "max_grad_norm": "clip"}
# a name is a directory and a legend entry: nothing else in a value
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")
MAX_NAME = 64


def short_keys(keys: Iterable[str]) -> dict[str, str]:
    """`optim.lr` -> `lr`, `optim.warmup_steps` -> `warmup`; keys whose short forms clash keep their
    dotted form."""
    keys = list(keys)
    leaf = {k: _SHORT.get(k.rsplit(".", 1)[-1], k.rsplit(".", 1)[-1]) for k in keys}
    counts = Counter(leaf.values())
    return {k: v if counts[v] == 1 else k for k, v in leaf.items()}


@dataclass(frozen=True)
class TrialNamer:
    """Names a trial by its searched values, `lr=3.2e-03,warmup=20`: short, readable in a table, a
    plot legend or an MLflow run list, and safe as a directory name (local, S3, Windows). Values of
    keys searched on a log scale are always in scientific notation, so names of one study line up.
    Picklable: Tune keeps it with the study."""

    keys: tuple[tuple[str, str], ...]  # (searched key, its short name), in the order of tune.space
    scientific: frozenset[str] = frozenset()

    @classmethod
    def for_config(cls, config: Config) -> TrialNamer:
        found = domains(config)
        return cls(tuple(short_keys(found).items()),
                   frozenset(k for k, d in found.items() if d.kind == "loguniform"))

    def __call__(self, params: dict[str, Any]) -> str:
        name = ",".join(f"{short}={self._value(key, params.get(key))}"
                        for key, short in self.keys if key in params)
        if len(name) > MAX_NAME:  # still unique: the cut is replaced by a hash of the whole
            name = f"{name[:MAX_NAME - 9]}~{hashlib.sha1(name.encode()).hexdigest()[:8]}"
        return name

    def _value(self, key: str, value: Any) -> str:
        value = _plain(value)
        if isinstance(value, bool) or value is None:
            text = str(value).lower()
        elif isinstance(value, float):
            text = f"{value:.1e}" if key in self.scientific else f"{value:.3g}"
        elif isinstance(value, list | tuple):
            text = "x".join(self._value(key, v) for v in value) or "none"
        else:
            text = str(value)
        return _UNSAFE.sub("-", text).strip("-") or "-"


def peak_concurrency(spans: Iterable[tuple[float, float]]) -> int:
    """The most (start, end) spans open at one instant; a span ending when another starts does not
    overlap it."""
    events = sorted((t, step) for start, end in spans for t, step in ((start, 1), (end, -1)))
    peak = running = 0
    # at equal times -1 sorts first: an end frees its place before a start takes it
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def check_capacity(widest: Config, resources: dict[str, float]) -> None:
    """Refuse a study whose trials could never be scheduled on this cluster (`widest`: its widest
    trial, widest_trial)."""
    missing = widest.scaling.shortfall(resources)
    if missing:
        raise ConfigError(f"a trial needs {missing}")
