"""The micro-batch a worker trains with: the configured one at this group's world size, or under
`train.micro_batch_size=auto` the largest that fits the device (a probe on the GPU, an estimate on
the CPU), agreed by all ranks and kept across a resume at the same world size. It is measured on the
driver's sample rows: a micro-batch padded longer than they are is cut by the step to their size
(step.wider)."""

from __future__ import annotations

import os
from typing import Any

import psutil
import torch
import torch.distributed as dist

from orchestrator.config import Config
from orchestrator.config.batching import split_batch
from orchestrator.errors import ConfigError
from orchestrator.models.tasks import step_loss_sum
from orchestrator.training import fsdp, ranks
from orchestrator.training.checkpoint import unwrap
from orchestrator.training.memory import (
    GIB,
    activation_bytes_per_sample,
    fit_micro_batch_cpu,
    fit_micro_batch_cuda,
    release_cached_memory,
    state_bytes,
)
from orchestrator.training.parts import Parts
from pipelines.tensors import Batch, rows, take, to_device


def probe_batch(sample: Batch, size: int, device: torch.device) -> Batch:
    """`size` rows for memory probing: the driver's sample rows repeated (real shapes and values,
    any inputs)."""
    index = torch.arange(size, device="cpu") % rows(sample)  # the sample rows are on the host
    return to_device(take(sample, index), device)


def choose_micro_batch(cfg: Config, parts: Parts, sample: Batch,
                       node_ranks: int | None = None) -> int:
    """The largest micro-batch (a divisor of the per-worker batch) that fits, agreed by all ranks
    (their minimum). `node_ranks`: see cpu_budget."""
    world, device = ranks.world()[1], parts.device
    per_worker = cfg.train.global_batch_size // world
    model = unwrap(parts.model)

    def loss_of(batch: Batch) -> torch.Tensor:
        with parts.precision.autocast():
            output = parts.call(model, batch)
        return step_loss_sum(parts.task, output, batch, parts.model_loss)

    basis = ""
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
            budget, basis = cpu_budget(cfg.train.memory_budget_gb, node_ranks)
            batch = probe_batch(sample, min(per_worker, 8), device)
            per_sample = activation_bytes_per_sample(model, rows(batch), lambda: loss_of(batch))
            slots = 2 if cfg.optim.name == "adamw" else 1
            size = fit_micro_batch_cpu(per_worker, state_bytes(model, slots), per_sample, budget)
    agreed = torch.tensor([size], device=device)
    if world > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    size = int(agreed.item())
    if ranks.world()[0] == 0:
        workers = f"{world} worker{'s' * (world > 1)}"
        print(f"auto micro-batch: {size} per worker x {per_worker // size} "
              f"accumulation x {workers} = global batch "
              f"{cfg.train.global_batch_size}{basis and f' ({basis})'}", flush=True)
    return size


def checkpoint_micro_batch(state: dict[str, Any] | None, per_worker: int, world: int) -> int | None:
    """The micro-batch an auto-sized run checkpointed with, when this group resumes it at the same
    world size: a new measurement may pick another size (the CPU budget depends on how many workers
    share a node, the GPU probe on fragmentation), and with it another summation order and
    end-of-epoch remainder than the run it continues."""
    if state is None or not state.get("micro_batch_size") or len(state["rng"]) != world:
        return None
    micro = int(state["micro_batch_size"])
    return micro if per_worker % micro == 0 else None


def for_world_size(cfg: Config, world: int, micro: int | None = None) -> Config:
    """The config at the world size this group actually has (an elastic group keeps its micro-batch
    and global batch across resizes), with `micro` when measured (auto): the accumulation derived
    once more, in batching.py."""
    t = cfg.train
    micro = (micro if micro is not None
             else t.micro_batch_size if isinstance(t.micro_batch_size, int) else None)
    if micro is None:
        return cfg  # auto: measured later, at this world size
    try:
        micro, accum = split_batch(t.global_batch_size, world, micro)
    except ValueError as exc:
        raise ConfigError(f"{exc}: fix scaling.num_workers") from None
    return cfg.model_copy(update={"train": t.model_copy(update={"micro_batch_size": micro,
                                                                "grad_accum_steps": accum})})


def cpu_budget(budget_gb: float | None, node_ranks: int | None = None) -> tuple[float, str]:
    """Bytes one CPU rank may plan for, and the line saying where that figure comes from:
    train.memory_budget_gb, or half this node's memory shared by the ranks on it: `node_ranks` (in a
    study, the ranks of all its trials that may run on this node at once), else this run's own ranks
    on the node."""
    if budget_gb:
        return budget_gb * GIB, f"budget {budget_gb:g} GiB: train.memory_budget_gb"
    total, ranks = psutil.virtual_memory().total, node_ranks or _ranks_on_this_node()
    whose = "of the study's trials at once" if node_ranks else "of this run"
    return total / 2 / ranks, (f"budget {total / 2 / ranks / GIB:.2f} GiB: "
                               f"half of this node's {total / GIB:.2f} GiB "
                               f"over {ranks} rank{'s' * (ranks > 1)} {whose}")


def _ranks_on_this_node() -> int:
    """Ranks sharing this node's memory: Ray Train sets LOCAL_WORLD_SIZE in each worker; a Tune
    trial that trains in its own process is one rank."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def refuse_auto_under_fsdp(parts: Parts) -> None:
    """The probe runs forwards of its own sizes and, on a GPU, stops at an out-of-memory error:
    under FSDP every forward holds all-gathers, so one rank running out while the others go on would
    leave them waiting."""
    if fsdp.is_sharded(parts.model):
        raise ConfigError("train.micro_batch_size=auto cannot probe memory "
                          "under train.parallel=fsdp: set "
                          "train.micro_batch_size to a number of rows per worker")


def with_auto_micro_batch(cfg: Config, parts: Parts, state: dict[str, Any] | None, sample: Batch,
                          node_ranks: int | None = None) -> Config:
    """`train.micro_batch_size=auto` resolved on this group: the checkpoint's micro-batch when
    resuming at the same world size, else the largest that fits (measured here, agreed by all
    ranks); the accumulation derived from it."""
    refuse_auto_under_fsdp(parts)
    # the process group's: Ray Train's, or one rank in a Tune trial's own process
    rank, world = ranks.world()
    micro = checkpoint_micro_batch(state, cfg.train.global_batch_size // world, world)
    if micro is None:
        micro = choose_micro_batch(cfg, parts, sample, node_ranks)
    elif rank == 0:
        print(f"auto micro-batch: {micro} per worker, as in the checkpoint", flush=True)
    # What the size was measured on, per row (the sample's, padded to its longest row): the step
    # cuts a micro-batch padded longer into pieces no larger (step.wider), as the checkpoint's size
    # was measured on the same rows.
    parts.state.probed = {key: value.numel() // rows(sample) for key, value in sample.items()
                          if value.numel()}
    release_cached_memory(parts.device)
    return for_world_size(cfg, world, micro)
