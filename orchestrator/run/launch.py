"""`orchestrator train` on the driver: plan the run once (plan.py: the config checked against the
data, the model, prices and storage), then run that plan: join or start Ray (cluster/local.py),
build and fit the run (trainer.py), show progress, track it in MLflow and bill it. Nothing here
reads the config's raw form or the data's files again."""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrator.cluster.local import (
    connect_cluster,
    outside_job_package,
    report_channel,
    shutdown_local_ray,
    train_environment,
)
from orchestrator.config import Config, to_yaml
from orchestrator.errors import ConfigError
from orchestrator.report.autopilot import achieved_figures
from orchestrator.report.console import LOG_FILE, RunLog
from orchestrator.report.cost import (
    attempt_record,
    build_ledger,
    largest_world,
    ledger_across_attempts,
)
from orchestrator.report.handlers import (
    AutopilotTable,
    Console,
    FailureCounter,
    RunReports,
    checkpoint_uri,
)
from orchestrator.report.plots import plot_history
from orchestrator.report.progress import ProgressLines, ReportConsumer
from orchestrator.report.startup import StartupClock
from orchestrator.run.alongside import Alongside, ended_on_error
from orchestrator.run.ending import EndWarmUp
from orchestrator.run.fencing import claim_run, refuse_if_newer
from orchestrator.run.interrupts import Doomed, fit_interruptibly, interrupted, stop_at_next_report
from orchestrator.run.place import AttemptLog, RunPlace
from orchestrator.run.plan import RunPlan, plan_run
from orchestrator.run.result import TrainResult, finished_result, run_summary
from orchestrator.run.trainer import RunFailedError, build_inputs, build_trainer, root_cause
from orchestrator.tracking.context import config_params
from orchestrator.tracking.flavour import checkpoint_weights, log_final_model
from orchestrator.tracking.tracker import (
    FencedTracker,
    Tracker,
    closed_on_error,
    direct,
    start_tracker,
)
from orchestrator.tracking.uri import mask_password
from orchestrator.training.channel import ReportChannel
from orchestrator.training.fence import Fence
from orchestrator.training.handoff import WorkerSpec
from orchestrator.training.stop import STOP_FILE
from pipelines.config import is_remote
from pipelines.sources import DatasetInfo
from pipelines.storage import user_cache_dir


def _log_final_artifacts(tracker: Tracker, config: Config, checkpoint_path: str | None,
                         history: list[dict[str, Any]], info: DatasetInfo,
                         checkpoint: Any = None) -> None:
    """The resolved config, the final weights as an MLflow Model named "model" (tracking/flavour.py;
    `info`: the training data, whose sample rows give its input example and signature) and the
    learning curves (top level: the first file the run's Artifacts tab lists after the model)."""
    with tempfile.TemporaryDirectory() as tmp:
        # no password of a URI
        (Path(tmp) / "config.yaml").write_text(mask_password(to_yaml(config)))
        tracker.log_artifact(Path(tmp) / "config.yaml")
        if checkpoint_path:
            from ray.train import Checkpoint

            # The Checkpoint itself when given: it carries its filesystem (an S3 endpoint; no
            # credentials).
            final = checkpoint or Checkpoint(checkpoint_path)

            def final_weights() -> dict[str, Any]:
                with final.as_directory() as directory:
                    # DDP's state.pt, or FSDP's shards put together
                    return checkpoint_weights(directory)

            log_final_model(direct(tracker), config, info, final_weights)
        if history:
            metric = (config.tune.metric if (config.tune.metric or "").startswith("val_")
                      else "val_loss")
            tracker.log_artifact(plot_history(history, Path(tmp) / "learning_curves.png", metric))


def train(config: Config, address: str | None = None, verbose: bool = True,
          resume: bool | str = False, started_at: float | None = None,
          show_logs: bool = False) -> TrainResult:
    """Run one distributed training job and return its result. Raises UserError subclasses on bad
    input. With `resume`, continue a run in storage (its Ray Train run from its latest checkpoint,
    and its MLflow run): True, the newest run of this experiment trained with this config (none: a
    new run), a run's name, or a run directory's path or s3:// URI; a finished run's result comes
    back as it was (`already_finished`), nothing run. `started_at` (epoch seconds, the
    CLI passes its process start) is where the start-up breakdown and the cost ledger's clock begin.
    Ray's and MLflow's own lines go to the run's log file (console.py), and to the terminal too with
    `show_logs`. Ctrl+C ends the MLflow run as KILLED and raises KeyboardInterrupt after saying how
    to continue."""
    clock = StartupClock(started_at or time.time())
    clock.mark("command")
    plan = plan_run(config, resume, verbose, address, clock)  # before any cluster resource is taken
    # nothing to train: no Ray, no MLflow write, no bill
    if plan.resume is not None and plan.resume.finished:
        return finished_result(plan.config, plan.place.uri, plan.resume.record,
                               plan.tracking_uri if plan.reopen_run_id else None)
    # One writer per run: this command's attempt number, before anything of the run is written
    # (run/fencing.py).
    fence = claim_run(plan.place)
    # a Ray job's driver leaves the package `ray.init` may delete
    with outside_job_package(plan.config.tracking):
        clock.mark("checks")
        with RunLog(show_logs) as log:
            return _train(plan, verbose, clock, log, fence)


def _open_tracking(plan: RunPlan, log: RunLog, verbose: bool,
                   fence: Fence | None = None) -> Tracker:
    """The MLflow run opened with its params, plan, datasets and tags, the run's directory, log file
    and record written. A run it opened and could not finish setting up ends FAILED (KILLED on
    KeyboardInterrupt). Its writes stop once a newer attempt of the run claimed it (`fence`): none
    at all if one already has."""
    config, place = plan.config, plan.place
    refuse_if_newer(fence, place, now=True)
    if config.tracking.enabled:
        # its loggers exist from here on: diverted before the store logs its set-up
        import mlflow  # noqa: F401

        log.divert()
    tracker = start_tracker(config.tracking, plan.run_name, run_id=plan.reopen_run_id,
                            headline=config.tune.metric,
                            # the store as planned
                            context=dict(plan.context), uri=plan.tracking_uri)
    with closed_on_error(tracker):
        if plan.resume is not None and plan.resume.record:
            tracker.set_tags({f"orchestrator.resume.{time.strftime('%Y%m%d-%H%M%S')}":
                              "driver restarted with --resume"})
        tracker.log_params(config_params(config))  # model options' builder defaults included
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "plan.yaml").write_text(plan.to_yaml())
            tracker.log_artifact(Path(tmp) / "plan.yaml")
        tracker.log_datasets(plan.datasets)
        tracker.set_tags({"orchestrator.run_dir": place.uri,
                          "orchestrator.train_rows": str(plan.datasets["train"].num_rows)})
        place.write_config(config)  # its password masked: run storage is often shared
        log.open(log_path := _log_path(config, place))  # the run's directory exists from here on
        if verbose:
            print(f"Ray and MLflow logs: {log_path}"
                  + ("" if log.verbose else " (--verbose shows them here)"), flush=True)
        masked_uri = mask_password(getattr(tracker, "uri", None) or "") or None
        place.write_record({"run_name": plan.run_name, "mlflow_run_id": tracker.run_id,
                            "tracking_uri": masked_uri})
    return tracker if fence is None else FencedTracker(tracker, fence)


def _log_path(config: Config, place: RunPlace) -> Path:
    """The run's log file: in its directory, or for a run stored in S3 a local file named after it,
    in this user's private cache (a shared temp path would let another user plant a link the log is
    written through)."""
    if is_remote(config.storage.path):
        return Path(user_cache_dir()) / "logs" / f"{place.name}.log"
    return Path(place.path) / LOG_FILE


@dataclass
class _Inputs:
    """What a run's TorchTrainer is built from: its report channel, the ranks' spec and its
    datasets."""

    channel: ReportChannel
    spec: WorkerSpec
    datasets: dict[str, Any]


def _start(plan: RunPlan, clock: StartupClock, log: RunLog, history: list[dict[str, Any]]
           ) -> tuple[bool, _Inputs]:
    """Ray joined or started here (Ray wants the main thread for its signal handlers, and Ctrl+C
    reaches only this one), then the run's datasets built. Returns whether this process started the
    cluster, and the run's inputs."""
    with interrupted(plan.place, history):  # Ctrl+C while Ray starts: nothing is opened yet
        started_ray = False
        try:
            # as planned: --address, $RAY_ADDRESS or a local one
            started_ray = connect_cluster(plan.cluster)
            clock.mark("ray start")
            log.attach_ray()
            inputs = _build_inputs(plan, started_ray, log)
            clock.mark("datasets")
        except BaseException:
            if started_ray:
                shutdown_local_ray()
            raise
    return started_ray, inputs


def _build_inputs(plan: RunPlan, started_ray: bool, log: RunLog) -> _Inputs:
    """The run's report channel, spec and datasets (Ray Data's pipelines; small data cached in the
    object store)."""
    import ray

    config = plan.config
    # A local cluster cannot grow: a worker group it can never hold would wait forever.
    missing = config.scaling.shortfall(ray.cluster_resources()) if started_ray else None
    if missing:
        raise ConfigError(f"this run needs {missing}")
    # Rank 0 sends its metrics to the driver itself (no barrier); the controller adds worker
    # failures.
    channel = report_channel()
    spec, datasets = build_inputs(config, plan.in_features, plan.datasets, plan.place.name,
                                  plan.resume.cache_decision if plan.resume else None,
                                  channel.sender)
    # a stop asked of an earlier attempt (Ctrl+C, then --resume) is not this one's
    plan.place.remove(STOP_FILE)
    spec = replace(spec, stop_request=(plan.place.storage, f"{plan.place.path}/{STOP_FILE}"))
    log.divert()  # Ray Data sets up its loggers on first use
    return _Inputs(channel, spec, datasets)


def _train(plan: RunPlan, verbose: bool, clock: StartupClock, log: RunLog,
           fence: Fence) -> TrainResult:
    config, place = plan.config, plan.place
    history: list[dict[str, Any]] = []
    attempt = AttemptLog(place, clock.started_at, fence.mine.number)
    started_ray, inputs = _start(plan, clock, log, history)
    # MLflow's run is opened while Ray Train starts the worker group (the driver only waits then);
    # the reports wait for it, the workers do not. From then on Ctrl+C ends it KILLED (an error
    # FAILED), never leaving it RUNNING.
    opening = Alongside(lambda: _open_tracking(plan, log, verbose, fence))
    warm_up = EndWarmUp(config)  # what the end loads, loaded while the run trains (run/ending.py)
    if warm_up.early:
        # Not while another thread imports what it does for the first time (a module two threads
        # import at once can come out half made): torch here, what building the trainer imports
        # next; MLflow in the opening.
        import ray.train.torch  # noqa: F401

        warm_up.start(after=lambda: opening.wait(None))
    with ended_on_error(opening), interrupted(place, history):
        stopping: threading.Thread | None = None
        try:
            with train_environment(config, private_cluster=started_ray):
                handle = _reports(plan, opening, verbose, clock, history, started_ray, attempt,
                                  warm_up)
                result, failures, checkpoint = _fit(plan, inputs, handle, opening, log, fence)
            tracker = opening.result()
            if started_ray:
                # The cluster's processes stopped (all of them, cluster/processes.py) while the
                # artifacts are logged.
                stopping = threading.Thread(target=shutdown_local_ray, name="ray-shutdown")
                stopping.start()
            warm_up.wait()
            _log_final_artifacts(tracker, config, result.checkpoint_path, history,
                                 plan.datasets["train"], checkpoint)
        finally:
            if stopping is not None:
                stopping.join()
            elif started_ray:
                shutdown_local_ray()
            # this attempt's final record; after a failure or Ctrl+C too
            attempt.save(history, force=True)
        # to now, Ray's shutdown included: the user's stopwatch
        _bill(plan, result, clock.started_at, failures)
        ledger = result.run_cost or result.cost
        logged = ledger.metrics() | {"cost/attempts": float(result.attempts)}
        tracker.log_metrics(logged, step=result.history[-1]["step"] if result.history else 0)
        refuse_if_newer(fence, place, now=True)  # the run's end is its newest attempt's to say
    tracker.finish("FINISHED")
    place.mark_finished(result.finished_record())
    return result


def _reports(plan: RunPlan, opening: Alongside, verbose: bool, clock: StartupClock,
             history: list[dict[str, Any]], private_cluster: bool, attempt: AttemptLog,
             warm_up: EndWarmUp) -> RunReports:
    """The driver's handlers of the run's reports (report/handlers.py), composed for this run."""
    config, t = plan.config, plan.config.train

    def tracker() -> Tracker:
        """The run's tracker, once MLflow's run is open (the first report waits for it; a failed
        opening is raised by the main thread)."""
        tracker = opening.result()
        if "tracking" not in clock.spans:
            clock.mark_beside("tracking", opening.began, opening.ended or time.time())
        return tracker

    lines = ProgressLines(t.max_steps or 0, t.global_batch_size,
                          t.eval_every if config.data.val is not None else None,
                          config.tune.metric or "")
    return RunReports(tracker, opening.failed, clock, history, attempt,
                      Console(verbose, lines, plan.datasets["train"].num_rows), config.storage.path,
                      first_step=warm_up.start, failures=FailureCounter(private_cluster),
                      autopilot=AutopilotTable(verbose))


def _fit(plan: RunPlan, inputs: _Inputs, handle: RunReports, opening: Alongside, log: RunLog,
         fence: Fence) -> tuple[TrainResult, int, Any]:
    """Fit the run while a driver thread hands each entry of its report channel to `handle` (the
    reports appended to its `history` as they come), and MLflow's run is `opening` in another: a
    failure to open it ends the run. Returns the result, how many worker failures Ray Train
    restarted from, and the final Ray Checkpoint. On a private cluster an error every restart would
    repeat ends the run at once (shutting the cluster down ends Ray Train's restarts too)."""
    import ray.train

    from orchestrator.report.callbacks import ForwardCheckpoints, ForwardFailures

    config, place, history, clock = plan.config, plan.place, handle.history, handle.clock
    reports = inputs.channel.sender
    # rank 0 watches for a newer claim
    spec = replace(inputs.spec, attempt=(place.storage, place.path, fence.mine))
    trainer = build_trainer(config, spec, inputs.datasets, place,
                            [ForwardFailures(reports), ForwardCheckpoints(reports)])
    log.divert()  # Ray Train sets up its loggers on first use
    try:
        with ReportConsumer(inputs.channel, handle):
            result = fit_interruptibly(trainer, handle.failures.doomed, opening,
                                       lambda: stop_at_next_report(place, history))
        tracker = handle.tracker()  # the reports logged: MLflow's run is open
    except ray.train.TrainingFailedError as exc:
        raise RunFailedError(f"training failed: {root_cause(exc)} "
                             f"(run directory: {place.uri})") from None
    except Doomed as exc:
        raise RunFailedError(f"training failed before its first report: {exc}; not retried, "
                             "as every restart would fail the same way (traceback in "
                             f"{log.path}; run directory: {place.uri})") from None
    # A newer attempt claimed the run: its workers stopped at their next report (Cadence); what is
    # in storage now, the newer attempt's checkpoints included, is not this attempt's to tidy, nor
    # its MLflow run this one's to end.
    refuse_if_newer(fence, place, now=True)
    _remove_unregistered_checkpoints(result)
    # The checkpoints retention kept, each a LoggedModel of the run (tracking/checkpoint_models.py);
    # the others' models go.
    storage = config.storage.path
    kept = {checkpoint_uri(storage, c.path): m.get("step")
            for c, m in result.best_checkpoints or []}
    if result.checkpoint:
        kept.setdefault(checkpoint_uri(storage, result.checkpoint.path),
                        (result.metrics or {}).get("step"))
    tracker.keep_checkpoints(kept)
    checkpoint_path = checkpoint_uri(storage, result.checkpoint.path) if result.checkpoint else None
    if history:
        figures = run_summary(history) | achieved_figures(handle.autopilot.found, history)
        tracker.log_metrics(figures, step=history[-1]["step"])
    return TrainResult(
        config=config, metrics=dict(result.metrics or {}), checkpoint_path=checkpoint_path,
        run_dir=place.uri, run_id=tracker.run_id, tracking_uri=getattr(tracker, "uri", None),
        history=history, startup=clock.seconds(), startup_alongside=clock.alongside(),
        autopilot=handle.autopilot.found,
    ), len(handle.failures.times), result.checkpoint


def _remove_unregistered_checkpoints(result: Any) -> None:
    """Delete what a worker killed mid-checkpoint left in storage: Ray never registered it, so its
    retention (`checkpoint.keep`) would never delete it and it would stay forever. Only after a run
    that finished."""
    # torch and Ray Train: not at the start
    from orchestrator.training.resume import unregistered_checkpoints

    registered = [c.path for c, _ in result.best_checkpoints or []]
    registered += [result.checkpoint.path] if result.checkpoint else []
    try:
        for path in unregistered_checkpoints(result.filesystem, result.path, registered):
            result.filesystem.delete_dir(path)
            print(f"removed unregistered checkpoint {path} "
                  "(left by a worker that died while saving it)",
                  file=sys.stderr)
    except OSError as exc:  # tidying must not fail a run that finished
        print(f"warning: could not remove unregistered checkpoints under {result.path}: {exc}",
              file=sys.stderr)


def _bill(plan: RunPlan, result: TrainResult, began: float, failures: int) -> None:
    """The run's cost ledger from `began` (the command's start) to now, billed at the largest size
    an elastic group reached; for a resumed run, also over every attempt (MLflow's run spans them
    all, so its cost figures do too): the earlier ones as the plan read them, and this one."""
    ended = time.time()
    result.cost = build_ledger(result.history, ended - began,
                               plan.pricing_at(largest_world(result.history)), failures)
    attempts = ([*plan.resume.attempts, attempt_record(began, result.history, ended)]
                if plan.resume else [])
    if len(attempts) > 1:
        result.attempts = len(attempts)
        result.run_cost = ledger_across_attempts(attempts, result.cost.pricing)
