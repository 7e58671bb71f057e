"""Driver side of `orchestrator tune` (the study): a Ray Tune study of training runs.

The study is named from the experiment (`<experiment>-tune`) and lives at `<storage.path>/<study>`:
running the same command again continues it (Tuner.restore) unless `fresh`. Each trial is a Tune
function trainable: a one-worker trial trains in the trial's own process (trial.py: no worker group
to start per trial); a wider one builds and fits its own TorchTrainer and hands rank 0's metrics to
Tune (the Train V2 pattern; `Tuner(TorchTrainer)` is not supported). MLflow holds one parent run per
study and one child run per trial (see trials.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.cluster.local import connect_ray, outside_job_package, shutdown_local_ray
from orchestrator.config import Config
from orchestrator.errors import ConfigError, UserError
from orchestrator.report.console import LOG_FILE, RunLog
from orchestrator.run.place import RunPlace
from orchestrator.run.trainer import storage_args
from orchestrator.tracking.context import config_params
from orchestrator.tracking.tracker import Tracker, closed_on_error, start_tracker
from orchestrator.tracking.uri import mask_passwords
from orchestrator.tuning.autopilot import record_study_choice, study_board
from orchestrator.tuning.plan import StudyPlan, TrialPlanner, plan_study, plan_trial
from orchestrator.tuning.results import TuneResult, local_dir, pick_best, record, summaries
from orchestrator.tuning.search import (
    TrialNamer,
    check_capacity,
    domains,
    max_concurrent,
    ranks_per_node,
    to_tune,
)
from orchestrator.tuning.trial import in_trial_process, run_trial, trial_resources
from orchestrator.tuning.trials import ParentRun, StudyCallback, StudyFacts, restored_as
from pipelines.storage import Storage

STATE_FILE = "orchestrator-study.json"


@dataclass(frozen=True)
class _Study:
    """One study: its plan (plan.py), and how this command carries it out: `verbose`, on a cluster
    it started itself (`private_cluster`), since `began` (epoch seconds)."""

    plan: StudyPlan
    verbose: bool
    private_cluster: bool
    began: float


def _trials(study: RunPlace) -> Storage:
    """Where the trials' Train runs live: beside the Tune experiment, on the same storage."""
    return study.storage.below(f"{study.name}-trials")


# ---- the study on storage: where it is, whether it can be resumed, what it was started with ----

def _delete(storage: Storage, path: str) -> None:
    import pyarrow.fs

    fs = storage.filesystem()
    if fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound:
        fs.delete_dir(path)


def _fingerprint(config: Config) -> dict[str, Any]:
    """The config as the study's state keeps it in storage (often a shared bucket): the password of
    every URI in it masked (tracking.uri, data.s3.endpoint, ...), so a rotated password continues
    the same study."""
    return dict(mask_passwords(config.dotted))


def _check_same_study(state: dict[str, Any], config: Config, study: str, study_path: str) -> None:
    # masked too: an older state's
    old, new = mask_passwords(state.get("config", {})), _fingerprint(config)
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if changed:
        raise ConfigError(f"study '{study}' at {study_path} was started with a different config "
                          f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} "
                          "differ): pass --fresh to start it over, or set a new experiment name")


# ---- building and running the Tuner ----

def _scheduler(config: Config, max_steps: int) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    t = config.tune
    if t.scheduler != "asha":
        return FIFOScheduler()
    # time_attr=step (not Tune's iteration count): a trial resumed from its Train checkpoint keeps
    # its position.
    grace_period, reduction_factor = t.asha
    return ASHAScheduler(time_attr="step", max_t=max_steps, grace_period=grace_period,
                         reduction_factor=reduction_factor)


def _searcher(config: Config, concurrency: int) -> Any:
    """The search algorithm, holding the study to `concurrency` trials at once. The limit lives
    here, not in TuneConfig.max_concurrent_trials: Ray ignores that one (with a warning) when given
    a BasicVariantGenerator."""
    t = config.tune
    if t.searcher == "random":
        from ray.tune.search import BasicVariantGenerator

        # Counts a trial from its creation to its end (completed, stopped by ASHA or failed).
        return BasicVariantGenerator(random_state=t.seed, max_concurrent=concurrency)
    try:
        from ray.tune.search.optuna import OptunaSearch
    except ImportError:
        raise UserError("tune.searcher=optuna needs the optuna package: "
                        "pip install 'orchestrator[tune]'") from None

    class IntervalOptunaSearch(OptunaSearch):
        """Validation metrics come only at eval steps; Optuna's pruning reports need them, so skip
        the rest."""

        def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
            if self.metric in result:
                super().on_trial_result(trial_id, result)

    from ray.tune.search import ConcurrencyLimiter

    return ConcurrencyLimiter(IntervalOptunaSearch(seed=t.seed), max_concurrent=concurrency)


@dataclass(frozen=True)
class _TrialResources:
    """Tune's resource request for a trial, from its own plan (a searched scaling.* changes it): see
    trial.trial_resources. `trials`: with the data's sizes only, all that planning a trial needs."""

    trials: TrialPlanner

    def __call__(self, params: dict[str, Any]) -> Any:
        from ray.tune import PlacementGroupFactory

        return PlacementGroupFactory([trial_resources(plan_trial(self.trials, params).config)])


@dataclass(frozen=True)
class _TrialName:
    """Tune's trial_name_creator / trial_dirname_creator: the trial's searched values (its
    directory: the trial id first, unique even when two trials drew the same values). Pickled with
    the study, so Tuner.restore finds it."""

    namer: TrialNamer
    directory: bool = False

    def __call__(self, trial: Any) -> str:
        name = self.namer(trial.config)
        return f"{trial.trial_id}_{name}" if self.directory else name


@contextmanager
def _quiet_tune() -> Iterator[None]:
    """Ray Tune's console output off while it runs the study: the product prints its own trial
    table. Tune's default engine prints its configuration box and a TensorBoard hint even at
    verbose=0; its legacy engine (RAY_AIR_NEW_OUTPUT=0, read when fit() starts) prints nothing at
    verbose=0. Set for this process only and restored afterwards; a value the user exported wins."""
    name = "RAY_AIR_NEW_OUTPUT"
    saved = os.environ.get(name)
    if saved is None:
        os.environ[name] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)


@contextmanager
def _credentials_stay_home() -> Iterator[None]:
    """Stop Ray Tune from copying the driver's AWS_* credential variables into every trial actor's
    runtime_env (ray.tune.execution.class_cache), where each node's runtime-env agent logs them in
    plain text, the dashboard shows them and they stay frozen for the whole study (an STS/SSO token
    then expires mid-study). Trials, like every other process, resolve credentials from their own
    node's standard chain."""
    try:
        from ray.tune.execution import class_cache

        propagated: set[str] = class_cache.ENV_VARS_TO_PROPAGATE
    except (ImportError, AttributeError):  # a Ray that does not copy them
        yield
        return
    credentials = {name for name in propagated if name.startswith("AWS_")}
    propagated.difference_update(credentials)
    try:
        yield
    finally:
        propagated.update(credentials)


def _node_ranks(plan: StudyPlan, concurrency: int) -> int:
    """memory_plan.ranks_per_node for this study on this cluster: its widest trial on its largest
    node."""
    import ray

    widest = plan.widest.scaling
    node_cpus = max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")),
                    default=0.0)
    return ranks_per_node(concurrency, widest.max_workers, widest.cpus_per_worker, node_cpus)


def _fit(this: _Study, resume: bool, callback: StudyCallback, concurrency: int, node_ranks: int,
         shared_search: bool) -> Any:
    from ray import tune as ray_tune

    plan = this.plan
    config, place = plan.config, plan.place

    trainable = ray_tune.with_resources(
        ray_tune.with_parameters(run_trial, planner=plan.trials, trials=_trials(place),
                                 private_cluster=this.private_cluster, node_ranks=node_ranks,
                                 shared_search=place.name if shared_search else None),
        _TrialResources(plan.trials.sizes()),
    )
    storage = storage_args(place.storage)
    if resume:
        # Finished trials stay finished; unfinished ones restart and their Train runs resume from
        # checkpoints. Errored ones stay errored: the same config would fail the same way. The saved
        # callback (tuner.pkl) has its passwords masked: it becomes this command's `callback`.
        with restored_as(callback):
            restored = ray_tune.Tuner.restore(place.path, trainable, resume_unfinished=True,
                                              storage_filesystem=storage.get("storage_filesystem"))
        with _credentials_stay_home(), _quiet_tune():
            return restored.fit()
    t = config.tune
    namer, in_process = plan.namer, in_trial_process(plan.widest)
    tuner = ray_tune.Tuner(
        trainable,
        param_space={key: to_tune(domain) for key, domain in domains(config).items()},
        tune_config=ray_tune.TuneConfig(
            metric=t.metric, mode=plan.mode, num_samples=t.num_samples,
            scheduler=_scheduler(config, plan.max_steps), search_alg=_searcher(config, concurrency),
            trial_name_creator=_TrialName(namer),
            trial_dirname_creator=_TrialName(namer, directory=True),
            # Trials that train in their own process start the next trial in the same one when
            # theirs ends: imports and Ray Data's start paid once per actor, not per trial. A trial
            # stopped mid-interval whose thread does not reach its next report within Tune's 2 s
            # gets a fresh actor instead.
            reuse_actors=in_process,
        ),
        run_config=ray_tune.RunConfig(
            name=place.name, **storage, callbacks=[callback],
            verbose=0,  # the callback prints the trial table
            # What Ray Train's run config holds for a wider trial, for the trials that train in
            # their own process.
            checkpoint_config=ray_tune.CheckpointConfig(num_to_keep=config.checkpoint.keep),
            failure_config=ray_tune.FailureConfig(
                max_failures=config.failure.max_failures if in_process else 0),
        ),
    )
    with _credentials_stay_home(), _quiet_tune():
        return tuner.fit()


def tune(config: Config, address: str | None = None, fresh: bool = False, verbose: bool = True,
         show_logs: bool = False, started_at: float | None = None) -> TuneResult:
    """Run (or resume) the hyperparameter study described by `config.tune`. Bad input raises
    ConfigError before any trial starts; an interrupted study raises KeyboardInterrupt after saving
    its state. Ray's, Tune's and MLflow's own lines, and what the trials' workers print, go to the
    study's log file (console.py), and to the terminal too with `show_logs`. `started_at` (epoch
    seconds, the CLI passes its process start) is where the study's wall clock begins (its
    goodput)."""
    began = started_at or time.time()
    plan = plan_study(config)  # the study checked, its data inspected, where it lives
    # Validation metrics arrive only at eval steps; Tune would otherwise fail every report without
    # one. check_study has already made sure the loop reports the metric.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"

    # The run log's file opens once the study may write (_start_study): a study refused before then
    # writes none.
    # a Ray job's package: at ray.init
    with outside_job_package(plan.config.tracking), RunLog(show_logs) as log:
        started_ray = connect_ray(address, plan.widest)
        try:
            return _start_study(_Study(plan, verbose, started_ray, began), fresh, log)
        finally:
            if started_ray:
                shutdown_local_ray()


def _start_study(this: _Study, fresh: bool, log: RunLog) -> TuneResult:
    """On the cluster: the checks that need it, the study's state (new, or the saved one to
    continue), its parent MLflow run, then the study itself."""
    import ray
    from ray import tune as ray_tune

    config, place, verbose = this.plan.config, this.plan.place, this.verbose

    if config.tracking.enabled:
        # its loggers exist from here on, so the run log diverts them too
        import mlflow  # noqa: F401
    log.attach_ray()
    study = place.name
    resources = ray.cluster_resources()
    check_capacity(this.plan.widest, resources)
    at_once = max_concurrent(this.plan.widest, resources)
    concurrency = at_once.trials
    if fresh:
        _delete(place.storage, place.path)
        _delete(place.storage, _trials(place).root)
    log_path = local_dir(place) / LOG_FILE
    log.open(log_path)
    restorable = ray_tune.Tuner.can_restore(place.path,
                                            storage_args(place.storage).get("storage_filesystem"))
    state = place.read_record(STATE_FILE) if restorable else None
    if state is not None:
        _check_same_study(state, config, study, place.uri)
    tracker = start_tracker(config.tracking, study,
                            run_id=state.get("parent_run_id") if state else None,
                            tags={"orchestrator.study": study, "orchestrator.role": "study"},
                            # the best trial's headline figures (results.record)
                            headline=config.tune.metric)
    if state is None:
        # Ctrl+C or an error while the parent run is set up: never left RUNNING
        with closed_on_error(tracker):
            tracker.log_params(config_params(config, study=True))
            tracker.log_datasets(this.plan.trials.datasets or {})
            tracker.set_tags({"orchestrator.scheduler": config.tune.scheduler,
                              "orchestrator.searcher": config.tune.searcher,
                              "orchestrator.search_space": json.dumps(config.tune.space)})
            place.write_record({"config": _fingerprint(config), "parent_run_id": tracker.run_id},
                               STATE_FILE)
    if verbose:
        what = "resuming" if state else "starting"
        print(f"{what} study {study} at {place.uri}: {config.tune.num_samples} samples, "
              f"up to {concurrency} trials at once (bound by {at_once.bound}), scheduler "
              f"{config.tune.scheduler}, searcher {config.tune.searcher}", flush=True)
        print(f"Ray and MLflow logs: {log_path}", flush=True)
    board = study_board(config, place.name, (state or {}).get("autopilot"), verbose)
    try:
        return _run_study(this, state is not None, tracker, concurrency, log_path, board)
    finally:
        # its name is the study's: a study run again in this process opens its own
        if board is not None:
            ray.kill(board)


def _run_study(this: _Study, resumed: bool, tracker: Tracker, concurrency: int, log_path: Path,
               board: Any | None) -> TuneResult:
    plan = this.plan
    config, place = plan.config, plan.place
    metric, mode = config.tune.metric, plan.mode
    study, study_path = place.name, place.uri
    facts = StudyFacts(study, plan.trials, tuple(config.tune.space), metric, plan.max_steps,
                       shared_search=board is not None)
    parent = (ParentRun(config.tracking, tracker.run_id)
              if config.tracking.enabled and tracker.run_id is not None else None)
    callback = StudyCallback(facts, parent, this.verbose)
    with closed_on_error(tracker):
        grid = _fit(this, resumed, callback, concurrency, _node_ranks(plan, concurrency),
                    shared_search=board is not None)
        if board is not None:
            record_study_choice(board, place, STATE_FILE, tracker, this.verbose)
        trials = summaries(grid, plan.trials, metric, plan.namer)
    if any(t.status == "running" for t in trials):  # Tune caught Ctrl+C and saved the study
        tracker.finish("KILLED")
        print(f"study {study} interrupted: run the same "
              "command again to continue it", file=sys.stderr)
        raise KeyboardInterrupt
    best = pick_best(trials, mode, config.tune.rank_by)
    if best is None:
        tracker.finish("FAILED")
        errors = sorted({t.error for t in trials if t.error})
        raise UserError(f"no trial of study {study} reported {metric}"
                        + (f" ({len(errors)} distinct errors; the first: {errors[0]})"
                           if errors else "")
                        + f": see {log_path} and the trials' error files under {study_path}")
    result = record(plan, trials, best, tracker, resumed, this.began)
    tracker.finish("FINISHED")
    return result


