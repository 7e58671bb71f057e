"""The Ray wiring every driver (`train`, each Tune trial) builds a run with: the datasets and the
TorchTrainer, Train's storage arguments, and the one line a Ray failure boils down to. The checks
before it are in checks.py."""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from orchestrator.config import Config, to_dict
from orchestrator.errors import ConfigError, UserError
from orchestrator.run.place import RunPlace
from orchestrator.training.channel import ChannelSender
from orchestrator.training.handoff import WorkerSpec
from pipelines.config import DataConfig
from pipelines.datasets import CACHE_DECISIONS, REPLAY, WHOLE_TRAIN, build_datasets, cache_decision
from pipelines.held import HeldRows
from pipelines.order import create_epoch_clock, release_epoch_clock
from pipelines.sources import DatasetInfo
from pipelines.storage import Storage

if TYPE_CHECKING:
    from orchestrator.run.plan import ConfigPlan


class RunFailedError(UserError):
    """Training stopped for good (failure budget spent, or an error every retry hits)."""


def ingest_options() -> Any:
    """Ray Data's options for the workers' ingest: Ray Train's defaults (the current DataContext's),
    in order, so two runs (and a resumed run) see the same batches on the same ranks. Built here
    rather than by `DataConfig.default_ingest_options()`, which passes the deprecated
    `exclude_resources` (zero unless set)."""
    from ray.data import DataContext, ExecutionOptions

    current = DataContext.get_current().execution_options
    return ExecutionOptions(resource_limits=current.resource_limits, preserve_order=True,
                            verbose_progress=current.verbose_progress)


def build_trainer(config: Config, spec: WorkerSpec, datasets: dict[str, Any], place: RunPlace,
                  callbacks: list[Any]) -> Any:
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from orchestrator.training.warm import WarmTorchConfig, loop_config, train_entry

    options = ingest_options()
    s = config.scaling
    if config.failure.mode == "replicas":
        # Ray Train 2.60 hands a replaced replica group a dataset manager of its own (of size 1),
        # whose sharded iterator waits forever for a rank 0 that never asks: each replica reads the
        # datasets itself, unsplit.
        spec, datasets = replace(spec, replica_datasets=datasets), {}
    return TorchTrainer(
        train_entry,
        train_loop_config=loop_config(spec),
        scaling_config=ray.train.ScalingConfig(
            num_workers=(s.min_workers, s.max_workers) if s.elastic else s.num_workers,
            use_gpu=s.use_gpu, resources_per_worker={"CPU": s.cpus_per_worker},
            accelerator_type=s.accelerator_type,
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
            # Ray deletes an old checkpoint only after a newer one is registered (complete), so the
            # one a run resumes from stays until a newer complete one replaces it.
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.checkpoint.keep),
            callbacks=callbacks,
            # per-report INFO lines bury progress
            logging_config=ray.LoggingConfig(log_level="WARNING"),
            worker_runtime_env={"env_vars": _worker_env(config)},
        ),
        datasets=datasets,
        # Only the training data is split (equally: the ranks' steps stay aligned). Every rank reads
        # the validation data whole and scores its stride of it (worker.rank_shard): an equal split
        # would leave rows mod workers out.
        dataset_config=ray.train.DataConfig(datasets_to_split=["train"], execution_options=options),
        # The workers import the training side while the group starts (training/warm.py); under
        # failure.mode=replicas, torchft's replica groups instead.
        torch_config=(replica_torch_config() if config.failure.mode == "replicas"
                      else WarmTorchConfig()),
    )


def replica_torch_config() -> Any:
    """failure.mode=replicas: one torchft replica group per worker, its lighthouse started by Ray
    Train; a failed worker's group is replaced alone while the others keep stepping
    (training/replicas.py)."""
    from ray.train.v2.torch.torchft_config import TorchftConfig

    # One live replica is enough to keep stepping: the survivors take the lost ones' share of the
    # batch.
    return TorchftConfig(lighthouse_kwargs={"min_replicas": 1})


def replica_warning(config: Config) -> str:
    """The one line a failure.mode=replicas run starts with: what its math and its data do around a
    failure."""
    workers, batch = config.scaling.num_workers, config.train.global_batch_size
    return (f"warning: failure.mode=replicas: {workers} replicas split the global batch of {batch} "
            f"between the live ones (each {batch // (workers - 1)} rows while one of {workers} is "
            "restarting), so every step keeps its rows, samples and LR and every row is trained "
            "once; but each replica reads (and decodes) the whole dataset, the shard order does "
            "not change per epoch, and only the last step is checkpointed (docs/training.md)")


def _rows_known(config: Config, train: Any) -> int | None:
    """failure.mode=replicas: the training split's rows, from which a replica that joins in a later
    epoch finds its step's rows without reading the epochs before (training/replicas.py); None where
    a `call` transform may change the count."""
    if (config.failure.mode != "replicas"
            or any("call" in item for item in config.data.transforms or [])):
        return None
    return train.num_rows


def _worker_env(config: Config) -> dict[str, str]:
    """Environment of the training workers: CUDA memory segments that grow in place (less
    fragmentation than fixed-size blocks), unless the user chose an allocator setting."""
    if not config.scaling.use_gpu or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def resumed_cache_decision(data: DataConfig, infos: dict[str, DatasetInfo], store_bytes: float,
                           saved: str | None) -> str:
    """The cache decision a run is fed under: its checkpoints' (`saved`) when it has one, since
    their data position counts rows in that decision's epoch order (another would train some rows
    twice and others never), else what `data.cache` and the object store decide now. Says so in one
    line when it overrides them."""
    current = cache_decision(data, infos, store_bytes)
    if saved is None or saved == current:
        return current
    if saved not in CACHE_DECISIONS:  # the one check: build_datasets takes the decision as given
        raise ConfigError(f"the run's checkpoint records an unknown cache decision '{saved}': "
                          "resume it with the version that wrote it, or run without --resume")
    print(f"resumed run: keeping the data {CACHE_DECISIONS[saved]} "
          f"('{saved}'), as when its checkpoints counted their data position, "
          f"not {CACHE_DECISIONS[current]} as data.cache={data.cache} with "
          f"{store_bytes / 2**30:.1f} GiB of object store would now have it",
          file=sys.stderr, flush=True)
    return saved


def build_run(plan: ConfigPlan, infos: dict[str, DatasetInfo], place: RunPlace,
              reports: ChannelSender | None, node_ranks: int | None = None) -> Any:
    """Datasets and TorchTrainer for one planned run, in this process's Ray Data context (a Tune
    trial's actor). Rank 0 sends its metrics to `reports` (the run's channel). A restarted run is
    fed as its checkpoints were (the cache decision they recorded: RunPlace.cache_decision)."""
    spec, datasets = build_inputs(plan.config, plan.in_features, infos, place.name,
                                  place.cache_decision(), reports, node_ranks)
    return build_trainer(plan.config, spec, datasets, place, [])


def trial_inputs(plan: ConfigPlan, infos: dict[str, DatasetInfo], name: str, saved: str | None,
                 node_ranks: int | None) -> tuple[WorkerSpec, dict[str, Any]]:
    """build_inputs for a Tune trial that trains in its own process (tuning/trial.py): no report
    channel (its reports go to Tune)."""
    return build_inputs(plan.config, plan.in_features, infos, name, saved, None, node_ranks)


def build_inputs(config: Config, width: int | None, infos: dict[str, DatasetInfo], name: str,
                 saved: str | None, reports: ChannelSender | None,
                 node_ranks: int | None = None) -> tuple[WorkerSpec, dict[str, Any]]:
    """What the ranks of run `name` are handed (a WorkerSpec) and its datasets, fed under the cache
    decision of the checkpoint it resumes from (`saved`), else the one data.cache and the object
    store make now. `width`: the classic model input's, as planned (ConfigPlan.in_features;
    models.inputs). `node_ranks`: in a study, the ranks of all its trials that may share a node's
    memory (memory_plan.ranks_per_node), which a CPU rank's `micro_batch_size=auto` divides the
    node's memory by; else the run's own ranks on the node."""
    import ray
    from ray.data import DataContext

    store_bytes = ray.cluster_resources().get("object_store_memory", 0)
    decision = resumed_cache_decision(config.data, infos, store_bytes, saved)
    if config.failure.mode == "replicas":
        print(replica_warning(config), file=sys.stderr, flush=True)
    # The workers advance this clock each epoch; the train reader draws that epoch's shard order
    # from it. Replayed data is read once, in epoch 0's order, which is the order without a clock:
    # no clock actor to start. Replicas read on their own (a restarted one from epoch 0): one clock
    # for all would be moved back and forth.
    clock = (f"orchestrator-epoch-{name}-{uuid.uuid4().hex[:8]}"
             if config.data.shuffle and decision != REPLAY and config.failure.mode != "replicas"
             else None)
    if clock:
        create_epoch_clock(clock)
    spec = WorkerSpec(to_dict(config), width, epoch_clock=clock, cache_decision=decision,
                      reports=reports, sample=infos["train"].sample, node_ranks=node_ranks,
                      train_rows=_rows_known(config, infos["train"]))
    context = DataContext.get_current()
    context.execution_options.preserve_order = True
    context.print_on_execution_start = False  # one log line per epoch per dataset otherwise
    context.enable_progress_bars = False
    # Small data read by the driver is split by the ranks themselves (pipelines/held.py), unless a
    # shuffle buffer streams it every epoch or each replica reads it whole.
    hold = not config.data.shuffle_buffer and config.failure.mode != "replicas"
    try:
        datasets = build_datasets(config.data, infos, store_bytes, seed=config.train.seed,
                                  epoch_clock=clock, decision=decision, hold=hold,
                                  row_ids=config.failure.mode != "replicas")
    except BaseException:
        if clock:  # no run to end it with (a Tune trial's process outlives the trial)
            release_epoch_clock(clock)
        raise
    held = {name: ds for name, ds in datasets.items() if isinstance(ds, HeldRows)}
    spec = replace(spec, held=held)
    datasets = {name: ds for name, ds in datasets.items() if name not in held}
    return spec, datasets | ({WHOLE_TRAIN: datasets["train"]} if "train" in datasets else {})


def storage_args(storage: Storage) -> dict[str, Any]:
    """Train's and Tune's RunConfig storage: a local path, or for s3:// the data layer's S3
    filesystem (same endpoint and region) with the path inside it, which is what Ray expects beside
    storage_filesystem. The filesystem holds no key (Ray pickles it into every trial and Tune writes
    it into tuner.pkl in the bucket): each process that unpickles it resolves and refreshes its own
    credentials from the standard AWS chain."""
    if not storage.remote:
        return {"storage_path": storage.root}
    return {"storage_path": storage.root, "storage_filesystem": storage.filesystem()}


def root_cause(exc: BaseException) -> str:
    """The last 'SomeError: message' line of a Ray failure, which is what the user needs to read."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return line
    return lines[-1] if lines else type(exc).__name__
