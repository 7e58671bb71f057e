"""MFU against the peak of the precision a run uses (a GPU emulated by stubs on the CPU), and the TF32 switch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.training.handoff import WorkerSpec
from orchestrator.training.timing import peak_flops
from orchestrator.training.worker import rank_config

CUDA = torch.device("cuda", 0)


@pytest.fixture
def h100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.fixture
def tf32_flags() -> Iterator[None]:
    """torch's TF32 switches put back after the test (plain attributes of torch's backend modules)."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@pytest.mark.usefixtures("h100", "tf32_flags")
def test_the_peak_is_the_precisions_the_run_uses() -> None:
    assert peak_flops(CUDA, None, "bf16") == peak_flops(CUDA, None, "fp16") == 989e12
    torch.backends.cuda.matmul.allow_tf32 = False
    assert peak_flops(CUDA, None, "fp32") == 67e12  # strict fp32: no tensor cores, 1/15 of bf16's peak
    torch.backends.cuda.matmul.allow_tf32 = True
    assert peak_flops(CUDA, None, "fp32") == 989e12 / 2  # TF32 tensor cores
    assert peak_flops(CUDA, 100.0, "fp32") == 100e12  # train.peak_tflops wins
    assert peak_flops(torch.device("cpu"), None, "fp32") is None


@pytest.mark.usefixtures("tf32_flags")
def test_tf32_is_off_unless_asked_and_refused_without_a_gpu() -> None:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # cuDNN's is torch's default
    spec = WorkerSpec(config=load_config(None, ["scaling.num_workers=1"]).model_dump(mode="json"))
    rank_config(spec, 1)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    with pytest.raises(ConfigError, match="train.tf32=true needs a GPU"):
        load_config(None, ["train.tf32=true"])
    assert load_config(None, ["train.tf32=true", "scaling.use_gpu=true"]).train.tf32
