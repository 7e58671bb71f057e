"""Optimizers and learning-rate schedules (warmup, then cosine/linear/constant)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from orchestrator.config import OptimConfig
from orchestrator.models.registry import Registry

OptimizerBuilder = Callable[[Iterable[torch.nn.Parameter], OptimConfig], torch.optim.Optimizer]
OPTIMIZERS: Registry[OptimizerBuilder] = Registry("optimizer")
SCHEDULES: Registry[Callable[[float], float]] = Registry("schedule")


@OPTIMIZERS.register("adamw")
def adamw(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    params = list(params)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                             **kernel(params, sharded=True))


@OPTIMIZERS.register("sgd")
def sgd(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    params = list(params)
    momentum = 0.9 if cfg.momentum is None else cfg.momentum
    return torch.optim.SGD(params, lr=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay,
                           nesterov=momentum > 0, **kernel(params, sharded=False))


def kernel(params: list[torch.nn.Parameter], sharded: bool) -> dict[str, bool]:
    """torch's fused kernel where it has one for every parameter's device and dtype (and, for FSDP's
    sharded parameters, where torch 2.13 can run it on them: `sharded`, AdamW's but not SGD's), else
    its default (foreach on GPUs). torch never picks fused by itself, though it is the fastest (one
    kernel for all parameters: 1.5x the samples/s of the per-tensor loop for bench/overhead.py's MLP
    on CPU) and the only one that takes a `found_inf` flag, which lets a non-finite step be skipped
    on the device without a host read (precision.step_unless)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    fused = bool(params) and all(p.is_floating_point() and p.device.type in devices
                                 and (sharded or not isinstance(p, DTensor)) for p in params)
    return {"fused": True} if fused else {}


# Decay shapes over progress in [0, 1] after warmup: 1 at the start, 0 at the end.
SCHEDULES.register("cosine")(lambda p: 0.5 * (1.0 + math.cos(math.pi * p)))
SCHEDULES.register("linear")(lambda p: 1.0 - p)
SCHEDULES.register("constant")(lambda p: 1.0)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr for the update made at optimizer step `step` (0-based).

    Indexed by optimizer steps at a fixed global batch, i.e. by samples seen, so a change of
    micro-batch or worker count that keeps the global batch does not bend the curve.
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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lambda step: lr_factor(step, cfg, total_steps))
    return optimizer, scheduler
