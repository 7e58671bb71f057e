from __future__ import annotations

import pytest
import torch

from orchestrator.config import OptimConfig
from orchestrator.training.optim import OPTIMIZERS, build_optimizer, lr_factor


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


def _fused(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The product's own optimizers, and torch's fused ones a user may bring (dampened SGD: its first step's buffer
    is the gradient itself, not (1 - dampening) x gradient, so a zero buffer would not stand in for a missing one)."""
    if kind in ("adamw", "sgd"):
        return OPTIMIZERS.get(kind)(params, OptimConfig(name=kind, lr=0.1))
    if kind == "adam_amsgrad":
        return torch.optim.Adam(params, lr=0.1, amsgrad=True, fused=True)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5, fused=True)


@pytest.mark.parametrize("kind", ["sgd", "adamw", "adam_amsgrad", "sgd_dampened"])
@pytest.mark.parametrize("scaled", [False, True], ids=["fp32", "grad_scaler"])
def test_a_skipped_first_step_leaves_the_optimizer_as_if_it_never_came(kind: str, scaled: bool) -> None:
    """A first step skipped on the device (a NaN loss; fp16's first overflow) creates no optimizer state: the next
    applied step moves the weights exactly as a fresh optimizer's first step does. torch's fused SGD creates its
    momentum buffers with empty_like before the kernel returns on found_inf, and stores them."""
    from orchestrator.training.precision import Precision

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=g), torch.randn(3, generator=g)]
    grads = [torch.randn(5, 3, generator=g), torch.randn(3, generator=g)]
    runs = {}
    for name, skips in {"skipped_first": [1.0, 0.0, 0.0], "fresh": [0.0, 0.0]}.items():
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = _fused(kind, params)
        assert optimizer.defaults.get("fused"), optimizer.defaults
        precision = Precision("fp32", torch.device("cpu"))
        if scaled:  # fp16's GradScaler path on the CPU: the same fused kernel, given the scaler's verdict
            precision.scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1000)
        for skip in skips:
            scale = precision.scaler.scale(torch.ones(())) if precision.scaler else 1.0  # as the loss is scaled
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad * scale
            precision.unscale_(optimizer)
            precision.step(optimizer, torch.tensor(skip))
        runs[name] = [p.detach().clone() for p in params]
        runs[name + "_state"] = optimizer.state_dict()["state"]
    for after_skip, fresh in zip(runs["skipped_first"], runs["fresh"], strict=True):
        torch.testing.assert_close(after_skip, fresh, rtol=0, atol=1e-7)
    for slot, fresh_state in runs["fresh_state"].items():
        for key, value in fresh_state.items():
            torch.testing.assert_close(runs["skipped_first_state"][slot][key], value, rtol=0, atol=1e-7)
