"""The function every Ray Train worker runs: rebuild the config, wire model/optimizer/data, call `loop.run`."""

from __future__ import annotations

import os
import time
from typing import Any

import psutil
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from orchestrator.batching import split_batch
from orchestrator.config import Config, config_from_dict
from orchestrator.errors import ConfigError
from orchestrator.tasks import step_loss_sum
from orchestrator.training.checkpoint import Progress, load_state, restore, unwrap
from orchestrator.training.loop import run
from orchestrator.training.memory import (
    GIB,
    activation_bytes_per_sample,
    fit_micro_batch_cpu,
    fit_micro_batch_cuda,
    release_cached_memory,
    state_bytes,
)
from orchestrator.training.parts import Parts, build_parts, compile_model
from orchestrator.training.precision import flush_denormals
from orchestrator.training.reporting import RayReporter, quiet_report_log
from orchestrator.training.resume import loadable_checkpoint
from pipelines.batches import RankBatches, collate_sample
from pipelines.datasets import REPLAY
from pipelines.tensors import Batch, rows, take, to_device


def probe_batch(sample: Batch, size: int, device: torch.device) -> Batch:
    """`size` rows for memory probing: the driver's sample rows repeated (real shapes and values, any inputs)."""
    index = torch.arange(size, device="cpu") % rows(sample)  # the sample rows are on the host
    return to_device(take(sample, index), device)


def choose_micro_batch(cfg: Config, parts: Parts, sample: Batch) -> int:
    """The largest micro-batch (a divisor of the per-worker batch) that fits, agreed by all ranks (their minimum)."""
    context = ray.train.get_context()
    world, device = context.get_world_size(), parts.device
    per_worker = cfg.train.global_batch_size // world
    model = unwrap(parts.model)

    def loss_of(batch: Batch) -> torch.Tensor:
        with parts.precision.autocast():
            output = parts.call(model, batch)
        return step_loss_sum(parts.task, output, batch, parts.model_loss)

    # Dropout in the probes must not move the training RNG streams.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

            def try_step(size: int) -> None:
                loss_of(probe_batch(sample, size, device)).backward()
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
            batch = probe_batch(sample, min(per_worker, 8), device)
            per_sample = activation_bytes_per_sample(model, rows(batch), lambda: loss_of(batch))
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
    """Entry point passed to TorchTrainer. `spec` = {"config": resolved config dict, "in_features": int or None,
    "epoch_clock": name or None, "cache_decision": how the driver feeds the train data (pipelines.datasets:
    stream, memory or replay: the workers replay their first pass under replay; saved with every checkpoint's data
    position), "metrics_queue": Ray queue or None, "sample": the first rows of the training data (an Arrow table)}."""
    entered = time.time()
    quiet_report_log()
    context = ray.train.get_context()
    world, rank = context.get_world_size(), context.get_world_rank()
    cfg = for_world_size(config_from_dict(spec["config"]), world)
    flush_denormals(cfg.train.flush_denormal)  # before this thread's first parallel op (see its docstring)
    device = ray.train.torch.get_device()
    pretrained = fetch_pretrained(cfg.model.pretrained, cfg.data.s3) if cfg.model.pretrained else None
    parts = build_parts(cfg, spec["in_features"], device, pretrained)
    named = cfg.model.inputs is not None
    state = checkpoint_to_resume()
    if cfg.train.micro_batch_size == "auto":
        # Before the checkpoint is restored: probing touches weights and optimizer state, then puts them back.
        micro = checkpoint_micro_batch(state, cfg.train.global_batch_size // world, world)
        if micro is None:
            micro = choose_micro_batch(cfg, parts, collate_sample(spec["sample"], cfg.data, named))
        elif rank == 0:
            print(f"auto micro-batch: {micro} per worker, as in the checkpoint", flush=True)
        cfg = for_world_size(cfg, world, micro)
        release_cached_memory(device)
    if cfg.train.compile:
        compile_model(parts)
    decision = spec.get("cache_decision")
    progress = restore(parts, state, decision) if state is not None else Progress(cache_decision=decision)
    del state  # the model and optimizer hold their copies now

    t = cfg.train
    data = RankBatches(cfg.data, ray.train.get_dataset_shard("train"),
                       ray.train.get_dataset_shard("val") if cfg.data.val is not None else None,
                       t.micro_batch_size, t.seed, rank, spec.get("epoch_clock"),  # type: ignore[arg-type]
                       replay=decision == REPLAY, named=named,
                       schema=getattr(spec.get("sample"), "schema", None))  # decides the padded columns
    # Facts only a worker knows, sent with the first report of every (re)start.
    facts = {"precision": parts.precision.mode, "grad_accum_steps": t.grad_accum_steps,
             "global_batch": t.micro_batch_size * t.grad_accum_steps * world,  # type: ignore[operator]
             "worker_pid": os.getpid(), "world_rank": rank, "at/worker": entered}
    reporter = RayReporter(spec.get("metrics_queue"), cfg.checkpoint.upload)
    try:
        return run(cfg, parts, data.train, data.val if cfg.data.val is not None else None, reporter, progress,
                   preempted if cfg.checkpoint.on_preemption else None, facts)
    finally:
        reporter.close()


def fetch_pretrained(uri: str, s3: Any) -> str:
    """A local directory holding the pretrained weights: `uri` itself, or for s3:// a copy on this node, fetched
    once by the first worker of the node (the others wait on a file lock) through the data layer's storage."""
    from pipelines.storage import fetch_prefix

    return fetch_prefix(uri, s3) if uri.startswith("s3://") else uri


def checkpoint_to_resume() -> dict[str, Any] | None:
    """The state of the checkpoint Ray Train restarts this group from (the newest complete one), or None."""
    checkpoint = loadable_checkpoint(ray.train.get_checkpoint())
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return load_state(directory)


def preempted() -> bool:
    """Whether Ray is draining a node of this run. A barrier (rank 0's view broadcast to all); the loop calls it
    at report steps only."""
    return ray.train.get_preemption_info() is not None
