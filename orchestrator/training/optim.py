"""Optimizers and learning-rate schedules (warmup, then cosine/linear/constant)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from orchestrator.config import OptimConfig
from orchestrator.registry import Registry

OptimizerBuilder = Callable[[Iterable[torch.nn.Parameter], OptimConfig], torch.optim.Optimizer]
OPTIMIZERS: Registry[OptimizerBuilder] = Registry("optimizer")
SCHEDULES: Registry[Callable[[float], float]] = Registry("schedule")


@OPTIMIZERS.register("adamw")
def adamw(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


@OPTIMIZERS.register("sgd")
def sgd(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    momentum = 0.9 if cfg.momentum is None else cfg.momentum
    return torch.optim.SGD(params, lr=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay, nesterov=momentum > 0)


# Decay shapes over progress in [0, 1] after warmup: 1 at the start, 0 at the end.
SCHEDULES.register("cosine")(lambda p: 0.5 * (1.0 + math.cos(math.pi * p)))
SCHEDULES.register("linear")(lambda p: 1.0 - p)
SCHEDULES.register("constant")(lambda p: 1.0)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr for the update made at optimizer step `step` (0-based).

    Indexed by optimizer steps at a fixed global batch, i.e. by samples seen, so a change of micro-batch or
    worker count that keeps the global batch does not bend the curve.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * SCHEDULES.get(cfg.schedule)(progress)


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = OPTIMIZERS.get(cfg.name)(model.parameters(), cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
    return optimizer, scheduler
