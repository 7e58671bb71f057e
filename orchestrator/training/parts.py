"""What a training step needs: the built components (`Parts`), with the state its steps change as
the run goes (`StepState`), and how a worker builds them from the config."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from orchestrator.config import Config
from orchestrator.errors import ConfigError
from orchestrator.models.tasks import Classification, ModelCall, Task, align_model_loss, task_parts
from orchestrator.models.zoo import build_model
from orchestrator.training import fsdp, ranks
from orchestrator.training.optim import build_optimizer
from orchestrator.training.precision import Mode, Precision, resolve_precision
from orchestrator.training.sync import LocalSGD, build_local_sgd


class Quorum(Protocol):
    """failure.mode=replicas: this worker's replica (training/replicas.py `Replicas`) as a step sees
    it."""

    participants: int  # live replicas in the current step's quorum

    def count_sum(self, count: torch.Tensor) -> Any:
        """Start summing a step's target count over the quorum (the token normaliser): a Work to
        wait on."""


@dataclass
class StepState:
    """What this rank's steps change as the run goes (the loop, the autopilot and an out-of-memory
    retry), beside the built components."""

    # each micro-batch is cut in this many pieces (doubled after an out-of-memory error)
    split: int = 1
    # the autopilot's larger micro-batch: this many consecutive micro-batches run as one piece
    join: int = 1
    oom_retries: int = 0  # steps redone with smaller pieces after an out-of-memory error
    # bytes this rank has put into all-reduces of gradients, parameters and normalisers
    comm_bytes: int = 0
    # micro_batch_size=auto: values per row of what it measured (step.wider)
    probed: dict[str, int] | None = None
    # failure.mode=replicas: this worker's replica, over whose quorum the token
    replicas: Quorum | None = None
    # normaliser sums


@dataclass
class Parts:
    """What a step needs: the built components, and in `state` what the steps change (`StepState`).
    `model` may be DDP-wrapped (`unwrap(model)` is the bare module) or, under train.parallel=fsdp,
    sharded in place (`fsdp.is_sharded(model)`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    device: torch.device
    max_grad_norm: float | None = None
    # set when `model` is compiled: the fallback if compiling fails
    eager_model: torch.nn.Module | None = None
    # set for train.sync=local_sgd: no gradient all-reduce, periodic averaging
    local_sgd: LocalSGD | None = None
    # the loss as a sum with its target count, the metrics
    task: Task = field(default_factory=Classification)
    # how the model takes a batch: forward(x) or by name
    call: ModelCall = field(default_factory=ModelCall)
    model_loss: bool = False  # task.loss=model: the model's own loss (given labels), not the task's
    # fsdp: one reduce-scatter per step (train.fsdp.defer_sync), not one per micro-batch
    defer_sync: bool = False
    state: StepState = field(default_factory=StepState)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_parts(cfg: Config, in_features: int | None, device: torch.device,
                pretrained: str | None = None) -> Parts:
    """Model (wrapped in DDP by Ray Train for more than one worker, or sharded over all ranks under
    train.parallel=fsdp), optimizer, LR schedule, precision and the local-SGD state, on this
    worker's device. `pretrained`: a local directory to load the weights from."""
    t = cfg.train
    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's at wrap time;
    # FSDP does not, each rank keeps its shard of the weights it built).
    seed_everything(t.seed)
    model = build_model(cfg.model.name, cfg.model.entrypoint, in_features, cfg.model.num_classes,
                        cfg.model.kwargs, pretrained)
    task, call, model_loss = task_parts(cfg)
    if model_loss:
        align_model_loss(model, task)
    precision = Precision(resolve_precision(t.precision, device), device)
    if t.parallel == "fsdp":
        model = shard(model, device, precision.mode, t.fsdp.blocks)
    elif ranks.world()[1] == 1:
        # One rank, as in a Tune trial that trains in its own process (no Ray Train context there):
        # all that prepare_model does for a group of one is move the model to the device.
        model = model.to(device)
    else:
        import ray.train.torch

        model = ray.train.torch.prepare_model(model)
    # Under FSDP after sharding: the optimizer holds (and its state grows on) this rank's shards
    # only.
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.max_steps)  # type: ignore[arg-type]
    return Parts(model, optimizer, scheduler, precision, device, cfg.optim.max_grad_norm,
                 local_sgd=build_local_sgd(t.sync, *t.local_sgd), task=task, call=call,
                 model_loss=model_loss, defer_sync=t.fsdp.defer_sync)


def shard(model: torch.nn.Module, device: torch.device, mode: Mode,
          blocks: list[str] | None) -> torch.nn.Module:
    """`fully_shard` on each block then the root, over every rank of the process group: the shards
    on `device`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("train.parallel=fsdp needs a process group (Ray Train starts one per "
                          "run): run it through orchestrator train, or set train.parallel=ddp")
    # Not moved to the device first: each fully_shard call moves its unit's parameters to the mesh's
    # device and shards them, so the device holds one whole block at a time, never the whole model.
    return fsdp.shard_model(model, mesh=fsdp.mesh_of_all_ranks(device), blocks=blocks,
                            precision=mode)


def rank_bytes(parts: Parts) -> dict[str, str | int]:
    """What this rank holds for parameters and optimizer state (its shards under FSDP; the whole
    model under DDP), with the parallel mode: facts the driver logs (after the first step, when the
    optimizer state exists)."""
    held = fsdp.local_bytes(parts.model, parts.optimizer)
    return {"parallel": "fsdp" if fsdp.is_sharded(parts.model) else "ddp",
            "param_bytes_per_rank": held["params"], "optimizer_bytes_per_rank": held["optimizer"]}


def compile_model(parts: Parts) -> None:
    """Compile the DDP-wrapped model (DDP's optimizer splits graphs at bucket boundaries), keeping
    the eager one as the fallback if compilation fails on the first step of this process."""
    if fsdp.is_sharded(parts.model):
        # The compile probe and its eager fallback run forward outside the agreed step: under FSDP
        # every forward holds all-gathers, and a rank that failed to compile would leave the others
        # waiting in one.
        raise ConfigError("train.compile=true does not combine with train.parallel=fsdp yet: set "
                          "train.compile=false (or train.parallel=ddp)")
    parts.eager_model = parts.model
    parts.model = torch.compile(parts.model)  # type: ignore[assignment]
