"""Driver side of `orchestrator train`: check data, join or start Ray, build the TorchTrainer, track in MLflow."""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.config import Config, config_from_dict, flatten, to_dict, to_yaml
from orchestrator.errors import ConfigError, UserError
from orchestrator.runs import RUN_CONFIG, RunPlace, latest_run, new_run, open_run_storage
from orchestrator.tracking import Tracker, closed_on_error, start_tracker, ui_command
from pipelines.datasets import build_datasets, inspect_datasets, replay_epochs
from pipelines.order import create_epoch_clock
from pipelines.sources import DatasetInfo
from pipelines.storage import Storage


class RunFailedError(UserError):
    """Training stopped for good (failure budget spent, or an error every retry hits)."""


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


def resolve_for_data(config: Config, infos: dict[str, DatasetInfo]) -> Config:
    """Fill in what the data decides: the number of classes and, when epochs are given, the step count. Also checks
    the model's options against its builder (the first driver step that may import the model zoo)."""
    from orchestrator.models import check_model_options

    check_model_options(config.model)
    train = infos["train"]
    if "val" in infos and infos["val"].feature_dim != train.feature_dim:
        raise ConfigError(f"data.val has {infos['val'].feature_dim} feature values per row but data.train has "
                          f"{train.feature_dim}: both splits must have the same columns")
    tree = to_dict(config)
    if config.model.num_classes is None:
        if train.num_classes < 2:
            source = (f"'{config.data.label}' statistics" if config.data.label
                      else "the token column's vocab_size metadata")
            raise ConfigError(f"cannot infer the number of classes from {source}: set model.num_classes")
        tree["model"]["num_classes"] = train.num_classes
    t = config.train
    rows_per_worker = train.num_rows // config.scaling.max_workers
    smallest = t.micro_batch_size if isinstance(t.micro_batch_size, int) else 1
    if rows_per_worker < smallest:
        raise ConfigError(f"data.train has {train.num_rows} rows, fewer than one micro-batch "
                          f"({smallest}) per worker: lower train.global_batch_size")
    if t.epochs is not None:
        per_worker_step = t.global_batch_size // config.scaling.max_workers
        steps = max(1, math.ceil(t.epochs * rows_per_worker / per_worker_step))
        # Config validation could not check the warmup against a step count only the data decides.
        if config.optim.warmup_steps >= steps:
            raise ConfigError(f"config key 'optim.warmup_steps': optim.warmup_steps={config.optim.warmup_steps} "
                              f"must be below the run's {steps} optimizer steps (train.epochs={t.epochs:g} over "
                              f"{train.num_rows} rows at global batch {t.global_batch_size}): lower "
                              "optim.warmup_steps or train longer")
        tree["train"]["max_steps"] = steps
        tree["train"]["epochs"] = None
    return config_from_dict(tree)


def connect_ray(address: str | None, config: Config) -> bool:
    """Join `address` / $RAY_ADDRESS if given, else start a private local cluster. True if we started it."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return False
    # Ray's own INFO lines (per-report, per-epoch) would bury the progress lines; warnings still show.
    logging_config = ray.LoggingConfig(log_level="WARNING")
    if address:
        ray.init(address=address, logging_config=logging_config)
        return False
    # Ray Data's read tasks need CPUs beside the workers', or ingest waits forever on a small machine.
    needed = math.ceil(config.scaling.max_workers * config.scaling.cpus_per_worker) + 2
    # Local workers inherit this environment: make the user's own modules (model entrypoints) importable.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([os.getcwd(), *paths]))  # once, however many runs
    # The dashboard serves the state API that Ray Train's controller polls; bound to localhost only.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=True,
             dashboard_host="127.0.0.1", dashboard_port=pin_state_api(), logging_config=logging_config)
    return True


def pin_state_api() -> int:
    """A free dashboard port, exported as RAY_API_SERVER_ADDRESS for the local cluster about to start.

    Ray Train's placement-group cleaner looks its cluster up with no address; when another Ray instance runs on
    the same machine that lookup fails, the cleaner dies, and every run whose controller is killed (each trial
    ASHA stops) keeps its CPUs for good. Ray processes inherit this environment, so they find this cluster."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    return port


def shutdown_local_ray() -> None:
    """Stop the local cluster `connect_ray` started and forget its state-API address, so nothing started later in
    this process (or inherited by its children) looks for a cluster that is gone."""
    import ray

    ray.shutdown()
    os.environ.pop("RAY_API_SERVER_ADDRESS", None)


def build_trainer(config: Config, spec: dict[str, Any], datasets: dict[str, Any], place: RunPlace,
                  callbacks: list[Any]) -> Any:
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    # Preserve order so two runs (and a resumed run) see the same batches on the same ranks.
    options = ray.train.DataConfig.default_ingest_options()
    options.preserve_order = True
    s = config.scaling
    return TorchTrainer(
        _worker_entry,
        train_loop_config=spec,
        scaling_config=ray.train.ScalingConfig(
            num_workers=(s.min_workers, s.max_workers) if s.elastic else s.num_workers, use_gpu=s.use_gpu,
            resources_per_worker={"CPU": s.cpus_per_worker}, accelerator_type=s.accelerator_type,
            **({"elastic_resize_monitor_interval_s": s.resize_check_s} if s.resize_check_s else {}),
        ),
        run_config=ray.train.RunConfig(
            name=place.name,
            **storage_args(place.storage),
            failure_config=ray.train.FailureConfig(
                max_failures=config.failure.max_failures,
                max_preemption_failures=config.failure.max_preemption_failures,
                preemption_grace_s=config.failure.preemption_grace_s,
            ),
            # Ray deletes an old checkpoint only after a newer one is registered (complete), so the one a run
            # resumes from stays until a newer complete one replaces it.
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.checkpoint.keep),
            callbacks=callbacks,
            logging_config=ray.LoggingConfig(log_level="WARNING"),  # per-report INFO lines bury progress
            worker_runtime_env={"env_vars": _worker_env(config)},
        ),
        datasets=datasets,
        dataset_config=ray.train.DataConfig(datasets_to_split="all", execution_options=options),
    )


def _worker_env(config: Config) -> dict[str, str]:
    """Environment of the training workers: CUDA memory segments that grow in place (less fragmentation than
    fixed-size blocks), unless the user chose an allocator setting."""
    if not config.scaling.use_gpu or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def build_run(config: Config, infos: dict[str, DatasetInfo], place: RunPlace, callbacks: list[Any]) -> Any:
    """Datasets and TorchTrainer for one run, in this process's Ray Data context (the driver for `train`, the
    trial actor for each Tune trial)."""
    import ray
    from ray.data import DataContext

    # The workers advance this clock each epoch; the train reader draws that epoch's shard order from it.
    clock = f"orchestrator-epoch-{place.name}-{uuid.uuid4().hex[:8]}" if config.data.shuffle else None
    if clock:
        create_epoch_clock(clock)
    # A language model's rows are seq_len + 1 tokens: inputs and the next-token targets shifted by one.
    in_features = infos["train"].feature_dim - (1 if config.data.label is None else 0)
    store_bytes = ray.cluster_resources().get("object_store_memory", 0)
    spec = {"config": to_dict(config), "in_features": in_features, "epoch_clock": clock,
            "replay_epochs": replay_epochs(config.data, infos, store_bytes)}
    context = DataContext.get_current()
    context.execution_options.preserve_order = True
    context.print_on_execution_start = False  # one log line per epoch per dataset otherwise
    context.enable_progress_bars = False
    datasets = build_datasets(config.data, infos, store_bytes, seed=config.train.seed, epoch_clock=clock)
    return build_trainer(config, spec, datasets, place, callbacks)


def _worker_entry(spec: dict[str, Any]) -> dict[str, Any]:
    # Imported in the worker only: the driver never needs the loop's modules.
    from orchestrator.training.worker import train_worker

    return train_worker(spec)


def storage_args(storage: Storage) -> dict[str, Any]:
    """Train's and Tune's RunConfig storage: a local path, or for s3:// the data layer's S3 filesystem (same
    endpoint and region) with the path inside it, which is what Ray expects beside storage_filesystem.
    The filesystem holds no key (Ray pickles it into every trial and Tune writes it into tuner.pkl in the bucket):
    each process that unpickles it resolves and refreshes its own credentials from the standard AWS chain."""
    if not storage.remote:
        return {"storage_path": storage.root}
    return {"storage_path": storage.root, "storage_filesystem": storage.filesystem()}


def _root_cause(exc: BaseException) -> str:
    """The last 'SomeError: message' line of a Ray failure, which is what the user needs to read."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return line
    return lines[-1] if lines else type(exc).__name__


def _log_final_artifacts(tracker: Tracker, config: Config, checkpoint_path: str | None,
                         history: list[dict[str, Any]], checkpoint: Any = None) -> None:
    import torch

    from orchestrator.plots import plot_history
    from orchestrator.training.checkpoint import load_state

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.yaml").write_text(to_yaml(config))
        tracker.log_artifact(Path(tmp) / "config.yaml")
        if checkpoint_path:
            from ray.train import Checkpoint

            # The Checkpoint itself when given: it carries its filesystem (an S3 endpoint; no credentials).
            with (checkpoint or Checkpoint(checkpoint_path)).as_directory() as directory:
                torch.save(load_state(directory)["model"], Path(tmp) / "model.pt")
            tracker.log_artifact(Path(tmp) / "model.pt", "model")
        if history:
            tracker.log_artifact(plot_history(history, Path(tmp) / "learning_curves.png"), "plots")


def train(config: Config, address: str | None = None, verbose: bool = True, resume: bool = False) -> TrainResult:
    """Run one distributed training job and return its result. Raises UserError subclasses on bad input.
    With `resume`, continue the latest run of this experiment in storage (its Ray Train run from the latest
    checkpoint, and its MLflow run); without an earlier run, start a new one."""
    from orchestrator.cost import resolve_pricing

    t0 = time.monotonic()  # the cost ledger bills from here: start-up includes Ray and data set-up
    infos = inspect_datasets(config.data)  # before any cluster resource is taken
    config = resolve_for_data(config, infos)
    resolve_pricing(config)  # an unknown node type fails now, not after training
    place, record = _place_run(config, resume, verbose)
    run_name, run_dir = place.name, place.uri
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # otherwise worker prints appear twice

    tracker = start_tracker(config.tracking, run_name, run_id=_reopen_id(config, record))
    if record:
        tracker.set_tags({f"orchestrator.resume.{time.strftime('%Y%m%d-%H%M%S')}": "driver restarted with --resume"})
    tracker.log_params(flatten(to_dict(config)))
    tracker.set_tags({"orchestrator.run_dir": run_dir, "orchestrator.train_rows": str(infos["train"].num_rows)})
    place.write_text(RUN_CONFIG, to_yaml(config))
    place.write_record({"run_name": run_name, "mlflow_run_id": tracker.run_id,
                        "tracking_uri": getattr(tracker, "uri", None)})
    with closed_on_error(tracker):
        started_ray = connect_ray(address, config)
        try:
            import ray

            # A local cluster cannot grow: a worker group it can never hold would wait forever.
            missing = config.scaling.shortfall(ray.cluster_resources()) if started_ray else None
            if missing:
                raise ConfigError(f"this run needs {missing}")
            result = _fit(config, infos, place, tracker, verbose, t0)
        finally:
            if started_ray:
                shutdown_local_ray()
    tracker.finish("FINISHED")
    return result


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
    from orchestrator.tracking import resolve_uri

    if not record or not record.get("mlflow_run_id") or not config.tracking.enabled:
        return None
    if record.get("tracking_uri") != resolve_uri(config.tracking.uri):
        print(f"the resumed run was tracked at {record.get('tracking_uri')}, not {resolve_uri(config.tracking.uri)}: "
              "starting a new MLflow run", file=sys.stderr)
        return None
    return str(record["mlflow_run_id"])


def _fit(config: Config, infos: dict[str, DatasetInfo], place: RunPlace, tracker: Tracker,
         verbose: bool, t0: float | None = None) -> TrainResult:
    import ray
    import ray.train
    from ray.util.queue import Queue

    from orchestrator.progress import ForwardReports, ReportConsumer, progress_line

    total = config.train.max_steps or 0
    history: list[dict[str, Any]] = []
    started = time.monotonic()
    t0 = started if t0 is None else t0
    failures: list[float] = []

    def handle(report: dict[str, Any]) -> None:
        if report.get("event") == "worker_failure":
            failures.append(time.monotonic() - t0)
            print(f"worker {report['rank']} failed: {report['error']} (restarting from the last checkpoint)",
                  file=sys.stderr)
            step = history[-1]["step"] if history else 0
            tracker.set_tags({f"orchestrator.failure.{len(failures)}": f"after step {step}: {report['error']}"})
            return
        for tag, line in _events(history[-1] if history else None, report, len(history)):
            tracker.set_tags(tag)
            print(line, file=sys.stderr)
        report["elapsed_s"] = time.monotonic() - t0  # when it arrived: the cost ledger's timeline
        history.append(report)
        tracker.log_metrics(report, step=report["step"])
        if "precision" in report:
            tracker.set_tags({"orchestrator.precision": report["precision"]})
        if verbose:
            print(progress_line(report, total, started), flush=True)

    queue = Queue(actor_options={"num_cpus": 0})
    trainer = build_run(config, infos, place, [ForwardReports(queue)])
    try:
        with ReportConsumer(queue, handle):
            result = trainer.fit()
    except ray.train.TrainingFailedError as exc:
        raise RunFailedError(f"training failed: {_root_cause(exc)} (run directory: {place.uri})") from None
    _remove_unregistered_checkpoints(result)
    checkpoint_path = _checkpoint_uri(config, result.checkpoint.path) if result.checkpoint else None
    if history:
        tracker.log_metrics(run_summary(history), step=history[-1]["step"])
    _log_final_artifacts(tracker, config, checkpoint_path, history, result.checkpoint)
    ledger = _cost(config, history, time.monotonic() - t0, len(failures))
    tracker.log_metrics(ledger.metrics(), step=history[-1]["step"] if history else 0)
    return TrainResult(
        config=config, metrics=dict(result.metrics or {}), checkpoint_path=checkpoint_path, run_dir=place.uri,
        run_id=tracker.run_id, tracking_uri=getattr(tracker, "uri", None), history=history, cost=ledger,
    )


def _remove_unregistered_checkpoints(result: Any) -> None:
    """Delete what a worker killed mid-checkpoint left in storage: Ray never registered it, so its retention
    (`checkpoint.keep`) would never delete it and it would stay forever. Only after a run that finished."""
    from orchestrator.training.resume import unregistered_checkpoints

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
    from orchestrator.cost import build_ledger, resolve_pricing

    # An elastic group is billed at the largest size it reached.
    world = max((int(r["world_size"]) for r in history if "world_size" in r), default=None)
    return build_ledger(history, wall_s, resolve_pricing(config, world), failures)


def run_summary(history: list[dict[str, Any]]) -> dict[str, float]:
    """Whole-run figures from the reports: mean time shares, median throughput and MFU, compile time."""
    import statistics

    summary: dict[str, float] = {}
    keys = {k for report in history for k in report if k.startswith("time/")}
    for key in sorted(keys):
        summary[f"summary/{key}"] = statistics.fmean(r.get(key, 0.0) for r in history)
    for key in ("samples_per_s", "tokens_per_s", "mfu", "data_wait_frac"):
        values = [r[key] for r in history if key in r]
        if values:
            summary[f"summary/{key}"] = statistics.median(values)
    if any("compile_s" in r for r in history):
        summary["summary/compile_s"] = sum(r.get("compile_s", 0.0) for r in history)
    return summary


def breakdown_line(summary: dict[str, float]) -> str:
    """'time: compute 71% | sync 4% | data wait 2% | eval 6% | checkpoint 3% | report 1% | other 13%'"""
    names = [("compute", "compute"), ("sync", "sync"), ("data_wait", "data wait"), ("eval", "eval"),
             ("checkpoint", "checkpoint"), ("report", "report"), ("other", "other")]
    parts = [f"{label} {summary[f'summary/time/{key}_frac']:.0%}" for key, label in names
             if f"summary/time/{key}_frac" in summary]
    return "time: " + " | ".join(parts) if parts else ""


def summary(result: TrainResult) -> str:
    """The lines printed after a run: final accuracy, where things are, and how to look at them."""
    m = result.metrics
    lines = [f"finished {result.config.experiment}: step {m.get('step')}, "
             f"train loss {m.get('train_loss', float('nan')):.4f}"]
    if "val_accuracy" in m:
        lines.append(f"final validation accuracy: {m['val_accuracy']:.4f} (val loss {m['val_loss']:.4f})")
    if result.history:
        figures = run_summary(result.history)
        lines.append(breakdown_line(figures))
        throughput = f"throughput: {figures.get('summary/samples_per_s', 0):,.0f} samples/s"
        if "summary/tokens_per_s" in figures:
            throughput += f", {figures['summary/tokens_per_s']:,.0f} tokens/s"
        if "summary/mfu" in figures:
            throughput += f", MFU {figures['summary/mfu']:.1%}"
        lines.append(throughput)
    if result.cost is not None:
        lines.append(result.cost.line())
    lines.append(f"checkpoint: {result.checkpoint_path}")
    if result.run_id:
        lines.append(f"MLflow run id: {result.run_id}")
        lines.append(f"open the MLflow UI: {ui_command(result.tracking_uri or '')}")
    return "\n".join(lines)
