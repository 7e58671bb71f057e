"""The function every Ray Train worker runs: rebuild the config, wire model/optimizer/data, call `loop.run`."""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch

from orchestrator.config import Config, config_from_dict
from orchestrator.errors import ConfigError
from orchestrator.models import build_model
from orchestrator.train.checkpoint import load_state
from orchestrator.train.loop import Parts, restore, run
from orchestrator.train.optim import build_optimizer
from orchestrator.train.precision import Precision, resolve_precision
from orchestrator.train.resume import checkpoint_dir_name, loadable_checkpoint
from orchestrator.train.sync import build_local_sgd
from pipelines.batches import FeatureCollate, fetch_size, split_batches
from pipelines.order import local_shuffle_seed, set_epoch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet_report_log() -> None:
    """Ray 2.60 logs every report at INFO under a logger named by file path, which RunConfig's logging_config
    does not reach (it filters 'ray.train*' names); silence just that logger so progress stays readable."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray version: nothing to work around
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def for_world_size(cfg: Config, world: int) -> Config:
    """The accumulation for the world size this group actually has: an elastic group keeps its micro-batch and
    global batch across resizes (global = micro x accum x world; the config checked every size in range)."""
    t = cfg.train
    if not isinstance(t.micro_batch_size, int):
        return cfg  # auto: measured below, at this world size
    accum, rest = divmod(t.global_batch_size, t.micro_batch_size * world)
    if rest or not accum:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not micro_batch_size="
                          f"{t.micro_batch_size} x accumulation x {world} workers: fix scaling.num_workers")
    return cfg.model_copy(update={"train": t.model_copy(update={"grad_accum_steps": accum})})


def train_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Entry point passed to TorchTrainer. `spec` = {"config": resolved config dict, "in_features": int}."""
    quiet_report_log()
    cfg = config_from_dict(spec["config"])
    cfg = for_world_size(cfg, ray.train.get_context().get_world_size())
    t = cfg.train
    device = ray.train.torch.get_device()
    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's at wrap time).
    seed_everything(t.seed)
    mode = resolve_precision(t.precision, device)
    model = build_model(cfg.model.name, cfg.model.entrypoint, spec["in_features"], cfg.model.num_classes,
                        cfg.model.kwargs)
    if t.compile:
        model = torch.compile(model)  # type: ignore[assignment]
    model = ray.train.torch.prepare_model(model)
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.max_steps)  # type: ignore[arg-type]
    parts = Parts(model, optimizer, scheduler, Precision(mode, device), device, cfg.optim.max_grad_norm,
                  local_sgd=build_local_sgd(t.sync, *t.local_sgd))

    progress = None
    checkpoint = loadable_checkpoint(ray.train.get_checkpoint())
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            progress = restore(parts, load_state(directory))

    collate = FeatureCollate(cfg.data.features, cfg.data.label)
    train_shard = ray.train.get_dataset_shard("train")
    context = ray.train.get_context()

    fetch = fetch_size(t.micro_batch_size)  # type: ignore[arg-type]

    def batches(shard: Any, drop_last: bool, shuffle_seed: int | None = None) -> Any:
        buffer = cfg.data.shuffle_buffer if shuffle_seed is not None else None
        chunks = shard.iter_torch_batches(batch_size=fetch, prefetch_batches=cfg.data.prefetch_batches,
                                          collate_fn=collate, local_shuffle_buffer_size=buffer,
                                          local_shuffle_seed=shuffle_seed)
        return split_batches(chunks, t.micro_batch_size, drop_last)  # type: ignore[arg-type]

    def train_batches(epoch: int) -> Any:
        # Before this rank starts the epoch: the reader draws the epoch's shard order from the clock once all
        # ranks have arrived (streaming_split's epoch barrier), so a resumed run re-reads the same order.
        if spec.get("epoch_clock"):
            set_epoch(spec["epoch_clock"], epoch)
        # Seeded per (seed, epoch, rank): a re-streamed epoch after a restart shuffles identically.
        seed = local_shuffle_seed(t.seed, epoch, context.get_world_rank()) if cfg.data.shuffle_buffer else None
        # Every rank holds the same number of rows (equal split), so dropping the incomplete last micro-batch
        # leaves equal batch counts on every rank and the collectives stay aligned.
        return batches(train_shard, drop_last=True, shuffle_seed=seed)

    val_batches = None
    if cfg.data.val is not None:
        val_shard = ray.train.get_dataset_shard("val")

        def val_batches() -> Any:
            return batches(val_shard, drop_last=False)

    context = ray.train.get_context()
    first_report = True

    def report(metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        nonlocal first_report
        if first_report:  # facts only a worker knows, sent once per (re)start
            metrics = {**metrics, "precision": mode, "grad_accum_steps": t.grad_accum_steps,
                       "global_batch": t.micro_batch_size * t.grad_accum_steps * context.get_world_size(),
                       "worker_pid": os.getpid(), "world_rank": context.get_world_rank()}
            first_report = False
        if checkpoint_dir is None:
            ray.train.report(metrics)
            return
        mode_ = ray.train.CheckpointUploadMode.SYNC
        if cfg.checkpoint.upload == "async":
            # Ray copies in a background thread and deletes the directory when done, while the loop deletes the
            # directory it handed over as soon as report returns: hand Ray a renamed one (a rename, not a copy).
            handed, checkpoint_dir = checkpoint_dir, f"{checkpoint_dir}-upload"
            os.rename(handed, checkpoint_dir)
            mode_ = ray.train.CheckpointUploadMode.ASYNC
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir),
                         checkpoint_dir_name=checkpoint_dir_name(metrics["step"]), checkpoint_upload_mode=mode_)

    def preempted() -> bool:
        # A barrier (rank 0's view broadcast to all); the loop calls it at report steps only.
        return ray.train.get_preemption_info() is not None

    return run(cfg, parts, train_batches, val_batches, report, progress,
               preempted if cfg.checkpoint.on_preemption else None)
