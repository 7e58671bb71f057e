from __future__ import annotations

import pytest
import torch

from orchestrator.config import OptimConfig
from orchestrator.training.optim import build_optimizer, lr_factor


def test_warmup_then_cosine_at_known_steps() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine")
    assert lr_factor(0, cfg, 110) == pytest.approx(0.1)
    assert lr_factor(9, cfg, 110) == pytest.approx(1.0)
    assert lr_factor(10, cfg, 110) == pytest.approx(1.0)  # decay starts after warmup
    assert lr_factor(60, cfg, 110) == pytest.approx(0.5)  # half-way through the cosine
    assert lr_factor(110, cfg, 110) == pytest.approx(0.0)


def test_linear_and_constant_and_floor() -> None:
    linear = OptimConfig(lr=1.0, warmup_steps=0, schedule="linear", min_lr_ratio=0.2)
    assert lr_factor(0, linear, 100) == pytest.approx(1.0)
    assert lr_factor(50, linear, 100) == pytest.approx(0.6)
    assert lr_factor(100, linear, 100) == pytest.approx(0.2)
    constant = OptimConfig(lr=1.0, warmup_steps=4, schedule="constant")
    assert [lr_factor(s, constant, 100) for s in (0, 3, 50)] == pytest.approx([0.25, 1.0, 1.0])


def test_scheduler_drives_optimizer_lr() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=0.5, warmup_steps=2, schedule="constant"), 10)
    seen = []
    for _ in range(3):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.25, 0.5, 0.5])


def test_sgd_uses_momentum_default() -> None:
    optimizer, _ = build_optimizer(torch.nn.Linear(2, 2), OptimConfig(name="sgd", lr=0.1), 10)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9
