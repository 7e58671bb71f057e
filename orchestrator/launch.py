"""`orchestrator train` on the driver: check the data, join or start Ray (cluster.py), build and fit the run
(trainer.py), show progress, track it in MLflow and bill it."""

from __future__ import annotations

import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.checks import model_state_advice, resolve_for_data
from orchestrator.cluster import connect_ray, outside_job_package, shutdown_local_ray, train_environment
from orchestrator.config import Config, to_yaml
from orchestrator.console import LOG_FILE, RunLog
from orchestrator.cost import build_ledger, ledger_across_attempts, resolve_pricing
from orchestrator.errors import ConfigError
from orchestrator.model_logging import checkpoint_weights, log_final_model
from orchestrator.plots import plot_history
from orchestrator.progress import ForwardCheckpoints, ForwardFailures, ReportConsumer, progress_line
from orchestrator.runs import RUN_CONFIG, AttemptLog, RunPlace, latest_run, new_run, open_run_storage
from orchestrator.startup import StartupClock
from orchestrator.tracking.context import config_params, context_tags, short_run_name
from orchestrator.tracking.links import run_url, ui_command
from orchestrator.tracking.store import check_server_listens
from orchestrator.tracking.tracker import Tracker, closed_on_error, start_tracker
from orchestrator.tracking.uri import mask_password, resolve_uri
from orchestrator.trainer import RunFailedError, build_run, root_cause
from orchestrator.training.resume import unregistered_checkpoints
from pipelines.config import is_remote
from pipelines.datasets import inspect_datasets
from pipelines.sources import DatasetInfo
from pipelines.storage import user_cache_dir


@dataclass
class TrainResult:
    """What `train()` returns: the last reported metrics, where the final checkpoint is, and the MLflow run."""

    config: Config
    metrics: dict[str, Any]
    checkpoint_path: str | None
    run_dir: str
    run_id: str | None
    tracking_uri: str | None
    history: list[dict[str, Any]] = field(default_factory=list)
    cost: Any = None  # orchestrator.cost.Ledger: node-hours, $ and the productive/overhead split
    startup: dict[str, float] = field(default_factory=dict)  # seconds per start-up part, to the first step
    startup_alongside: dict[str, float] = field(default_factory=dict)  # stages run at once with one of those parts
    run_cost: Any = None  # a resumed run's Ledger over all its attempts (cost.ledger_across_attempts); else None
    attempts: int = 1  # driver attempts of this run: the first command and each `--resume`


def _log_final_artifacts(tracker: Tracker, config: Config, checkpoint_path: str | None,
                         history: list[dict[str, Any]], info: DatasetInfo, checkpoint: Any = None) -> None:
    """The resolved config, the final weights as an MLflow Model named "model" (model_logging.py; `info`: the
    training data, whose sample rows give its input example and signature) and the learning curves (top level:
    the first file the run's Artifacts tab lists after the model)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.yaml").write_text(mask_password(to_yaml(config)))  # no password of a URI
        tracker.log_artifact(Path(tmp) / "config.yaml")
        if checkpoint_path:
            from ray.train import Checkpoint

            # The Checkpoint itself when given: it carries its filesystem (an S3 endpoint; no credentials).
            final = checkpoint or Checkpoint(checkpoint_path)

            def final_weights() -> dict[str, Any]:
                with final.as_directory() as directory:
                    return checkpoint_weights(directory)  # DDP's state.pt, or FSDP's shards put together

            log_final_model(tracker, config, info, final_weights)
        if history:
            metric = config.tune.metric if (config.tune.metric or "").startswith("val_") else "val_loss"
            tracker.log_artifact(plot_history(history, Path(tmp) / "learning_curves.png", metric))


def train(config: Config, address: str | None = None, verbose: bool = True, resume: bool = False,
          started_at: float | None = None, show_logs: bool = False) -> TrainResult:
    """Run one distributed training job and return its result. Raises UserError subclasses on bad input.
    With `resume`, continue the latest run of this experiment in storage (its Ray Train run from the latest
    checkpoint, and its MLflow run); without an earlier run, start a new one. `started_at` (epoch seconds, the
    CLI passes its process start) is where the start-up breakdown and the cost ledger's clock begin. Ray's and
    MLflow's own lines go to the run's log file (console.py), and to the terminal too with `show_logs`.
    Ctrl+C ends the MLflow run as KILLED and raises KeyboardInterrupt after saying how to continue."""
    clock = StartupClock(started_at or time.time())
    clock.mark("command")
    # Before any cluster resource is taken.
    infos = inspect_datasets(config.data, named=config.model.inputs is not None)
    config = resolve_for_data(config, infos)
    resolve_pricing(config)  # an unknown node type fails now, not after training
    check_server_listens(config.tracking)  # the run is opened while Ray starts: a dead server must stop us first
    advice = model_state_advice(config, infos["train"])  # ddp would not fit a worker, fsdp would
    if advice and verbose:
        print(advice, file=sys.stderr, flush=True)
    # The run's context tags are taken here, from the working directory (its commit): a Ray job's driver then
    # leaves it, as `ray.init` can remove it (cluster.outside_job_package).
    context = context_tags() if config.tracking.enabled else {}
    with outside_job_package(config.tracking):
        place, record = _place_run(config, resume, verbose)
        clock.mark("data inspection")
        with RunLog(show_logs) as log:
            return _train(config, address, verbose, infos, place, record, clock, log, context)


class _Alongside:
    """A driver stage run in a thread while the main thread does another; `result()` waits for it (Ctrl+C still
    reaching the main thread) and raises what it raised."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.began = time.time()
        self.ended: float | None = None
        self._outcome: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(work,), name="orchestrator-alongside", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._outcome["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread as is
            self._outcome["error"] = exc
        finally:
            self.ended = time.time()

    def result(self) -> Any:
        while self._thread.is_alive():
            self._thread.join(timeout=0.2)
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


def _open_tracking(config: Config, place: RunPlace, record: dict[str, Any] | None, infos: dict[str, DatasetInfo],
                   run_name: str, run_dir: str, log: RunLog, verbose: bool, context: dict[str, str]) -> Tracker:
    """The MLflow run opened with its params, datasets and tags, the run's directory, log file and record written.
    A run it opened and could not finish setting up ends FAILED (KILLED on KeyboardInterrupt)."""
    tracker = start_tracker(config.tracking, run_name, run_id=_reopen_id(config, record), headline=config.tune.metric,
                            context=context)
    with closed_on_error(tracker):
        if record:
            tracker.set_tags({f"orchestrator.resume.{time.strftime('%Y%m%d-%H%M%S')}":
                              "driver restarted with --resume"})
        tracker.log_params(config_params(config))  # model options' builder defaults included
        tracker.log_datasets(infos)
        tracker.set_tags({"orchestrator.run_dir": run_dir, "orchestrator.train_rows": str(infos["train"].num_rows)})
        place.write_text(RUN_CONFIG, to_yaml(config))
        log.open(log_path := _log_path(config, place))  # the run's directory exists from here on
        if verbose:
            print(f"Ray and MLflow logs: {log_path}" + ("" if log.verbose else " (--verbose shows them here)"),
                  flush=True)
        place.write_record({"run_name": run_name, "mlflow_run_id": tracker.run_id,
                            "tracking_uri": mask_password(getattr(tracker, "uri", None) or "") or None})
    return tracker


def _abandon_start(opening: _Alongside, exc: BaseException, started_ray: bool) -> None:
    """Ray's start or the run's opening failed (or Ctrl+C came): end the run the other one opened as the command
    ends (KILLED or FAILED) and stop the cluster started here."""
    try:
        tracker = opening.result()
    except BaseException:  # noqa: BLE001 - its own failure: a run it opened was ended there, the error is raised
        tracker = None
    if tracker is not None:
        tracker.finish("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
    if started_ray:
        shutdown_local_ray()


def _log_path(config: Config, place: RunPlace) -> Path:
    """The run's log file: in its directory, or for a run stored in S3 a local file named after it, in this user's
    private cache (a shared temp path would let another user plant a link the log is written through)."""
    if is_remote(config.storage.path):
        return Path(user_cache_dir()) / "logs" / f"{place.name}.log"
    return Path(place.path) / LOG_FILE


def _train(config: Config, address: str | None, verbose: bool, infos: dict[str, DatasetInfo], place: RunPlace,
           record: dict[str, Any] | None, clock: StartupClock, log: RunLog, context: dict[str, str]) -> TrainResult:
    run_name, run_dir = short_run_name(config, place.name), place.uri
    if config.tracking.enabled:
        import mlflow  # noqa: F401 - its loggers exist from here on: diverted before the store logs its set-up

        log.divert()
    history: list[dict[str, Any]] = []
    attempt = AttemptLog(place, clock.started_at)
    with interrupted(place, history):  # Ctrl+C while Ray starts or the run is opened: an opened run ends KILLED
        # MLflow's run is opened in a thread while Ray starts here (Ray wants the main thread for its signal
        # handlers, and Ctrl+C reaches only this one): neither waits for the other.
        opening = _Alongside(lambda: _open_tracking(config, place, record, infos, run_name, run_dir, log, verbose,
                                                    context))
        started_ray = False
        try:
            started_ray = connect_ray(address, config)
            ray_ended = time.time()
            log.attach_ray()
            tracker = opening.result()
        except BaseException as exc:
            _abandon_start(opening, exc, started_ray)
            raise
        clock.mark_together(opening.began, {"tracking": opening.ended or time.time(), "ray start": ray_ended})
    # From the moment the run exists, Ctrl+C ends it KILLED (an error FAILED), never leaving it RUNNING.
    with closed_on_error(tracker), interrupted(place, history):
        stopping: threading.Thread | None = None
        try:
            import ray

            # A local cluster cannot grow: a worker group it can never hold would wait forever.
            missing = config.scaling.shortfall(ray.cluster_resources()) if started_ray else None
            if missing:
                raise ConfigError(f"this run needs {missing}")
            with train_environment(config, private_cluster=started_ray):
                result, failures, checkpoint = _fit(config, infos, place, tracker, verbose, clock, log, history,
                                                    started_ray, attempt)
            if started_ray:
                # Ray's shutdown mostly waits for its processes to exit: let them, while the artifacts are logged.
                stopping = threading.Thread(target=shutdown_local_ray, name="ray-shutdown")
                stopping.start()
            _log_final_artifacts(tracker, config, result.checkpoint_path, history, infos["train"], checkpoint)
        finally:
            if stopping is not None:
                stopping.join()
            elif started_ray:
                shutdown_local_ray()
            attempt.save(history, force=True)  # this attempt's final record; after a failure or Ctrl+C too
        # Billed from the command's start to now, Ray's shutdown included: what the user's stopwatch shows.
        wall_s = clock.since_start()
        result.cost = _cost(config, result.history, wall_s, failures)
        attempts = place.read_attempts() if record is not None else []
        if len(attempts) > 1:  # a resumed run: MLflow's run spans every attempt, so its cost figures do too
            result.attempts, result.run_cost = len(attempts), ledger_across_attempts(attempts, result.cost.pricing)
        logged = (result.run_cost or result.cost).metrics() | {"cost/attempts": float(result.attempts)}
        tracker.log_metrics(logged, step=result.history[-1]["step"] if result.history else 0)
    tracker.finish("FINISHED")
    return result


class _Doomed(Exception):
    """A worker raised an error that a restart would raise again, before the run's first report."""


def _fit_interruptibly(trainer: Any, doomed: list[str]) -> Any:
    """`trainer.fit()` in a thread, so that Ctrl+C reaches this (main) thread as KeyboardInterrupt, and so that a
    run whose first attempt failed in the user's code or config (`doomed`, filled by the report handler) stops now
    instead of after every restart Ray Train would make. Called in the main thread, Ray Train installs its own
    SIGINT handler, which waits for its controller to abort and then exits the process with status 1, before the
    run is marked or the user told how to continue. The run's actors end with the driver (the local cluster is shut
    down; a joined cluster drops the job's actors when the driver leaves it)."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread as is
            outcome["error"] = exc

    thread = threading.Thread(target=fit, name="orchestrator-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.2)
        if doomed:
            raise _Doomed(doomed[0])
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@contextmanager
def interrupted(place: RunPlace, history: list[dict[str, Any]]) -> Iterator[None]:
    """Ctrl+C: say where the run stopped, what a resume continues from and the command for it; the interrupt
    then ends the command (exit 130, the MLflow run KILLED)."""
    try:
        yield
    except KeyboardInterrupt:
        import ray

        if ray.is_initialized():  # a joined cluster: leaving it ends the run's actors, so nothing more registers
            ray.shutdown()
        step = history[-1]["step"] if history else 0
        saved = place.registered_step()
        command = ["orchestrator", *sys.argv[1:]] if sys.argv[1:2] == ["train"] else ["orchestrator", "train", "..."]
        again = shlex.join(command + ([] if "--resume" in command else ["--resume"]))
        print(f"interrupted at step {step}; " + (f"last checkpoint step {saved}; continue with: {again}"
                                                 if saved else "no checkpoint yet: a new run starts from step 0"),
              file=sys.stderr, flush=True)
        raise


def _checkpoint_uri(config: Config, path: str) -> str:
    """Ray's checkpoint path as the user names it: s3://... for S3 storage (Ray keeps it without the scheme)."""
    return f"s3://{path}" if config.storage.path.startswith("s3://") and "://" not in path else path


def _events(previous: dict[str, Any] | None, report: dict[str, Any], n: int) -> list[tuple[dict[str, str], str]]:
    """MLflow tags (and a printed line) for what a report reveals: a resized worker group, a drain checkpoint."""
    events = []
    world = report.get("world_size")
    if previous is not None and world is not None and previous.get("world_size") not in (None, world):
        text = f"step {report['step']}: {previous['world_size']} -> {world} workers"
        if "global_batch" in report:
            text += f", global batch {report['global_batch']} (accumulation {report.get('grad_accum_steps')})"
        events.append(({f"orchestrator.resize.{n}": text}, f"worker group resized at {text}"))
    if report.get("drain_checkpoint"):
        text = f"step {report['step']}: a node is being drained; checkpoint saved"
        events.append(({f"orchestrator.drain.{n}": text}, text))
    return events


def _place_run(config: Config, resume: bool, verbose: bool) -> tuple[RunPlace, dict[str, Any] | None]:
    """The run's place in storage and, when resuming, its record (MLflow run id)."""
    storage = open_run_storage(config)
    place = latest_run(storage, config.experiment) if resume else None
    if place is None:
        if resume:
            print(f"no earlier run of '{config.experiment}' in {storage.uri}: starting a new one", file=sys.stderr)
        return new_run(storage, config.experiment), None
    place.check_resumable(config)
    if verbose:
        print(f"resuming run {place.uri} from its latest checkpoint", file=sys.stderr)
    return place, place.read_record() or {}


def _reopen_id(config: Config, record: dict[str, Any] | None) -> str | None:
    """The MLflow run to continue: the resumed run's, if it was tracked at the same URI."""
    if not record or not record.get("mlflow_run_id") or not config.tracking.enabled:
        return None
    uri = mask_password(resolve_uri(config.tracking.uri))  # as the record keeps it
    if mask_password(record.get("tracking_uri") or "") != uri:
        print(f"the resumed run was tracked at {mask_password(record.get('tracking_uri') or '')}, not {uri}: "
              "starting a new MLflow run", file=sys.stderr)
        return None
    return str(record["mlflow_run_id"])


def _fit(config: Config, infos: dict[str, DatasetInfo], place: RunPlace, tracker: Tracker,
         verbose: bool, clock: StartupClock, log: RunLog, history: list[dict[str, Any]], private_cluster: bool,
         attempt: AttemptLog) -> tuple[TrainResult, int, Any]:
    """Fit the run while a driver thread shows and tracks its metrics (appended to `history` as they come).
    Returns the result, how many worker failures Ray Train restarted from, and the final Ray Checkpoint. On a
    `private_cluster` an error every restart would repeat ends the run at once (shutting the cluster down ends Ray
    Train's restarts too)."""
    import ray
    import ray.train
    from ray.util.queue import Queue


    total = config.train.max_steps or 0
    failures: list[float] = []
    doomed: list[str] = []  # an error in the user's code or config before the first report

    def handle(report: dict[str, Any]) -> None:
        if report.get("event") == "checkpoint":  # committed by Ray Train: a LoggedModel of the run
            tracker.log_checkpoint(report["step"], _checkpoint_uri(config, report["path"]))
            return
        if report.get("event") == "worker_failure":
            failures.append(clock.since_start())
            step = history[-1]["step"] if history else 0
            tracker.set_tags({f"orchestrator.failure.{len(failures)}": f"after step {step}: {report['error']}"})
            if report.get("repeats") and not history and private_cluster:
                doomed.append(report["error"])  # the main thread stops the run: a restart would fail the same way
                return
            print(f"worker {report['rank']} failed: {report['error']} (restarting from the last checkpoint)",
                  file=sys.stderr)
            return
        if clock.take_worker_marks(report):
            tracker.log_metrics(clock.metrics(), step=report["step"])
            if verbose:
                print(clock.line(), flush=True)
        for tag, line in _events(history[-1] if history else None, report, len(history)):
            tracker.set_tags(tag)
            print(line, file=sys.stderr)
        report["elapsed_s"] = clock.since_start()  # when it arrived: the cost ledger's timeline
        history.append(report)
        attempt.save(history)
        tracker.log_metrics(report, step=report["step"])
        if "precision" in report:
            tracker.set_tags({"orchestrator.precision": report["precision"]})
        if verbose:
            print(progress_line(report, total, config.train.global_batch_size, config.tune.metric or ""),
                  flush=True)

    # Rank 0 puts its metrics on this queue itself (no barrier); the controller adds worker failures.
    queue = Queue(actor_options={"num_cpus": 0})
    trainer = build_run(config, infos, place, [ForwardFailures(queue), ForwardCheckpoints(queue)], queue)
    log.divert()  # Ray Data and Ray Train set up their loggers on first use
    clock.mark("datasets")
    try:
        with ReportConsumer(queue, handle):
            result = _fit_interruptibly(trainer, doomed)
    except ray.train.TrainingFailedError as exc:
        raise RunFailedError(f"training failed: {root_cause(exc)} (run directory: {place.uri})") from None
    except _Doomed as exc:
        raise RunFailedError(f"training failed before its first report: {exc}; not retried, as every restart would "
                             f"fail the same way (run directory: {place.uri})") from None
    _remove_unregistered_checkpoints(result)
    # The checkpoints retention kept, each a LoggedModel of the run (checkpoint_models.py); the others' models go.
    kept = {_checkpoint_uri(config, c.path): m.get("step") for c, m in result.best_checkpoints or []}
    if result.checkpoint:
        kept.setdefault(_checkpoint_uri(config, result.checkpoint.path), (result.metrics or {}).get("step"))
    tracker.keep_checkpoints(kept)
    checkpoint_path = _checkpoint_uri(config, result.checkpoint.path) if result.checkpoint else None
    if history:
        tracker.log_metrics(run_summary(history), step=history[-1]["step"])
    return TrainResult(
        config=config, metrics=dict(result.metrics or {}), checkpoint_path=checkpoint_path, run_dir=place.uri,
        run_id=tracker.run_id, tracking_uri=getattr(tracker, "uri", None), history=history, startup=clock.seconds(),
        startup_alongside=clock.alongside(),
    ), len(failures), result.checkpoint


def _remove_unregistered_checkpoints(result: Any) -> None:
    """Delete what a worker killed mid-checkpoint left in storage: Ray never registered it, so its retention
    (`checkpoint.keep`) would never delete it and it would stay forever. Only after a run that finished."""
    registered = [c.path for c, _ in result.best_checkpoints or []]
    registered += [result.checkpoint.path] if result.checkpoint else []
    try:
        for path in unregistered_checkpoints(result.filesystem, result.path, registered):
            result.filesystem.delete_dir(path)
            print(f"removed unregistered checkpoint {path} (left by a worker that died while saving it)",
                  file=sys.stderr)
    except OSError as exc:  # tidying must not fail a run that finished
        print(f"warning: could not remove unregistered checkpoints under {result.path}: {exc}", file=sys.stderr)


def _cost(config: Config, history: list[dict[str, Any]], wall_s: float, failures: int) -> Any:

    # An elastic group is billed at the largest size it reached.
    world = max((int(r["world_size"]) for r in history if "world_size" in r), default=None)
    return build_ledger(history, wall_s, resolve_pricing(config, world), failures)


def run_summary(history: list[dict[str, Any]]) -> dict[str, float]:
    """Whole-run figures from the reports: throughput and MFU over the wall clock of the training (every interval,
    reports and checkpoints included; a step redone after a restart counts once), time shares, compile time, and
    the last validation figures. MLflow holds them under `final/...` (tracking.mlflow_key)."""
    kept = list({int(r["step"]): r for r in history if "interval_s" in r}.values())
    seconds = sum(r["interval_s"] for r in kept)
    summary: dict[str, float] = {}
    if seconds > 0:
        # Per-interval rates and shares, weighted by each interval's wall seconds.
        keys = {k for r in kept for k in r if k.startswith("time/")} | {"samples_per_s"}
        keys |= {k for k in ("tokens_per_s", "mfu") if all(k in r for r in kept)}
        for key in sorted(keys):
            summary[f"summary/{key}"] = sum(r.get(key, 0.0) * r["interval_s"] for r in kept) / seconds
    if any("compile_s" in r for r in history):
        summary["summary/compile_s"] = sum(r.get("compile_s", 0.0) for r in history)
    evaluated = [r for r in history if "val_loss" in r]
    if evaluated:
        summary |= {f"summary/{k}": float(v) for k, v in evaluated[-1].items()
                    if k.startswith("val_") and isinstance(v, int | float)}
    return summary


def parallel_line(history: list[dict[str, Any]]) -> str | None:
    """'parallel: fsdp over 2 workers, each holding 1.2 GiB of parameters and 2.4 GiB of optimizer state', from the
    worker's facts in the latest (re)start's first report; None when the workers sent none."""
    facts = next((r for r in reversed(history) if "param_bytes_per_rank" in r), None)
    if facts is None:
        return None
    world = facts.get("world_size")
    workers = ", each" if world is None else " on 1 worker," if world == 1 else f" over {world} workers, each"
    return (f"parallel: {facts.get('parallel', 'ddp')}{workers} holding {_bytes(facts['param_bytes_per_rank'])} "
            f"of parameters and {_bytes(facts.get('optimizer_bytes_per_rank', 0))} of optimizer state")


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def summary(result: TrainResult) -> str:
    """The lines printed after a run: final accuracy, where the time went, where things are, how to look at them."""
    m = result.metrics
    lines = [f"finished {result.config.experiment}: step {m.get('step')}, "
             f"train loss {m.get('train_loss', float('nan')):.4f}"]
    if "val_accuracy" in m and result.config.task.kind is not None and result.config.task.kind.label == "classes":
        lines.append(f"final validation accuracy: {m['val_accuracy']:.4f} (val loss {m['val_loss']:.4f})")
    elif "val_loss" in m:  # every validation figure of the task, its headline first
        keys = sorted((k for k in m if k.startswith("val_")), key=lambda k: (k != result.config.tune.metric, k))
        lines.append("final validation: " + " | ".join(f"{k.removeprefix('val_')} {m[k]:.4f}" for k in keys))
    if result.cost is not None:
        lines.append(result.cost.time_line())
    if result.history:
        figures = run_summary(result.history)
        throughput = f"throughput: {figures.get('summary/samples_per_s', 0):,.0f} samples/s"
        if "summary/tokens_per_s" in figures:
            throughput += f", {figures['summary/tokens_per_s']:,.0f} tokens/s"
        if "summary/mfu" in figures:
            throughput += f", MFU {figures['summary/mfu']:.1%}"
        lines.append(throughput + " over the training's wall clock (first step to last)")
    if result.cost is not None:
        lines.append(result.cost.line())
    if result.run_cost is not None:
        lines.append(f"run over its {result.attempts} attempts (from the first command): "
                     f"{result.run_cost.time_line().removeprefix('time: ')} | ETTR {result.run_cost.ettr:.0%}")
    held = parallel_line(result.history)
    if held:
        lines.append(held)
    lines.append(f"checkpoint: {result.checkpoint_path}")
    if result.run_id:
        lines.append(f"MLflow run id: {result.run_id}")
        command = ui_command(result.tracking_uri or "", result.config.tracking.experiment)
        lines.append(f"open the MLflow UI: {command}")
        url = run_url(result.tracking_uri or "", result.run_id)
        if url:
            lines.append(f"this run in the MLflow UI: {url}")
    return "\n".join(lines)
