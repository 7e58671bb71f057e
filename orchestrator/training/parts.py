"""What a training step needs (`Parts`) and how a worker builds it from the config."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from orchestrator.config import Config
from orchestrator.models import build_model
from orchestrator.tasks import Classification, ModelCall, Task, align_model_loss, task_parts
from orchestrator.training.optim import build_optimizer
from orchestrator.training.precision import Precision, resolve_precision
from orchestrator.training.sync import LocalSGD, build_local_sgd


@dataclass
class Parts:
    """What a step needs. `model` may be DDP-wrapped; `unwrap(model)` is the bare module."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    device: torch.device
    max_grad_norm: float | None = None
    split: int = 1  # each micro-batch is cut in this many pieces (doubled after an out-of-memory error)
    oom_retries: int = 0
    eager_model: torch.nn.Module | None = None  # set when `model` is compiled: the fallback if compiling fails
    local_sgd: LocalSGD | None = None  # set for train.sync=local_sgd: no gradient all-reduce, periodic averaging
    comm_bytes: int = 0  # bytes this rank has put into all-reduces of gradients, parameters and normalisers
    task: Task = field(default_factory=Classification)  # the loss as a sum with its target count, the metrics
    call: ModelCall = field(default_factory=ModelCall)  # how the model takes a batch: forward(x) or by name
    model_loss: bool = False  # task.loss=model: the model's own loss (given labels), not the task's


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_parts(cfg: Config, in_features: int | None, device: torch.device, pretrained: str | None = None) -> Parts:
    """Model (wrapped in DDP by Ray Train for more than one worker), optimizer, LR schedule, precision and the
    local-SGD state, on this worker's device. `pretrained`: a local directory to load the weights from."""
    import ray.train.torch

    t = cfg.train
    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's at wrap time).
    seed_everything(t.seed)
    model = build_model(cfg.model.name, cfg.model.entrypoint, in_features, cfg.model.num_classes, cfg.model.kwargs,
                        pretrained)
    task, call, model_loss = task_parts(cfg)
    if model_loss:
        align_model_loss(model, task)
    model = ray.train.torch.prepare_model(model)
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.max_steps)  # type: ignore[arg-type]
    return Parts(model, optimizer, scheduler, Precision(resolve_precision(t.precision, device), device), device,
                 cfg.optim.max_grad_norm, local_sgd=build_local_sgd(t.sync, *t.local_sgd), task=task, call=call,
                 model_loss=model_loss)


def compile_model(parts: Parts) -> None:
    """Compile the DDP-wrapped model (DDP's optimizer splits graphs at bucket boundaries), keeping the eager one as
    the fallback if compilation fails on the first step of this process."""
    parts.eager_model = parts.model
    parts.model = torch.compile(parts.model)  # type: ignore[assignment]
