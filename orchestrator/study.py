"""Driver side of `orchestrator tune` (the study): a Ray Tune study whose every trial is a full Ray Train run.

The study is named from the experiment (`<experiment>-tune`) and lives at `<storage.path>/<study>`: running the
same command again continues it (Tuner.restore) unless `fresh`. Each trial is a Tune function trainable that builds
and fits its own TorchTrainer and hands rank 0's metrics to Tune (the Train V2 pattern; `Tuner(TorchTrainer)` is
not supported). MLflow holds one parent run per study and one child run per trial (see trials.py).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.cluster import connect_ray, shutdown_local_ray, train_environment
from orchestrator.config import Config, flatten, to_dict, to_yaml
from orchestrator.console import LOG_FILE, RunLog
from orchestrator.errors import ConfigError, UserError
from orchestrator.runs import RunPlace, open_run_storage
from orchestrator.search import (
    TrialNamer,
    check_capacity,
    check_extremes,
    check_study,
    domains,
    max_concurrent,
    peak_concurrency,
    resolved_mode,
    short_keys,
    to_tune,
    trial_config,
    user_tree,
    widest_trial,
)
from orchestrator.tracking import Tracker, closed_on_error, config_params, run_url, start_tracker, ui_command
from orchestrator.trainer import RunFailedError, build_run, resolve_for_data, root_cause, storage_args
from pipelines.datasets import inspect_datasets
from pipelines.sources import DatasetInfo
from pipelines.storage import Storage

STATE_FILE = "orchestrator-study.json"


@dataclass
class TrialSummary:
    """One trial as the study ended: status is completed | stopped (early, by ASHA) | error | running."""

    trial_id: str
    params: dict[str, Any]
    status: str
    steps: int
    metric: float | None
    history: list[dict[str, Any]] = field(default_factory=list)
    cost: Any = None  # orchestrator.cost.Ledger of the trial's run
    name: str = ""  # its searched values, `lr=3.2e-03,warmup=20` (search.TrialNamer); also its Tune trial name
    # When Ray Tune started the trial and when its last result reached the driver (epoch seconds, the driver's
    # clock): the trial's place among the study's concurrent trials. None where Tune recorded none.
    started_at: float | None = None
    ended_at: float | None = None
    error: str | None = None  # the first line of a failed trial's error

    @property
    def label(self) -> str:
        return self.name or self.trial_id

    @property
    def usd(self) -> float | None:
        return self.cost.usd if self.cost is not None else None


@dataclass
class TuneResult:
    """What `tune()` returns: the best trial, its ready-to-train config (also written to `best_config_path`)."""

    config: Config
    best: TrialSummary
    trials: list[TrialSummary]
    metric: str
    mode: str
    best_config_path: str
    study_path: str
    parent_run_id: str | None
    tracking_uri: str | None
    resumed: bool
    rank_by: str = "metric"
    cost: dict[str, float] = field(default_factory=dict)  # the study's cost/* metrics (summed over trials)


def study_name(config: Config) -> str:
    return f"{config.experiment}-tune"


def _trials(study: RunPlace) -> Storage:
    """Where the trials' Train runs live: beside the Tune experiment, on the same storage."""
    return study.storage.below(f"{study.name}-trials")


def _run_trial(params: dict[str, Any], *, tree: dict[str, Any], infos: dict[str, DatasetInfo],
               trials: Storage, private_cluster: bool) -> None:
    """The Tune trainable, run in the trial's actor: one TorchTrainer, fitted in a thread while this one hands
    rank 0's metrics to Tune as they arrive (they come straight from rank 0, not through Ray Train's report).

    Its Train run is named by the trial id under `trials`, so a trial restarted by a resumed study continues
    from its own latest checkpoint."""
    import threading

    import ray.train
    from ray import tune as ray_tune
    from ray.util.queue import Empty, Queue

    config = resolve_for_data(trial_config(tree, {**params, "storage.path": trials.uri}), infos)
    trial_id = ray_tune.get_context().get_trial_id()
    queue = Queue(actor_options={"num_cpus": 0})
    failed: list[BaseException] = []

    def fit() -> None:
        try:
            build_run(config, infos, RunPlace(trials, trial_id), [], queue).fit()
        except BaseException as exc:  # handed to the trial's thread, which raises it
            failed.append(exc)

    # This actor fits the trial's TorchTrainer: Ray passes the settings on from here.
    with train_environment(config, private_cluster):
        thread = threading.Thread(target=fit, name="orchestrator-trial-fit", daemon=True)
        thread.start()
        # Until fit() is done and its last metrics are in (the workers send theirs before they return).
        while thread.is_alive() or not queue.empty():
            try:
                ray_tune.report(queue.get(timeout=0.5))
            except Empty:
                continue
    if failed:
        if isinstance(failed[0], ray.train.TrainingFailedError):
            raise RunFailedError(f"trial {trial_id} failed: {root_cause(failed[0])}") from None
        raise failed[0]


def best_yaml(tree: dict[str, Any], params: dict[str, Any], header: str = "") -> str:
    """The full config with the best values, minus the tune section: `orchestrator train` takes it unchanged."""
    config = to_dict(trial_config(tree, params))
    config.pop("tune")
    return header + yaml.safe_dump(config, sort_keys=False)


# ---- the study on storage: where it is, whether it can be resumed, what it was started with ----

def _delete(storage: Storage, path: str) -> None:
    import pyarrow.fs

    fs = storage.filesystem()
    if fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound:
        fs.delete_dir(path)


def _fingerprint(config: Config) -> dict[str, Any]:
    return json.loads(json.dumps(flatten(to_dict(config)), default=str))


def _check_same_study(state: dict[str, Any], config: Config, study: str, study_path: str) -> None:
    old, new = state.get("config", {}), _fingerprint(config)
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if changed:
        raise ConfigError(f"study '{study}' at {study_path} was started with a different config "
                          f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} differ): pass --fresh "
                          "to start it over, or set a new experiment name")


# ---- building and running the Tuner ----

def _scheduler(config: Config, max_steps: int) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    t = config.tune
    if t.scheduler != "asha":
        return FIFOScheduler()
    # time_attr=step (not Tune's iteration count): a trial resumed from its Train checkpoint keeps its position.
    grace_period, reduction_factor = t.asha
    return ASHAScheduler(time_attr="step", max_t=max_steps, grace_period=grace_period,
                         reduction_factor=reduction_factor)


def _searcher(config: Config, concurrency: int) -> Any:
    """The search algorithm, holding the study to `concurrency` trials at once. The limit lives here, not in
    TuneConfig.max_concurrent_trials: Ray ignores that one (with a warning) when given a BasicVariantGenerator."""
    t = config.tune
    if t.searcher == "random":
        from ray.tune.search import BasicVariantGenerator

        # Counts a trial from its creation to its end (completed, stopped by ASHA or failed).
        return BasicVariantGenerator(random_state=t.seed, max_concurrent=concurrency)
    try:
        from ray.tune.search.optuna import OptunaSearch
    except ImportError:
        raise UserError("tune.searcher=optuna needs the optuna package: pip install 'orchestrator[tune]'") from None

    class IntervalOptunaSearch(OptunaSearch):
        """Validation metrics come only at eval steps; Optuna's pruning reports need them, so skip the rest."""

        def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
            if self.metric in result:
                super().on_trial_result(trial_id, result)

    from ray.tune.search import ConcurrencyLimiter

    return ConcurrencyLimiter(IntervalOptunaSearch(seed=t.seed), max_concurrent=concurrency)


@dataclass(frozen=True)
class _TrialName:
    """Tune's trial_name_creator / trial_dirname_creator: the trial's searched values (its directory: the trial id
    first, unique even when two trials drew the same values). Pickled with the study, so Tuner.restore finds it."""

    namer: TrialNamer
    directory: bool = False

    def __call__(self, trial: Any) -> str:
        name = self.namer(trial.config)
        return f"{trial.trial_id}_{name}" if self.directory else name


@contextmanager
def _quiet_tune() -> Iterator[None]:
    """Ray Tune's console output off while it runs the study: the product prints its own trial table. Tune's
    default engine prints its configuration box and a TensorBoard hint even at verbose=0; its legacy engine
    (RAY_AIR_NEW_OUTPUT=0, read when fit() starts) prints nothing at verbose=0. Set for this process only and
    restored afterwards; a value the user exported wins."""
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
    """Stop Ray Tune from copying the driver's AWS_* credential variables into every trial actor's runtime_env
    (ray.tune.execution.class_cache), where each node's runtime-env agent logs them in plain text, the dashboard
    shows them and they stay frozen for the whole study (an STS/SSO token then expires mid-study). Trials, like
    every other process, resolve credentials from their own node's standard chain."""
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


def _fit(config: Config, tree: dict[str, Any], infos: dict[str, DatasetInfo], max_steps: int, place: RunPlace,
         resume: bool, callback: Any, concurrency: int, private_cluster: bool) -> Any:
    from ray import tune as ray_tune

    trainable = ray_tune.with_resources(
        ray_tune.with_parameters(_run_trial, tree=tree, infos=infos, trials=_trials(place),
                                 private_cluster=private_cluster),
        {"cpu": 0.01},  # the trial's actor only waits on its TorchTrainer; {"cpu": 0} is refused
    )
    storage = storage_args(place.storage)
    if resume:
        # Finished trials stay finished; unfinished ones restart and their Train runs resume from checkpoints.
        # Errored ones stay errored: the same config would fail the same way.
        restored = ray_tune.Tuner.restore(place.path, trainable, resume_unfinished=True,
                                          storage_filesystem=storage.get("storage_filesystem"))
        with _credentials_stay_home(), _quiet_tune():
            return restored.fit()
    t = config.tune
    namer = TrialNamer.for_config(config)
    tuner = ray_tune.Tuner(
        trainable,
        param_space={key: to_tune(domain) for key, domain in domains(config).items()},
        tune_config=ray_tune.TuneConfig(
            metric=t.metric, mode=resolved_mode(config), num_samples=t.num_samples,
            scheduler=_scheduler(config, max_steps), search_alg=_searcher(config, concurrency),
            trial_name_creator=_TrialName(namer), trial_dirname_creator=_TrialName(namer, directory=True),
        ),
        run_config=ray_tune.RunConfig(
            name=place.name, **storage, callbacks=[callback],
            verbose=0,  # the callback prints the trial table
        ),
    )
    with _credentials_stay_home(), _quiet_tune():
        return tuner.fit()


def _tune_trials(grid: Any) -> dict[str, tuple[str, float | None, float | None]]:
    """trial path -> (trial id, started, last result) as Ray Tune recorded them (Trial.run_metadata, kept in the
    study's saved state). The ResultGrid's own trials: Ray has no public accessor for them; empty if that changes."""
    found: dict[str, tuple[str, float | None, float | None]] = {}
    for trial in getattr(getattr(grid, "_experiment_analysis", None), "trials", None) or []:
        meta = getattr(trial, "run_metadata", None)
        start, last = getattr(meta, "start_time", None), getattr(meta, "last_result_time", None)
        found[str(trial.path)] = (trial.trial_id, start, last if isinstance(last, float) and last > 0 else None)
    return found


def _error_line(error: BaseException | None) -> str | None:
    """A failed trial's error in one line: the trial's own exception, not Ray's wrapping and traceback."""
    if error is None:
        return None
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip()
    line = next((x.strip() for x in text.splitlines() if x.strip()), type(cause).__name__)
    return line if len(line) <= 200 else line[:197] + "..."


def _summaries(grid: Any, tree: dict[str, Any], infos: dict[str, DatasetInfo], metric: str,
               namer: TrialNamer | None = None) -> list[TrialSummary]:
    """One TrialSummary per trial of the ResultGrid; `namer` names them (default: by their params' keys)."""
    from orchestrator.cost import build_ledger, resolve_pricing
    from orchestrator.trials import trial_status

    tune_trials = _tune_trials(grid)
    trials = []
    for result in grid:
        last = dict(result.metrics or {})
        params = dict(result.config or {})
        resolved = resolve_for_data(trial_config(tree, params), infos)
        max_steps = resolved.train.max_steps or 0
        frame = result.metrics_dataframe
        history: list[dict[str, Any]] = []
        ledger = None
        if frame is not None and "step" in frame:
            # The trial's clock is Tune's time_total_s: from its actor's start, Train start-up included.
            # Priced from the trial's own config: a searched num_workers changes the nodes it held.
            rows = [{k: v for k, v in row.items() if v == v} for row in frame.to_dict("records")]
            wall = max((r.get("time_total_s", 0.0) for r in rows), default=0.0)
            ledger = build_ledger(rows, wall, resolve_pricing(resolved), elapsed_key="time_total_s")
        if frame is not None and "step" in frame:
            keep = [c for c in ("step", "train_loss", "val_loss", "val_accuracy", metric) if c in frame]
            history = [{k: v for k, v in row.items() if v == v} for row in frame[list(dict.fromkeys(keep))]
                       .to_dict("records")]  # v == v drops NaN (reports without eval)
        fallback_id = str(last.get("trial_id") or Path(result.path).name)
        trial_id, started, ended = tune_trials.get(str(result.path), (fallback_id, None, None))
        name = (namer or TrialNamer(tuple(short_keys(params).items())))(params)
        trials.append(TrialSummary(
            trial_id=trial_id, params=params,
            status=trial_status(last, max_steps, errored=result.error is not None),
            steps=int(last.get("step", 0)), metric=last.get(metric), history=history,
            cost=ledger, name=name, started_at=started, ended_at=ended, error=_error_line(result.error),
        ))
    return trials


def pick_best(trials: list[TrialSummary], mode: str, rank_by: str = "metric") -> TrialSummary | None:
    """Best final metric among trials that ran to the end (an early-stopped trial's value is from fewer steps);
    among all trials with a value when none completed. rank_by=metric_per_dollar: metric / the trial's $."""
    scored = [t for t in trials if t.metric is not None]
    if rank_by == "metric_per_dollar":
        scored = [t for t in scored if t.usd]
    pool = [t for t in scored if t.status == "completed"] or scored
    if not pool:
        return None
    if rank_by == "metric_per_dollar":
        return max(pool, key=lambda t: t.metric / t.usd)  # type: ignore[operator]
    return (max if mode == "max" else min)(pool, key=lambda t: t.metric)  # type: ignore[arg-type,return-value]


def check_rank_by(config: Config) -> None:
    """metric_per_dollar needs prices and a metric where more is better; raises ConfigError otherwise."""
    from orchestrator.search import resolved_mode

    if config.tune.rank_by != "metric_per_dollar":
        return
    if not config.cost.priced:
        raise ConfigError("tune.rank_by=metric_per_dollar needs prices: set cost.node_type (see "
                          "cluster/prices.yaml) or cost.price_per_hour")
    if resolved_mode(config) != "max":
        raise ConfigError(f"tune.rank_by=metric_per_dollar divides {config.tune.metric} by dollars, which only "
                          "makes sense for a metric to maximise: use a metric such as val_accuracy, or rank_by=metric")


def check_trials(config: Config, base: Config, infos: dict[str, DatasetInfo]) -> None:
    """What only the data decides (epochs -> steps; the warmup and ASHA's grace period against them) and each
    trial's own nodes and price, for every searched value at its extremes: fails here, not in a trial or after
    the study. `base` is `config` resolved for the data."""
    from orchestrator.cost import resolve_pricing

    steps, grace = base.train.max_steps or 0, config.tune.asha[0]
    # check_study compares a given train.max_steps; epochs make theirs here. Ray's ASHAScheduler would assert.
    if config.train.epochs is not None and config.tune.scheduler == "asha" and grace >= steps:
        raise ConfigError(f"tune.grace_period={grace} is not below the run's {steps} optimizer steps (train.epochs="
                          f"{config.train.epochs:g}): ASHA could never stop a trial early; lower it, train longer, "
                          "or set tune.scheduler=fifo")
    check_extremes(config, lambda trial: resolve_pricing(resolve_for_data(trial, infos)))


def tune(config: Config, address: str | None = None, fresh: bool = False, verbose: bool = True,
         show_logs: bool = False) -> TuneResult:
    """Run (or resume) the hyperparameter study described by `config.tune`. Bad input raises ConfigError
    before any trial starts; an interrupted study raises KeyboardInterrupt after saving its state. Ray's, Tune's
    and MLflow's own lines, and what the trials' workers print, go to the study's log file (console.py), and to
    the terminal too with `show_logs`."""
    from orchestrator.cost import resolve_pricing

    check_study(config)
    check_rank_by(config)
    infos = inspect_datasets(config.data, named=config.model.inputs is not None)
    base = resolve_for_data(config, infos)
    resolve_pricing(base)  # before any trial: an unknown node type is a config error
    tree = user_tree(config)
    check_trials(config, base, infos)
    study = study_name(config)
    place = RunPlace(open_run_storage(config), study)
    # Validation metrics arrive only at eval steps; Tune would otherwise fail every report without one.
    # check_study has already made sure the loop reports the metric.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"

    # The run log's file opens once the study may write (_start_study): a study refused before then writes none.
    with RunLog(show_logs) as log:
        started_ray = connect_ray(address, widest_trial(base))
        try:
            return _start_study(config, base, tree, infos, place, fresh, verbose, started_ray, log)
        finally:
            if started_ray:
                shutdown_local_ray()


def _start_study(config: Config, base: Config, tree: dict[str, Any], infos: dict[str, DatasetInfo],
                 place: RunPlace, fresh: bool, verbose: bool, started_ray: bool, log: RunLog) -> TuneResult:
    """On the cluster: the checks that need it, the study's state (new, or the saved one to continue), its parent
    MLflow run, then the study itself."""
    import ray
    from ray import tune as ray_tune

    if config.tracking.enabled:
        import mlflow  # noqa: F401 - its loggers exist from here on, so the run log diverts them too
    log.attach_ray()
    study = place.name
    resources = ray.cluster_resources()
    check_capacity(config, resources)
    at_once = max_concurrent(config, resources)
    concurrency = at_once.trials
    if fresh:
        _delete(place.storage, place.path)
        _delete(place.storage, _trials(place).root)
    log_path = _local_dir(place) / LOG_FILE
    log.open(log_path)
    restorable = ray_tune.Tuner.can_restore(place.path, storage_args(place.storage).get("storage_filesystem"))
    state = place.read_record(STATE_FILE) if restorable else None
    if state is not None:
        _check_same_study(state, config, study, place.uri)
    tracker = start_tracker(config.tracking, study, run_id=state.get("parent_run_id") if state else None,
                            tags={"orchestrator.study": study, "orchestrator.role": "study"})
    if state is None:
        with closed_on_error(tracker):  # Ctrl+C or an error while the parent run is set up: never left RUNNING
            tracker.log_params(config_params(config))
            tracker.set_tags({"orchestrator.scheduler": config.tune.scheduler,
                              "orchestrator.searcher": config.tune.searcher,
                              "orchestrator.search_space": json.dumps(config.tune.space)})
            place.write_record({"config": _fingerprint(config), "parent_run_id": tracker.run_id}, STATE_FILE)
    if verbose:
        what = "resuming" if state else "starting"
        print(f"{what} study {study} at {place.uri}: {config.tune.num_samples} samples, up to {concurrency} "
              f"trials at once (bound by {at_once.bound}), scheduler {config.tune.scheduler}, searcher "
              f"{config.tune.searcher}", flush=True)
        print(f"Ray and MLflow logs: {log_path}", flush=True)
    return _run_study(config, base, tree, infos, place, state is not None, tracker, concurrency, verbose,
                      private_cluster=started_ray, log_path=log_path)


def _local_dir(place: RunPlace) -> Path:
    """Where the study's local files go (best.yaml, plots, the log): its directory, or for a study stored in S3
    ./<study> in the working directory."""
    return Path(place.path) if "://" not in place.uri else Path.cwd() / place.name


def _run_study(config: Config, base: Config, tree: dict[str, Any], infos: dict[str, DatasetInfo], place: RunPlace,
               resumed: bool, tracker: Tracker, concurrency: int, verbose: bool, private_cluster: bool,
               log_path: Path) -> TuneResult:
    from orchestrator.trials import StudyCallback

    metric, mode = config.tune.metric, resolved_mode(config)
    max_steps = base.train.max_steps or 0
    study, study_path = place.name, place.uri
    callback = StudyCallback(study, tree, list(config.tune.space), metric, max_steps,
                             config.tracking if config.tracking.enabled else None, tracker.run_id, verbose,
                             infos=infos)
    with closed_on_error(tracker):
        grid = _fit(config, tree, infos, max_steps, place, resumed, callback, concurrency, private_cluster)
        trials = _summaries(grid, tree, infos, metric, TrialNamer.for_config(config))
    if any(t.status == "running" for t in trials):  # Tune caught Ctrl+C and saved the study
        tracker.finish("KILLED")
        print(f"study {study} interrupted: run the same command again to continue it", file=sys.stderr)
        raise KeyboardInterrupt
    best = pick_best(trials, mode, config.tune.rank_by)
    if best is None:
        tracker.finish("FAILED")
        errors = sorted({t.error for t in trials if t.error})
        raise UserError(f"no trial of study {study} reported {metric}"
                        + (f" ({len(errors)} distinct errors; the first: {errors[0]})" if errors else "")
                        + f": see {log_path} and the trials' error files under {study_path}")
    result = _record(config, tree, trials, best, metric, mode, place, tracker, resumed)
    tracker.finish("FINISHED")
    return result


def _record(config: Config, tree: dict[str, Any], trials: list[TrialSummary], best: TrialSummary, metric: str,
            mode: str, place: RunPlace, tracker: Tracker, resumed: bool) -> TuneResult:
    """best.yaml, plots and the best trial on the parent run."""
    from orchestrator.plots import plot_lr_sweep, plot_trial_curves

    study, study_path = place.name, place.uri
    values = ", ".join(f"{k}={v}" for k, v in best.params.items())
    header = (f"# Best of study {study}: trial {best.trial_id} ({best.label}), {metric}={best.metric:.4f} with "
              f"{values}.\n# Train it: orchestrator train --config <this file>\n")
    out = _local_dir(place)
    out.mkdir(parents=True, exist_ok=True)
    best_path = out / "best.yaml"
    best_path.write_text(best_yaml(tree, best.params, header))
    keys = list(config.tune.space)
    listed = {key for key, domain in domains(config).items() if domain.kind in ("choice", "grid")}
    plots = [plot_lr_sweep(trials, keys, metric, out / "metric_vs_lr.png", categorical=listed),
             plot_trial_curves(trials, metric, out / "learning_curves.png")]
    tracker.log_artifact(best_path)
    for plot in plots:
        tracker.log_artifact(plot, "plots")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "study.yaml").write_text(to_yaml(config))
        tracker.log_artifact(Path(tmp) / "study.yaml")
    from orchestrator.cost import study_metrics

    cost = study_metrics([t.cost for t in trials if t.cost is not None])
    tracker.log_metrics({f"best_{metric}": best.metric or 0.0,
                         **{f"trials_{s}": sum(t.status == s for t in trials)
                            for s in ("completed", "stopped", "error")}, **cost}, step=best.steps)
    tracker.set_tags({"orchestrator.best_trial": best.trial_id, "orchestrator.best_params": json.dumps(best.params),
                      "orchestrator.best_config": str(best_path)})
    return TuneResult(
        config=trial_config(tree, best.params), best=best, trials=trials, metric=metric, mode=mode,
        best_config_path=str(best_path), study_path=study_path, parent_run_id=tracker.run_id,
        tracking_uri=getattr(tracker, "uri", None), resumed=resumed, rank_by=config.tune.rank_by, cost=cost,
    )


def summary(result: TuneResult) -> str:
    """The lines printed after a study: the table, the best trial, and how to train it."""
    from orchestrator.trials import format_table

    # Trials by name (their searched values), then the id that finds their directory and MLflow run.
    rows = [{"trial_id": t.label, "status": t.status, "params": {"id": t.trial_id}, "step": t.steps,
             "metric": t.metric, "usd": t.usd} for t in result.trials]
    counts = {s: sum(t.status == s for t in result.trials) for s in ("completed", "stopped", "error")}
    spans = [(t.started_at, t.ended_at) for t in result.trials if t.started_at is not None and t.ended_at is not None]
    at_once = f" (at most {peak_concurrency(spans)} at once)" if spans else ""
    b = result.best
    lines = [format_table(rows, ["id"], result.metric), "",
             f"study {Path(result.study_path).name}{' (resumed)' if result.resumed else ''}: {len(result.trials)} "
             f"trials{at_once}, {counts['completed']} completed, {counts['stopped']} stopped early, "
             f"{counts['error']} failed",
             *[f"trial {t.label} ({t.trial_id}) failed: {t.error}" for t in result.trials if t.error],
             f"best trial {b.label} ({b.trial_id}): {result.metric} {b.metric:.4f} at step {b.steps} with "
             + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in b.params.items()),
             *([f"ranked by {result.metric} per dollar: {b.metric / b.usd:.4g} per $ (${b.usd:.4f})"]
               if result.rank_by == "metric_per_dollar" and b.usd else []),
             *([study_cost_line(result.cost)] if result.cost else []),
             f"best config: {result.best_config_path}",
             f"train it: orchestrator train --config {result.best_config_path}"]
    if result.parent_run_id:
        lines.append(f"MLflow parent run id: {result.parent_run_id}")
        lines.append(f"open the MLflow UI: {ui_command(result.tracking_uri or '')}")
        url = run_url(result.tracking_uri or "", result.parent_run_id)
        if url:
            lines.append(f"this run in the MLflow UI: {url}")
    return "\n".join(lines)


def _share(frac: float) -> str:
    """A share as the summary prints it: whole percents, one decimal below 10%, '<0.1%' for a sliver."""
    if 0 < frac < 0.001:
        return "<0.1%"
    return f"{frac:.1%}" if frac < 0.1 else f"{frac:.0%}"


def study_cost_line(cost: dict[str, float]) -> str:
    """'study cost: $0.0421 over 4 trials, 0.0210 node-hours | productive 38% | start-up 51% | eval 9.0% | ...':
    the trials' node-hours split as their cost ledgers split them (compute + sync is productive); every other part
    of at least 0.5% follows, largest first, so a small productive share comes with what took the time."""
    from orchestrator.cost import PARTS, PRODUCTIVE

    usd = f"${cost['cost/usd']:.4f}" if "cost/usd" in cost else "unpriced"
    head = f"study cost: {usd} over {cost['cost/trials']:.0f} trials, {cost['cost/node_hours']:.4f} node-hours"
    if "cost/productive_frac" not in cost:
        return f"{head} | productive share unknown: no trial ran long enough to report its timings"
    others = sorted((cost.get(f"cost/{p}_frac", 0.0), p) for p in PARTS if p not in PRODUCTIVE)
    shares = [f"{p.replace('startup', 'start-up').replace('_', ' ')} {_share(f)}" for f, p in reversed(others)
              if f >= 0.005]
    return " | ".join([head, f"productive {_share(cost['cost/productive_frac'])}", *shares])
