"""The function every Ray Train worker runs: rebuild the config, wire model/optimizer/data, call `loop.run`."""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import psutil
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from orchestrator.batching import split_batch
from orchestrator.config import Config, config_from_dict
from orchestrator.errors import ConfigError
from orchestrator.models import build_model
from orchestrator.training.checkpoint import load_state, unwrap
from orchestrator.training.loop import Batch, Parts, loss_sum, restore, run
from orchestrator.training.memory import (
    GIB,
    activation_bytes_per_sample,
    fit_micro_batch_cpu,
    fit_micro_batch_cuda,
    release_cached_memory,
    state_bytes,
)
from orchestrator.training.optim import build_optimizer
from orchestrator.training.precision import Precision, resolve_precision
from orchestrator.training.resume import checkpoint_dir_name, loadable_checkpoint
from orchestrator.training.sync import build_local_sgd
from pipelines.batches import EpochReplay, FeatureCollate, fetch_size, split_batches
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


def probe_batch(size: int, in_features: int, num_classes: int, tokens: bool, device: torch.device) -> Batch:
    """Random inputs of the training batch's shape, for memory probing: features and a class, or a sequence of
    `in_features` tokens and its next-token targets."""
    if tokens:
        sequence = torch.randint(0, num_classes, (size, in_features + 1), device=device)
        return sequence[:, :-1], sequence[:, 1:]
    return (torch.rand(size, in_features, device=device), torch.randint(0, num_classes, (size,), device=device))


def choose_micro_batch(cfg: Config, parts: Parts, in_features: int) -> int:
    """The largest micro-batch (a divisor of the per-worker batch) that fits, agreed by all ranks (their minimum)."""
    context = ray.train.get_context()
    world, device = context.get_world_size(), parts.device
    per_worker = cfg.train.global_batch_size // world
    model = unwrap(parts.model)
    classes = cfg.model.num_classes or 2
    # Dropout in the probes must not move the training RNG streams.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

            def try_step(size: int) -> None:
                x, y = probe_batch(size, in_features, classes, cfg.data.label is None, device)
                with parts.precision.autocast():
                    logits = model(x)
                loss_sum(logits, y).backward()
                parts.optimizer.step()  # allocates the optimizer state, part of the footprint
                parts.optimizer.zero_grad(set_to_none=True)

            try:
                size = fit_micro_batch_cuda(per_worker, try_step, device)
            finally:
                model.load_state_dict(saved)
                parts.optimizer.state.clear()
        else:
            budget = (cfg.train.memory_budget_gb * GIB if cfg.train.memory_budget_gb
                      else psutil.virtual_memory().total / 2 / context.get_local_world_size())
            x, y = probe_batch(min(per_worker, 8), in_features, classes, cfg.data.label is None, device)
            per_sample = activation_bytes_per_sample(model, x, lambda logits: loss_sum(logits, y))
            slots = 2 if cfg.optim.name == "adamw" else 1
            size = fit_micro_batch_cpu(per_worker, state_bytes(model, slots), per_sample, budget)
    agreed = torch.tensor([size], device=device)
    if world > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    size = int(agreed.item())
    if context.get_world_rank() == 0:
        print(f"auto micro-batch: {size} per worker x {per_worker // size} accumulation x {world} workers "
              f"= global batch {cfg.train.global_batch_size}", flush=True)
    return size


def checkpoint_micro_batch(state: dict[str, Any] | None, per_worker: int, world: int) -> int | None:
    """The micro-batch an auto-sized run checkpointed with, when this group resumes it at the same world size: a
    new measurement may pick another size (the CPU budget depends on how many workers share a node, the GPU probe
    on fragmentation), and with it another summation order and end-of-epoch remainder than the run it continues."""
    if state is None or not state.get("micro_batch_size") or len(state["rng"]) != world:
        return None
    micro = int(state["micro_batch_size"])
    return micro if per_worker % micro == 0 else None


def for_world_size(cfg: Config, world: int, micro: int | None = None) -> Config:
    """The config at the world size this group actually has (an elastic group keeps its micro-batch and global
    batch across resizes), with `micro` when measured (auto): the accumulation derived once more, in batching.py."""
    t = cfg.train
    micro = micro if micro is not None else t.micro_batch_size if isinstance(t.micro_batch_size, int) else None
    if micro is None:
        return cfg  # auto: measured later, at this world size
    try:
        micro, accum = split_batch(t.global_batch_size, world, micro)
    except ValueError as exc:
        raise ConfigError(f"{exc}: fix scaling.num_workers") from None
    return cfg.model_copy(update={"train": t.model_copy(update={"micro_batch_size": micro, "grad_accum_steps": accum})})


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
    model = ray.train.torch.prepare_model(model)
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.max_steps)  # type: ignore[arg-type]
    parts = Parts(model, optimizer, scheduler, Precision(mode, device), device, cfg.optim.max_grad_norm,
                  local_sgd=build_local_sgd(t.sync, *t.local_sgd))
    state = None
    checkpoint = loadable_checkpoint(ray.train.get_checkpoint())
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = load_state(directory)
    if t.micro_batch_size == "auto":
        # Before the checkpoint is restored: probing touches weights and optimizer state, then puts them back.
        world = ray.train.get_context().get_world_size()
        micro = checkpoint_micro_batch(state, t.global_batch_size // world, world)
        if micro is None:
            micro = choose_micro_batch(cfg, parts, spec["in_features"])
        elif ray.train.get_context().get_world_rank() == 0:
            print(f"auto micro-batch: {micro} per worker, as in the checkpoint", flush=True)
        cfg = for_world_size(cfg, world, micro)
        t = cfg.train
        release_cached_memory(device)
    if t.compile:
        # Compile the DDP-wrapped model (DDP's optimizer splits graphs at bucket boundaries); keep the eager one
        # as the fallback if compilation fails on the first step.
        parts.eager_model = parts.model
        parts.model = torch.compile(parts.model)  # type: ignore[assignment]

    progress = restore(parts, state) if state is not None else None
    del state  # the model and optimizer hold their copies now

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

    # Replayed only without a shuffle buffer (its order changes per epoch as it streams); with data.shuffle each
    # later epoch replays this rank's rows in a new order, seeded per (seed, epoch, rank).
    rank = context.get_world_rank()
    replay_train = EpochReplay(keep=bool(spec.get("replay_epochs")) and not cfg.data.shuffle_buffer,
                               reshuffle=(lambda e: local_shuffle_seed(t.seed, e, rank)) if cfg.data.shuffle else None)

    def train_batches(epoch: int) -> Any:
        return replay_train(lambda: stream_train(epoch), epoch)

    def stream_train(epoch: int) -> Any:
        # Before this rank starts the epoch: the reader draws the epoch's shard order from the clock once all
        # ranks have arrived (streaming_split's epoch barrier), so a resumed run re-reads the same order.
        if spec.get("epoch_clock"):
            set_epoch(spec["epoch_clock"], epoch)
        # Seeded per (seed, epoch, rank): a re-streamed epoch after a restart shuffles identically.
        seed = local_shuffle_seed(t.seed, epoch, rank) if cfg.data.shuffle_buffer else None
        # Every rank holds the same number of rows (equal split), so dropping the incomplete last micro-batch
        # leaves equal batch counts on every rank and the collectives stay aligned.
        return batches(train_shard, drop_last=True, shuffle_seed=seed)

    val_batches = None
    if cfg.data.val is not None:
        val_shard = ray.train.get_dataset_shard("val")
        replay_val = EpochReplay(keep=bool(spec.get("replay_epochs")))

        def val_batches() -> Any:
            return replay_val(lambda: batches(val_shard, drop_last=False))

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
