"""The function every Ray Train worker runs: rebuild the config, wire model/optimizer/data, call
`loop.run`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch

from orchestrator.config import Config, config_from_dict
from orchestrator.errors import mark_where_raised
from orchestrator.ray_internals import quiet_train_report_log
from orchestrator.training import ranks
from orchestrator.training.autopilot import kept_config
from orchestrator.training.cadence import Notices
from orchestrator.training.checkpoint import Progress, restore, unwrap
from orchestrator.training.fence import rank_fence
from orchestrator.training.handoff import WorkerSpec
from orchestrator.training.loop import Data, Reporter, run
from orchestrator.training.micro_batch import for_world_size, with_auto_micro_batch
from orchestrator.training.parts import Parts, build_parts, compile_model
from orchestrator.training.position import data_position, rest_of_epoch
from orchestrator.training.precision import flush_denormals
from orchestrator.training.reporting import RayReporter
from orchestrator.training.resume import loadable_checkpoint, read_checkpoint
from orchestrator.training.stop import StopWatch
from pipelines.batches import collate_sample
from pipelines.datasets import REPLAY, WHOLE_TRAIN
from pipelines.feed import RankBatches, RankOrder
from pipelines.shards import StridedShard
from pipelines.storage import Storage, fetch_prefix


def train_worker(spec: WorkerSpec, entered: float) -> dict[str, Any]:
    """A rank's training, from training/warm.py's `train_entry` (the function TorchTrainer runs),
    handed `spec` (training/handoff.py). `entered`: when Ray Train ran the training function
    (training/warm.py)."""
    quiet_train_report_log()
    context = ray.train.get_context()
    world, rank = context.get_world_size(), context.get_world_rank()
    cfg = rank_config(spec, world)
    seat = Seat(world, rank, ray.train.torch.get_device(), entered)
    reporter = RayReporter(spec.reports, cfg.checkpoint.upload)
    # each replica reads the datasets whole (trainer.build_trainer says why)
    if cfg.failure.mode == "replicas":
        datasets = spec.replica_datasets or {}
        train_shard: Any = datasets["train"].iterator()
        val_shard = datasets["val"].iterator() if cfg.data.val is not None else None
    else:
        train_shard = rank_shard(spec, "train", seat, ray.train.get_dataset_shard)
        val_shard = (rank_shard(spec, "val", seat, ray.train.get_dataset_shard)
                     if cfg.data.val is not None else None)
    try:
        return train_rank(spec, cfg, seat, checkpoint_to_resume,
                          Shards(train_shard, val_shard, lambda: whole_train(spec, seat)), reporter,
                          Notices(preempted if cfg.checkpoint.on_preemption else None,
                                  stop_asked(spec.stop_request, rank),
                                  rank_fence(spec.attempt, rank)),
                          announce=reporter.publish)
    except Exception as exc:
        # the driver decides from it whether a restart would fail the same way
        mark_where_raised(exc)
        raise
    finally:
        reporter.close()


@dataclass(frozen=True)
class Seat:
    """Where one rank's loop runs: its group's size, its rank, its device, and when its process
    entered it."""

    world: int
    rank: int
    device: torch.device
    entered: float


@dataclass(frozen=True)
class Shards:
    """The rank's data as Ray Train (or a Tune trial) hands it over: its training shard, its
    validation shard (None without data.val) and `whole_train`, the training data unsplit, read when
    an epoch that a group of another size began is finished here (pipelines/rest.py); None where no
    such epoch can come."""

    train: Any
    val: Any | None
    whole_train: Callable[[], Any] | None = None


def rank_shard(spec: WorkerSpec, name: str, seat: Seat, otherwise: Callable[[str], Any]) -> Any:
    """The rank's shard of dataset `name`: its part of held small data (pipelines/held.py), else
    `otherwise(name)` (Ray Train's split of the training data, its whole iterator of the validation
    data, of which the rank keeps its stride; in a Tune trial the whole iterator). Training takes
    equal parts (the ranks' steps stay aligned); validation takes every row once, so its figures do
    not depend on the world size."""
    held = spec.held.get(name)
    if held is not None:
        return held.shard(seat.rank, seat.world, seat.device, equal=name == "train")
    shard = otherwise(name)
    return (StridedShard(shard, seat.rank, seat.world) if name != "train" and seat.world > 1
            else shard)


def rank_config(spec: WorkerSpec, world: int) -> Config:
    """The run's config for a rank of a `world`-rank group, with this thread's denormal setting and
    torch's thread count applied (before its first parallel op, see flush_denormals): the first
    thing a rank does, under Ray Train or in a Tune trial."""
    cfg = for_world_size(config_from_dict(spec.config), world)
    if cfg.train.torch_threads is not None:  # None: Ray's OMP_NUM_THREADS, the worker's CPUs
        torch.set_num_threads(cfg.train.torch_threads)
    flush_denormals(cfg.train.flush_denormal)
    # fp32 on a GPU: TF32 only when asked (torch's own defaults differ between matmuls and cuDNN's
    # convolutions).
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    return cfg


def train_rank(spec: WorkerSpec, cfg: Config, seat: Seat,
               load_state: Callable[[], dict[str, Any] | None], shards: Shards,
               reporter: Reporter, notices: Notices | None,
               announce: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One rank from its device on: model, optimizer and data (`shards`) wired from `spec`, the
    checkpoint `load_state` returns restored, then `loop.run`. Shared by Ray Train's workers and a
    one-worker Tune trial that trains in its own process (tuning/trial.py): same seed, same set-up,
    same loop, same figures. `announce` gets `what_runs` before the first step (rank 0's goes to the
    driver's terminal)."""
    device = seat.device
    pretrained = (fetch_pretrained(cfg.model.pretrained, cfg.data.s3) if cfg.model.pretrained
                  else None)
    state = load_state()
    read_at = time.time()
    # the autopilot's choice of sync and (at this size) micro-batch
    cfg = kept_config(cfg, state, seat.world)
    decision = spec.cache_decision
    epoch, start = data_position(state, decision, seat.world)
    rest = epoch_rest(state, decision, seat.world, epoch, shards.whole_train)
    data = batches_ahead(spec, cfg, seat, shards, rest, state, (epoch, start))
    parts = build_parts(cfg, spec.in_features, device, pretrained)
    # When the group's last worker entered (the ranks have met in the model's first broadcast by
    # now, so this waits for none): a restart's stages then tell a late worker's start (on a
    # replacement node) from rank 0's set-up.
    last_in = ranks.all_reduce_max([seat.entered], device)[0]
    named = cfg.model.inputs is not None
    if cfg.train.micro_batch_size == "auto":
        # Before the checkpoint is restored: probing touches weights and optimizer state, then puts
        # them back.
        cfg = with_auto_micro_batch(cfg, parts, state, collate_sample(spec.sample, cfg.data, named),
                                    spec.node_ranks)
    if cfg.train.compile:
        compile_model(parts)
    progress = (restore(parts, state, decision) if state is not None
                else Progress(cache_decision=decision))
    # this attempt's claim, which its checkpoints' manifests name (resume.unloadable)
    attempt = spec.attempt
    progress.attempt = attempt[2].name if attempt else None
    # A restart's recovery stages: the checkpoint read, then the model built and the checkpoint
    # restored into it.
    restored = ({"at/checkpoint_read": read_at, "at/checkpoint_loaded": time.time()}
                if state is not None else {})
    del state  # the model and optimizer hold their copies now

    t = cfg.train
    data = data or rank_batches(spec, cfg, seat, shards.train, shards.val, rest)
    # Facts only a worker knows, sent with the first report of every (re)start.
    global_batch = t.micro_batch_size * t.grad_accum_steps * seat.world  # type: ignore[operator]
    facts = {"precision": parts.precision.mode, "grad_accum_steps": t.grad_accum_steps,
             "global_batch": global_batch, "worker_pid": os.getpid(), "world_rank": seat.rank,
             "at/worker": seat.entered, "at/last_worker": last_in} | restored
    if announce is not None:
        announce(what_runs(parts, cfg, seat, progress.step))
    if cfg.failure.mode == "replicas":
        return run_replica(cfg, parts, data, reporter, progress, facts, seat, spec.train_rows)
    return run(cfg, parts,
               Data(data.train, data.val if cfg.data.val is not None else None, data.resize),
               reporter, progress, notices, facts)


def epoch_rest(state: dict[str, Any] | None, decision: str | None, world: int, epoch: int,
               whole_train: Callable[[], Any] | None
               ) -> tuple[int, np.ndarray, Callable[[], Any]] | None:
    """The rest this rank finishes of the checkpoint's epoch `epoch` when a group of another size
    began it (`rank_batches`'s `rest`: the epoch, the ids it has trained on, `whole_train`), else
    None."""
    if (seen := rest_of_epoch(state, decision, world)) is None:
        return None
    if whole_train is None:
        raise RuntimeError(f"epoch {epoch} was begun by another group: "
                           "this rank cannot read its rest")
    return (epoch, seen, whole_train)


def batches_ahead(spec: WorkerSpec, cfg: Config, seat: Seat, shards: Shards,
                  rest: tuple[int, np.ndarray, Callable[[], Any]] | None,
                  state: dict[str, Any] | None, position: tuple[int, int]) -> RankBatches | None:
    """The rank's data when its micro-batch is known before the model: the first step's data (from
    `position`, the epoch and the rows into it) is fetched while the model is built. None under
    train.micro_batch_size=auto and failure.mode=replicas."""
    if not (isinstance(cfg.train.micro_batch_size, int) and cfg.failure.mode != "replicas"):
        return None
    data = rank_batches(spec, cfg, seat, shards.train, shards.val, rest)
    resumed_step = (state or {}).get("progress", {}).get("step", 0)
    if resumed_step < cfg.train.max_steps:  # type: ignore[operator]
        data.prefetch(*position, cfg.train.grad_accum_steps)  # type: ignore[arg-type]
    return data


def what_runs(parts: Parts, cfg: Config, seat: Seat, step: int) -> dict[str, Any]:
    """What the group trains, as rank 0 set it up (report/progress.py `setup_line` prints it): the
    built model's parameters, the precision `auto` resolved to on this device, the devices, the
    micro-batch (`auto` found by now), the accumulation and the steps, from `step` on."""
    t = cfg.train
    device = (torch.cuda.get_device_name(seat.device) if seat.device.type == "cuda"
              else seat.device.type)
    micro, accumulation = t.micro_batch_size, t.grad_accum_steps
    # resolved for the world size by now
    assert isinstance(micro, int) and isinstance(accumulation, int)
    return {"event": "setup", "params": sum(p.numel() for p in unwrap(parts.model).parameters()),
            "precision": parts.precision.mode, "device": device, "workers": seat.world,
            "micro_batch": micro, "grad_accum_steps": accumulation,
            "global_batch": micro * accumulation * seat.world, "max_steps": t.max_steps,
            "from_step": step}


def rank_batches(spec: WorkerSpec, cfg: Config, seat: Seat, train_shard: Any, val_shard: Any | None,
                 rest: tuple[int, np.ndarray, Callable[[], Any]] | None = None) -> RankBatches:
    """The rank's micro-batches, cut at the config's (resolved) micro-batch size. `rest`: (epoch,
    the ids it has trained on, the training data unsplit) of an epoch that a group of another size
    began, finished here."""
    t = cfg.train
    # Under failure.mode=replicas every replica reads the same sequence (training/replicas.py:
    # StepRows): rank 0's.
    rank = 0 if cfg.failure.mode == "replicas" else seat.rank
    order = RankOrder(t.seed, rank, spec.epoch_clock, replay=spec.cache_decision == REPLAY)
    data = RankBatches(cfg.data, train_shard, val_shard,
                       t.micro_batch_size, order,  # type: ignore[arg-type]
                       named=cfg.model.inputs is not None,
                       schema=getattr(spec.sample, "schema", None),  # decides the padded columns
                       pin_memory=seat.device.type == "cuda")
    if rest is not None:
        epoch, seen, whole = rest
        data.finish(epoch, seen, whole(), seat.world)
    return data


def whole_train(spec: WorkerSpec, seat: Seat) -> Any:
    """The training data unsplit, as every rank of a Ray Train group reads it for a rest pass: held
    small data whole, else Ray Train's unsplit iterator of it (trainer.WHOLE_TRAIN)."""
    held = spec.held.get("train")
    return (held.shard(0, 1, seat.device) if held is not None
            else ray.train.get_dataset_shard(WHOLE_TRAIN))


def run_replica(cfg: Config, parts: Any, data: RankBatches, reporter: Reporter, progress: Progress,
                facts: dict[str, Any], seat: Seat, train_rows: int | None) -> dict[str, Any]:
    """failure.mode=replicas: this worker is one torchft replica (training/replicas.py), the step's
    rows numbered from the whole dataset that every replica reads (`train_rows`: its rows, when the
    driver knows them). Only the last step is checkpointed (a checkpoint is a barrier that a
    restarting replica could not reach), and drain notices are not watched (Ray Train turns its
    preemption watcher off for replica groups)."""
    # the `replicas` extra
    from orchestrator.training.replicas import ReplicaReporter, StepRows, join_replicas

    t = cfg.train
    micro: int = t.micro_batch_size  # type: ignore[assignment]  # fixed under replicas (config)
    last_step_only = cfg.checkpoint.model_copy(update={"every": t.max_steps})
    cfg = cfg.model_copy(update={"checkpoint": last_step_only})
    rows = StepRows(data.train, t.global_batch_size // micro, micro,
                    train_rows // micro if train_rows else None, seat.device)
    replicas = join_replicas(parts, progress, seat.rank, cfg.scaling.max_workers, rows)
    try:
        metrics = run(cfg, parts, Data(data.train, data.val if cfg.data.val is not None else None),
                      ReplicaReporter(reporter, replicas), progress, None, facts, replicas=replicas)
        replicas.finish()
        return metrics
    finally:
        replicas.shutdown()


def fetch_pretrained(uri: str, s3: Any) -> str:
    """A local directory holding the pretrained weights: `uri` itself, or for s3:// a copy on this
    node, fetched once by the first worker of the node (the others wait on a file lock) through the
    data layer's storage."""
    return fetch_prefix(uri, s3) if uri.startswith("s3://") else uri


def checkpoint_to_resume() -> dict[str, Any] | None:
    """The state of the checkpoint Ray Train restarts this group from (the newest complete one), or
    None."""
    return state_of(ray.train.get_checkpoint())


def state_of(checkpoint: ray.train.Checkpoint | None) -> dict[str, Any] | None:
    """The state of `checkpoint`, or of the newest complete one before it when it is incomplete;
    None if none. Of a sharded checkpoint (train.parallel=fsdp) only what every rank shares:
    `restore` reads the shards."""
    checkpoint = loadable_checkpoint(checkpoint)
    return None if checkpoint is None else read_checkpoint(checkpoint)


def stop_asked(request: tuple[Storage, str] | None, rank: int) -> Callable[[], bool] | None:
    """Whether the user stopped the run (Ctrl+C): rank 0 watches for the driver's request file
    (training/stop.py); the other ranks answer no (Cadence takes rank 0's answer). None without one
    (a Tune trial)."""
    if request is None:
        return None
    return StopWatch(*request) if rank == 0 else (lambda: False)


def preempted() -> bool:
    """Whether Ray is draining a node of this run and the drain's deadline is still ahead. Ray's
    part is a barrier that agrees on one notice; the clock is this rank's (Cadence takes rank 0's).
    Called at report steps only."""
    return notice_holds(ray.train.get_preemption_info(), time.time())


def notice_holds(info: ray.train.PreemptionInfo | None, now: float) -> bool:
    """Whether a drain notice (`info`, its deadline in epoch milliseconds, None when it gave none)
    holds at `now` (epoch seconds)."""
    return info is not None and (info.deadline_ms is None or now * 1000 < info.deadline_ms)
