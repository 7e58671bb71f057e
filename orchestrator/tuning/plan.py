"""The plan of a study, made once before any cluster resource is taken, and the plan of each of its
trials.

`plan_study` checks the study (its space, its ranking, every searched value at its extremes),
inspects the data once and finds where the study lives; `plan_trial` plans one trial from the
study's plan and the trial's sampled values, through the function that plans `train`'s config
(run/plan.py `plan_config`). The study (study.py), Tune's resource request, the trial's actor
(trial.py), its cost ledger (trials.py) and the summary (results.py) carry these plans out: none of
them resolves a config for the data again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from orchestrator.config import Config
from orchestrator.errors import ConfigError
from orchestrator.report.cost import resolve_pricing
from orchestrator.run.place import RunPlace
from orchestrator.run.plan import ConfigPlan, plan_config
from orchestrator.tracking.uri import mask_passwords
from orchestrator.tuning.search import (
    TrialNamer,
    check_extremes,
    check_study,
    resolved_mode,
    trial_config,
    user_tree,
    widest_trial,
)
from pipelines.datasets import inspect_run
from pipelines.sources import DatasetInfo


def study_name(config: Config) -> str:
    return f"{config.experiment}-tune"


@dataclass(frozen=True)
class TrialPlanner:
    """What each trial's plan is made from: the user's tree of the study's config (only what the
    user set: derived values are derived again for each trial, so a searched scaling.num_workers
    does not clash with the study's derivation) and the data's facts (None: none given, and no trial
    is priced)."""

    tree: dict[str, Any]
    datasets: Mapping[str, DatasetInfo] | None = None

    def sizes(self) -> TrialPlanner:
        """The data's sizes only, all that planning a trial needs on the driver: what is pickled
        into the study's saved state (Tune's resource request, the callback), which has no use for
        shard lists or storage handles."""
        if self.datasets is None:
            return self
        sizes_only = {split: replace(info, files=[], storage=None, objects=[], file_rows=[])
                      for split, info in self.datasets.items()}
        return replace(self, datasets=sizes_only)

    def masked(self) -> TrialPlanner:
        """The tree with the password of every URI in it masked (the study's saved state is often in
        a bucket)."""
        return replace(self, tree=mask_passwords(self.tree))


def plan_trial(planner: TrialPlanner, params: dict[str, Any]) -> ConfigPlan:
    """One trial's plan: the user's tree with its sampled values (`params`: dotted keys), decided
    against the study's data as `train` decides its config (its model checked, its classes and
    steps, its memory, its price)."""
    if planner.datasets is None:
        raise ValueError("a trial is planned on the study's data: this planner was given none")
    return plan_config(trial_config(planner.tree, params), planner.datasets)


@dataclass(frozen=True)
class StudyPlan:
    """One study, decided: its config as given (its tune section), resolved for the data (`base`),
    what its trials are planned from, where it lives, its widest trial (the local cluster's size,
    the capacity checks), how trials are named and which way its metric goes."""

    config: Config
    base: ConfigPlan
    trials: TrialPlanner  # the data's full facts: a trial's actor trains on them
    place: RunPlace
    widest: Config  # search.widest_trial
    namer: TrialNamer
    mode: str  # max | min

    @property
    def max_steps(self) -> int:
        return self.base.config.train.max_steps or 0


def check_rank_by(config: Config) -> None:
    """metric_per_dollar needs prices and a metric where more is better; raises ConfigError
    otherwise."""
    if config.tune.rank_by != "metric_per_dollar":
        return
    if resolve_pricing(config).usd_per_node_hour is None:  # e.g. CPU trials on a GPU node type
        raise ConfigError("tune.rank_by=metric_per_dollar needs prices: set cost.node_type (see "
                          "cluster/prices.yaml) or cost.price_per_hour")
    if resolved_mode(config) != "max":
        raise ConfigError(f"tune.rank_by=metric_per_dollar divides {config.tune.metric} "
                          "by dollars, which only makes sense for a metric to maximise: "
                          "use a metric such as val_accuracy, or rank_by=metric")


def check_trials(config: Config, base: Config, trials: TrialPlanner) -> None:
    """What only the data decides (epochs -> steps; the warmup and ASHA's grace period against them)
    and each trial's own nodes and price, for every searched value at its extremes: fails here, not
    in a trial or after the study. `base` is `config` resolved for the data."""
    steps, grace = base.train.max_steps or 0, config.tune.asha[0]
    # check_study compares a given train.max_steps; epochs make theirs here. Ray's ASHAScheduler
    # would assert.
    if config.train.epochs is not None and config.tune.scheduler == "asha" and grace >= steps:
        raise ConfigError(f"tune.grace_period={grace} is not below the run's {steps} optimizer "
                          f"steps (train.epochs={config.train.epochs:g}): ASHA could never stop "
                          "a trial early; lower it, train longer, or set tune.scheduler=fifo")
    check_extremes(config, lambda params: plan_trial(trials, params).pricing)


def plan_study(config: Config) -> StudyPlan:
    """Check the study and plan it: its space, its ranking, the data (inspected once, for the study
    and every trial), its config resolved for them and priced, every searched value at its extremes
    planned as a trial; raises UserError subclasses on bad input, before any cluster resource is
    taken."""
    check_study(config)
    check_rank_by(config)
    data = inspect_run(config.data, config.model.inputs is not None, config.storage.path)
    base = plan_config(config, data.datasets, data.sample)
    base.pricing  # noqa: B018 - before any trial: an unknown node type is a config error
    trials = TrialPlanner(user_tree(config), data.datasets)
    check_trials(config, base.config, trials)
    # The widest trial from the user's tree, not the resolved one's: that one holds the micro-batch
    # the study's own worker count derived, which a searched scaling.num_workers would contradict.
    return StudyPlan(config, base, trials, RunPlace(data.run_storage, study_name(config)),
                     widest_trial(config), TrialNamer.for_config(config), resolved_mode(config))
