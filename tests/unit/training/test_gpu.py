"""CUDA code paths: fp16 + GradScaler, auto micro-batch probing, memory statistics, OOM recovery.
Skipped without a CUDA device (see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from test_loop import xy

from orchestrator.config import load_config
from orchestrator.models import GPT, mlp
from orchestrator.tasks import CausalLM
from orchestrator.training.memory import cuda_memory_stats, fit_micro_batch_cuda
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision, resolve_precision
from orchestrator.training.step import train_step

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def cuda_parts(model: torch.nn.Module, mode: str) -> Parts:
    cfg = load_config(None, ["scaling.num_workers=1", "scaling.use_gpu=true"])
    model = model.to(CUDA)
    optimizer, scheduler = build_optimizer(model, cfg.optim, 100)
    return Parts(model, optimizer, scheduler, Precision(mode, CUDA), CUDA, 1.0)  # type: ignore[arg-type]


def test_fp16_uses_a_grad_scaler_and_counts_skipped_steps() -> None:
    parts = cuda_parts(mlp(16, 4, hidden=[32]), "fp16")
    x, y = torch.randn(64, 16, device=CUDA), torch.randint(0, 4, (64,), device=CUDA)
    assert parts.precision.scaler is not None
    assert torch.isfinite(train_step(parts, [xy(x, y)]).loss_sum)
    x[0, 0] = float("inf")  # overflowing gradients: the scaler skips the update and lowers its scale
    before = [p.detach().clone() for p in parts.model.parameters()]
    train_step(parts, [xy(x, y)])
    assert parts.precision.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, parts.model.parameters(), strict=True))


def test_auto_precision_prefers_bf16_on_cuda() -> None:
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert resolve_precision("auto", CUDA) == expected


def test_probe_finds_a_micro_batch_and_memory_stats_are_logged() -> None:
    model = GPT(256, 256, d_model=256, n_layer=2, n_head=4).to(CUDA)
    optimizer = torch.optim.AdamW(model.parameters())

    def try_step(size: int) -> None:
        tokens = torch.randint(0, 256, (size, 257), device=CUDA)
        CausalLM().loss_sum(model(tokens[:, :-1]), {"labels": tokens[:, 1:]}).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    assert fit_micro_batch_cuda(64, try_step, CUDA) == 64  # a small model: the whole batch fits
    stats = cuda_memory_stats(CUDA)
    assert stats["memory/reserved_gb"] >= stats["memory/allocated_gb"] >= 0
    assert stats["memory/reserved_unused_gb"] == pytest.approx(
        stats["memory/reserved_gb"] - stats["memory/allocated_gb"])
